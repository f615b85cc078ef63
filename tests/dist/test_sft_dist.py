"""Instruction data under torchrun (gloo, 2 ranks): the loss is on answers only, as one mean over all ranks' tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import TINY, final_model_state, load_token_datasets, read_metrics, run_ddptrain

from ddptrain.config import load_config
from ddptrain.data.corpus import PrepareOptions, prepare_corpus
from ddptrain.data.sampler import ResumableDistributedSampler
from ddptrain.train.data_input import target_tokens

pytestmark = pytest.mark.dist
SFT = PrepareOptions(sft="prompt,completion")


def _records(path: Path, completion: object, n: int = 400) -> Path:
    """n records: a prompt of random letters ending with a key digit k, and completion(k, rng) as the answer;
    `text` holds both (the same data for a run without masks)."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            key = rng.randrange(10)
            prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(6, 20))) + str(key)
            answer = completion(key, rng)  # type: ignore[operator]
            f.write(json.dumps({"prompt": prompt, "completion": answer, "text": prompt + answer}) + "\n")
    return path


@pytest.mark.timeout(240)
def test_answers_learnable_from_a_key_behind_noise_are_learned_only_with_masks(tmp_path: Path) -> None:
    """The answer is a fixed function of the prompt's last character; the rest of the prompt is noise. Trained on
    the answers only, the loss falls near zero (and so does val_loss, on records never trained on); the same
    records trained as plain text (every token a target) cannot get there: the noise is unpredictable."""
    source = _records(tmp_path / "keys.jsonl", lambda key, rng: "ABCDEFGHIJ"[key] * 4)
    prepare_corpus([source], tmp_path / "masked", 0.05, SFT)
    prepare_corpus([source], tmp_path / "plain", 0.05, PrepareOptions(text_field="text"))
    common = [*TINY, "train.max_steps=120", "train.lr=1e-2", "train.warmup_steps=10", "ckpt.every_steps=0"]
    common += ["data.micro_batch_size=8", "train.global_batch_size=16", "log.every_steps=20", "train.eval_every=120"]
    finals = {}
    for name in ("masked", "plain"):
        run = tmp_path / f"run-{name}"
        done = run_ddptrain(["train", *common, f"data.dir={tmp_path / name}", f"run.dir={run}"], nproc=2, timeout=200)
        assert done.returncode == 0, done.stderr[-3000:]
        finals[name] = (read_metrics(run)[-1]["loss"], read_metrics(run, "eval")[-1]["val_loss"])
    (masked, masked_val), (plain, _) = finals["masked"], finals["plain"]
    assert masked < 0.02 and masked_val < 0.05, finals
    assert plain > 50 * masked and plain > 1.0, finals


@pytest.mark.timeout(240)
def test_a_step_over_ranks_with_unequal_answer_counts_is_the_global_token_mean(tmp_path: Path) -> None:
    """2 ranks with micro-batches of 4 records == 1 process reading the same 8 records as one batch (whose loss is
    by definition the mean over its answer tokens): the logged loss and the weights after the steps agree, though
    the ranks' batches hold different numbers of answer tokens (a mean of per-rank means would differ)."""
    source = _records(tmp_path / "varied.jsonl", lambda key, rng: "ABCDEFGHIJ"[key] * rng.choice([1, 2, 12, 24]))
    corpus = prepare_corpus([source], tmp_path / "corpus", 0.05, SFT).out_dir
    common = [*TINY, f"data.dir={corpus}", "train.max_steps=3", "ckpt.every_steps=3", "train.lr=1e-2"]
    two, one = tmp_path / "two", tmp_path / "one"
    done = run_ddptrain(["train", *common, "data.micro_batch_size=4", f"run.dir={two}"], nproc=2, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_ddptrain(["train", *common, "data.micro_batch_size=8", f"run.dir={one}"], timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]

    # The ranks' answer-token counts in each of the three steps differ.
    cfg = load_config(None, [*TINY, f"data.dir={corpus}"])
    train, _ = load_token_datasets(corpus, cfg.model.block_size)
    samplers = [ResumableDistributedSampler(len(train), 8, rank, 2, cfg.run.seed) for rank in (0, 1)]
    orders = [list(s) for s in samplers]
    for step in range(3):
        counts = []
        for order in orders:
            batch = torch.utils.data.default_collate([train[i] for i in order[4 * step : 4 * step + 4]])
            counts.append(int(target_tokens(batch)))  # type: ignore[arg-type]
        assert counts[0] != counts[1], counts

    m2, m1 = read_metrics(two), read_metrics(one)
    assert [m["grad_accum"] for m in m2] == [1] * 3 and [m["grad_accum"] for m in m1] == [1] * 3
    assert [m["loss"] for m in m2] == pytest.approx([m["loss"] for m in m1], rel=1e-5)
    p2, p1 = final_model_state(two), final_model_state(one)
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], rtol=1e-5, atol=1e-6, msg=name)
