"""Weighted mixtures: every global batch within one sample of each weight, exact ids, a stream at any world size."""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import pytest
import torch
from helpers import TINY, one_line_exit_2, write_run_records
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

from ddptrain.checkpoint.compat import check_resume
from ddptrain.config import config_from_mapping
from ddptrain.data.corpus import PrepareOptions, prepare_corpus
from ddptrain.data.kinds import data_source
from ddptrain.data.mixture import MixtureDataset, MixturePart, MixtureSchedule
from ddptrain.data.sampler import ResumableDistributedSampler
from ddptrain.errors import CheckpointError, ConfigError
from ddptrain.review.report import mixture_shares, report

weights = st.lists(st.floats(0.01, 100, allow_nan=False), min_size=1, max_size=4)


class Numbered(Dataset[tuple[int, int]]):
    """Sample i of source `tag` is (tag, i): what the mixture hands out is visible."""

    def __init__(self, tag: int, size: int) -> None:
        self.tag, self.size = tag, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int]:
        assert 0 <= index < self.size
        return self.tag, index


@given(w=weights, batch=st.integers(1, 64))
@example(w=[1.0, 30.0, 30.0, 1.875], batch=1)  # drifted past one sample under the former "most behind first" rule
@settings(max_examples=20, deadline=None)  # 3,000 batches each (kept small for the unit budget)
def test_every_batch_of_3000_holds_each_share_within_one_sample(w: list[float], batch: int) -> None:
    schedule = MixtureSchedule(w, batch)
    share = [x / sum(w) * batch for x in w]
    taken = [0] * len(w)
    for k in range(3_000):
        quotas = schedule.quotas(k, taken)
        assert sum(quotas) == batch
        assert all(abs(q - s) < 1 for q, s in zip(quotas, share)), (k, quotas, share)
        taken = [t + q for t, q in zip(taken, quotas)]
        # the running totals never drift: within 1 sample of the weights (a little float slack in the check)
        assert all(abs(t - s * (k + 1)) < 1 + 1e-6 for t, s in zip(taken, share)), (k, taken)
    assert list(schedule.taken_before(3_000)) == taken  # the cached path agrees with the step-by-step one


@given(w=weights, batch=st.integers(1, 24), sizes=st.lists(st.integers(1, 30), min_size=4, max_size=4))
@settings(max_examples=30, deadline=None)
def test_each_source_gives_every_sample_once_per_epoch(w: list[float], batch: int, sizes: list[int]) -> None:
    parts = [MixturePart(f"s{i}", Numbered(i, n), x) for i, (x, n) in enumerate(zip(w, sizes))]
    mix = MixtureDataset(parts, batch, seed=7)
    steps = 40
    got = [mix[p] for p in range(steps * batch)]
    taken = mix.taken(steps)
    for i, part in enumerate(parts):
        ids = [index for tag, index in got if tag == i]
        assert len(ids) == taken[part.name]
        for start in range(0, len(ids), sizes[i]):  # each epoch of the source: a permutation, then the next
            chunk = ids[start : start + sizes[i]]
            assert len(set(chunk)) == len(chunk)
        assert mix.epochs(steps)[part.name] == len(ids) // sizes[i]


def test_random_access_agrees_with_reading_in_order() -> None:
    parts = [
        MixturePart("a", Numbered(0, 13), 0.5),
        MixturePart("b", Numbered(1, 7), 0.3),
        MixturePart("c", Numbered(2, 5), 0.2),
    ]
    in_order = MixtureDataset(parts, 10, seed=3)
    expected = [in_order[p] for p in range(3000 * 10)]
    shuffled = MixtureDataset(parts, 10, seed=3)  # a DataLoader worker, or a resumed run, starts anywhere
    for p in random.Random(0).sample(range(len(expected)), 300):
        assert shuffled[p] == expected[p]
    assert [MixtureDataset(parts, 10, seed=4)[p] for p in range(50)] != expected[:50]


@pytest.mark.parametrize("world_sizes", [(1, 2, 3, 1), (2, 3)])
def test_the_stream_is_the_same_at_any_world_size_across_resumes(world_sizes: tuple[int, ...]) -> None:
    """Ranks take their slices of each global batch; switching world size between steps loses and repeats nothing."""
    parts = [MixturePart("a", Numbered(0, 11), 2.0), MixturePart("b", Numbered(1, 5), 1.0)]
    mix = MixtureDataset(parts, 6, seed=1)
    reference = [mix[p] for p in range(60 * 6)]
    seen: list[tuple[int, int]] = []
    state = None
    for world in world_sizes:
        samplers = [ResumableDistributedSampler(len(mix), 6, r, world, seed=1, stream=True) for r in range(world)]
        iters = []
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
            iters.append(iter(s))
        for _ in range(15):  # 15 steps at this world size
            for s, it in zip(samplers, iters):
                seen.extend(mix[next(it)] for _ in range(6 // world))
                s.advance()
            if samplers[0].epoch_done:
                for s in samplers:
                    s.set_epoch(s.epoch + 1)
                iters = [iter(s) for s in samplers]
        state = samplers[0].state_dict()
    assert seen == reference[: len(seen)]


@pytest.mark.parametrize("bad", [[0.0, 1.0], [float("nan"), 1.0], [float("inf")], [-1.0, 2.0], []])
def test_weights_that_cannot_mix_are_refused(bad: list[float]) -> None:
    with pytest.raises(ConfigError, match="mixture weights must be positive and finite"):
        MixtureSchedule(bad, 8)


def test_a_batch_is_spread_over_its_sources() -> None:
    """Slot j of a batch goes to the source least served so far: a rank's contiguous slice holds a mix."""
    layout = MixtureSchedule([1, 1, 2], 8).layout(0)
    sources = [s for s, _ in layout]
    assert sorted(sources) == [0, 0, 1, 1, 2, 2, 2, 2]
    for half in (sources[:4], sources[4:]):
        assert sorted(half) == [0, 1, 2, 2]
    assert math.isclose(sum(1 for s in sources if s == 2) / 8, 0.5)
    assert torch.equal(torch.tensor([n for s, n in layout if s == 2]), torch.arange(4))


def test_a_mixture_of_corpora_with_different_vocabularies_is_refused(tmp_path: Path) -> None:
    text = Path(argparse.__file__)
    prepare_corpus([text], tmp_path / "bytes", 0.1)
    prepare_corpus([text], tmp_path / "bpe", 0.1, PrepareOptions(tokenizer="train:300"))
    parts = [
        {"name": "a", "weight": 1, "dir": str(tmp_path / "bytes")},
        {"name": "b", "weight": 1, "dir": str(tmp_path / "bpe")},
    ]
    source = data_source(config_from_mapping({"data": {"sources": parts}}).data)
    with pytest.raises(ConfigError, match=r"different vocabularies \(a 256, b 300\): a mixture needs one tokenizer"):
        source.vocab_size()
    same = data_source(
        config_from_mapping({"data": {"sources": [parts[0], {**parts[0], "name": "b", "weight": 3}]}}).data
    )
    assert same.vocab_size() == 256
    other_weights = data_source(config_from_mapping({"data": {"sources": [parts[0], {**parts[0], "name": "b"}]}}).data)
    assert same.resume_identity() != other_weights.resume_identity()  # a resume with other weights is refused
    with pytest.raises(CheckpointError, match=r"data.sources \(a 1.0, b 3.0 -> a 1.0, b 1.0\)"):
        check_resume(
            "step-00000004", {}, {"data": same.resume_identity()}, {}, {"data": other_weights.resume_identity()}
        )


def test_a_resume_after_a_source_was_prepared_again_names_that_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same names and weights, one source's corpus changed: the refusal names it (not `a 1.0, b 1.0 -> a 1.0, b 1.0`)."""
    from ddptrain.cli import main
    from ddptrain.data.corpus import read_meta

    text = Path(argparse.__file__)
    prepare_corpus([text], tmp_path / "a", 0.1)
    prepare_corpus([text], tmp_path / "b", 0.1)
    sources = (
        f"data.sources=[{{name: a, weight: 1, dir: {tmp_path / 'a'}}}, {{name: b, weight: 1, dir: {tmp_path / 'b'}}}]"
    )
    argv = ["train", *TINY, sources, f"run.dir={tmp_path / 'run'}", "train.max_steps=2", "train.eval_every=0"]
    assert main(argv) == 0
    before = read_meta(tmp_path / "b")["recipe"]
    prepare_corpus([Path(random.__file__)], tmp_path / "b", 0.1)
    assert read_meta(tmp_path / "b")["recipe"] != before
    capsys.readouterr()
    line = one_line_exit_2([*argv[:-2], "train.max_steps=4", "train.eval_every=0"], capsys)
    assert "cannot resume from step-00000002: changed data.sources b.dir (corpus SHA-256 " in line, line
    assert "data.sources a" not in line


def test_the_report_draws_each_sources_share_of_every_log_window(tmp_path: Path) -> None:
    taken = [{"a": 6, "b": 2}, {"a": 12, "b": 4}, {"a": 15, "b": 9}]
    records = [
        {"kind": "train", "step": 2 * (i + 1), "time": float(i), "loss": 1.0, "lr": 0.1, "step_time_s": 0.1,
         "samples_per_s": 1.0, "world_size": 1, "global_batch_size": 4, "source_samples": t}
        for i, t in enumerate(taken)
    ]  # fmt: skip
    write_run_records(tmp_path, records, "mix", 6)
    assert mixture_shares(records) == {"a": ([2, 4, 6], [75.0, 75.0, 37.5]), "b": ([2, 4, 6], [25.0, 25.0, 62.5])}
    summary, files = report(tmp_path)
    assert "data mixture: a 15 (62.5%), b 9 (37.5%) by step 6" in summary
    assert tmp_path / "report" / "mixture.png" in files


def test_a_mixture_records_each_sources_val_loss_as_eval_gives_it_alone(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """val_loss reads the sources' validation sets one after another (with few eval batches: the first source's
    only); val_loss/<name> is each source's own, what `ddptrain eval` gives on that source alone."""
    import re

    from helpers import read_metrics
    from toys import TINY

    from ddptrain.cli import main

    other = prepare_corpus([Path(argparse.__file__)], tmp_path / "other", 0.1).out_dir
    run = tmp_path / "run"
    sources = f"data.sources=[{{name: mine, weight: 1, dir: {corpus_dir}}}, {{name: other, weight: 3, dir: {other}}}]"
    argv = [*TINY, sources, f"run.dir={run}", "train.max_steps=3", "train.eval_every=3", "train.eval_batches=2"]
    assert main(["train", *argv]) == 0
    (record,) = read_metrics(run, "eval")
    assert set(record) >= {"val_loss", "val_loss/mine", "val_loss/other"}
    assert record["val_loss/mine"] != record["val_loss/other"]
    capsys.readouterr()
    for name, folder in (("mine", corpus_dir), ("other", other)):
        assert main(["eval", str(run), "data.sources=[]", f"data.dir={folder}", "--batches", "2"]) == 0
        alone = float(re.findall(r"loss (\d+\.\d+)", capsys.readouterr().out)[0])
        assert alone == pytest.approx(record[f"val_loss/{name}"], abs=2e-6)
    summary, files = report(run)
    assert run / "report" / "loss.png" in files and "loss/mine" not in summary  # not taken for a metric of one's own
