"""The log window travels with the training state: a group that joins mid-window (the in-place mode's heal, which
loads a peer's live state) or a run resumed mid-window logs the same window, samples and loss, as a run that was
never interrupted; and the certificate's records are checked to hold every committed step's samples once."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_trainer
from hypothesis import given
from hypothesis import strategies as st

from ddptrain.observe.certificate import coverage_gap, read_certificate
from ddptrain.run_folder import certificate_file
from ddptrain.train.log_window import LogWindow

RUN = ["log.every_steps=5", "train.max_steps=10", "train.eval_every=0", "ckpt.every_steps=0"]


def records(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    return read_certificate(certificate_file(run_dir))


class StateAt:
    """An observer that keeps a copy of the trainer's whole state after step `step` (a donor's live state)."""

    def __init__(self, trainer: Any, step: int) -> None:
        self.trainer, self.step = trainer, step
        self.state: dict[str, Any] | None = None

    def step_ended(self, step: int) -> None:
        if step == self.step:
            self.state = copy.deepcopy(self.trainer.state_dict())


def test_a_group_that_loads_a_peers_state_mid_window_logs_the_whole_window(corpus_dir: Path, tmp_path: Path) -> None:
    reference = make_trainer(corpus_dir, tmp_path / "reference", RUN)  # also the donor: its state after step 7
    kept = StateAt(reference, 7)
    reference.observers.attach(kept)
    reference.fit()
    joiner = make_trainer(corpus_dir, tmp_path / "joiner", RUN)
    assert kept.state is not None and kept.state["trainer"]["log_window"]["steps"] == 2  # steps 6 and 7
    joiner.load_state_dict(kept.state)  # what the in-place sync's load_live_state does in a heal
    joiner.fit()
    want, got = records(tmp_path / "reference")[10][0], records(tmp_path / "joiner")[10][0]
    assert got["samples"] == want["samples"] == [[0, 5 * 8, 10 * 8]]  # steps 6..10, not only 8..10
    assert got == want  # sample ids, every digest and the window's mean loss: bit-identical


def test_a_run_resumed_mid_window_logs_the_window_it_was_in(corpus_dir: Path, tmp_path: Path) -> None:
    first = make_trainer(corpus_dir, tmp_path, [*RUN, "ckpt.every_steps=7"])
    first.fit()  # checkpoints at 7 (inside the window 6..10) and 10
    (tmp_path / "checkpoints" / "step-00000010").rename(tmp_path / "dropped")  # as if it crashed after step 7
    resumed = make_trainer(corpus_dir, tmp_path, [*RUN, "ckpt.every_steps=7"])
    assert resumed.step == 7 and resumed.window.steps == 2
    resumed.fit()
    logged = records(tmp_path)
    assert [len(logged[s]) for s in (5, 10)] == [1, 2] and logged[10][1] == logged[10][0]
    assert coverage_gap(logged, 8, 10_000) is None


def test_an_empty_window_reads_nothing_and_an_old_checkpoint_starts_one() -> None:
    window = LogWindow(torch.device("cpu"))

    def never(_: torch.Tensor) -> float:
        raise AssertionError("an empty window needs no collective")

    assert window.state_dict(never) == {"steps": 0, "seconds": 0.0, "loss": 0.0, "rank_losses": [0.0]}
    window.add(torch.tensor(1.5), 0.25)
    window.add(torch.tensor(2.5), 0.25)
    state = window.state_dict(lambda t: [float(t), 2.0])  # as two ranks would: this one's sum, then the other's
    assert state == {"steps": 2, "seconds": 0.5, "loss": 3.0, "rank_losses": [4.0, 2.0]} and window.trained == 2
    other = LogWindow(torch.device("cpu"))
    for rank, world_size, loss in ((0, 2, 4.0), (1, 2, 2.0), (0, 1, 3.0), (2, 4, 3.0)):  # own sum, else the mean
        other.load_state_dict(state, rank, world_size)
        assert (float(other.loss), other.steps, other.trained, other.seconds) == (loss, 2, 0, 0.5)
    other.load_state_dict(None, 0, 1)  # a checkpoint from before the window was saved
    assert (float(other.loss), other.steps, other.seconds) == (0.0, 0, 0.0)


def certificate_of(logged_steps: list[int], batch: int, per_epoch: int) -> dict[int, list[dict[str, Any]]]:
    """Records as the certificate writes them: logged step s after p holds positions [p x batch, s x batch)."""
    out, previous = {}, 0
    for step in logged_steps:
        spans, start, end = [], previous * batch, step * batch
        while start < end:
            epoch, pos = divmod(start, per_epoch)
            stop = min(end - epoch * per_epoch, per_epoch)
            spans.append([epoch, pos, stop])
            start = epoch * per_epoch + stop
        out[step] = [{"step": step, "samples": spans}]
        previous = step
    return out


@given(
    steps=st.lists(st.integers(1, 200), min_size=1, max_size=30, unique=True).map(sorted),
    batch=st.integers(1, 16),
    steps_per_epoch=st.integers(1, 40),
    data=st.data(),
)
def test_coverage_finds_every_lost_or_repeated_step(
    steps: list[int], batch: int, steps_per_epoch: int, data: st.DataObject
) -> None:
    per_epoch = steps_per_epoch * batch
    assert coverage_gap(certificate_of(steps, batch, per_epoch), batch, per_epoch) is None
    # A record whose window starts late (the writer's window began after a heal) loses the steps before it.
    i = data.draw(st.integers(0, len(steps) - 1), label="record")
    previous = steps[i - 1] if i else 0
    if steps[i] - previous > 1:
        late = data.draw(st.integers(previous + 1, steps[i] - 1), label="window starts after step")
        holed = certificate_of(steps, batch, per_epoch)
        holed[steps[i]] = certificate_of([late, steps[i]], batch, per_epoch)[steps[i]]
        assert f"step(s) {previous + 1}..{late} are in no record" in str(coverage_gap(holed, batch, per_epoch))
    # A record that also holds the steps of the record before it repeats them.
    if i:
        repeated = certificate_of(steps, batch, per_epoch)
        repeated[steps[i]] = certificate_of([steps[i]], batch, per_epoch)[steps[i]]
        assert "also in the record of an earlier step" in str(coverage_gap(repeated, batch, per_epoch))


def test_the_records_a_late_window_leaves_behind_fail_the_check() -> None:
    # The run: a fault-free run logs [0, 1200, 1320) at step 55 (global batch 24, logged every 5 steps);
    # the new writer's first window began at 1248: steps 51 and 52 were in no record.
    logged = certificate_of([50, 55], 24, 10_000)
    logged[55] = [{"step": 55, "samples": [[0, 1248, 1320]]}]
    assert coverage_gap(logged, 24, 10_000) == (
        "the samples of step(s) 51..52 are in no record (the record of step 55 holds [(1248, 1320)])"
    )


@pytest.mark.parametrize("bad", [[[0, 0, 24]], [[0, 8, 16]]])
def test_a_record_ending_elsewhere_than_its_step_fails(bad: list[list[int]]) -> None:
    assert coverage_gap({2: [{"step": 2, "samples": bad}]}, 8, 1000) is not None
