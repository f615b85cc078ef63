"""The training step reads nothing from the device on steps that are not logged.

Every host read (item, float, bool, int, tolist, numpy) and copy to the host is recorded by a
TorchFunctionMode (tests/host_syncs.py) during `fit()`, tagged with the step it belongs to. On a
CPU these calls cost nothing, which is why they are counted instead of timed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_trainer, read_metrics
from host_syncs import HostSyncRecorder, describe

from ddptrain.errors import NonFiniteError
from ddptrain.train.preemption import StopRequest

LOG_EVERY, STEPS = 4, 9
QUIET = [f"log.every_steps={LOG_EVERY}", f"train.max_steps={STEPS}", "ckpt.every_steps=0", "log.straggler_every=0"]
# accumulation 1, so that the faulty model's forward count is the step number
FAULTY = [
    "model.target=faulty:build_model",
    "data.target=toy:build_datasets",
    "data.micro_batch_size=8",
    "train.global_batch_size=8",
]


def fit_recorded(trainer: Any) -> HostSyncRecorder:
    """trainer.fit() with a (not installed) stop request, every call tagged with its step."""
    recorder = HostSyncRecorder()
    step = trainer.train_step

    def tagged() -> Any:
        recorder.tag = trainer.step + 1
        return step()

    trainer.train_step = tagged
    with recorder:
        trainer.fit(stop_request=StopRequest())
    return recorder


def syncs_on_unlogged_steps(recorder: HostSyncRecorder) -> list[Any]:
    logged = {s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s == STEPS}
    return [c for c in recorder.device_syncs() if c.tag not in logged]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_unlogged_steps_make_no_host_sync(corpus_dir: Path, tmp_path: Path, precision: str) -> None:
    # A small regression model: every op is intercepted, so the GPT runs in tests/dist/test_step_syncs.py.
    trainer = make_trainer(corpus_dir, tmp_path, [*QUIET, *FAULTY, f"train.precision={precision}"])
    recorder = fit_recorded(trainer)
    assert trainer.step == STEPS
    unlogged = syncs_on_unlogged_steps(recorder)
    assert not unlogged, describe(unlogged)
    # The recorder does see reads: the logged steps read the loss, the norm and the skipped count.
    assert {c.tag for c in recorder.device_syncs()} == {4, 8, 9}, describe(recorder.device_syncs())


def test_nonfinite_step_is_skipped_on_the_device_and_counted_at_the_next_log(corpus_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(corpus_dir, tmp_path, [*QUIET, *FAULTY, "model.kwargs.nan_at=2"])
    recorder = fit_recorded(trainer)
    unlogged = syncs_on_unlogged_steps(recorder)
    assert not unlogged, describe(unlogged)
    skipped = {r["step"]: r.get("skipped_steps", 0) for r in read_metrics(tmp_path)}
    assert skipped == {4: 1, 8: 0, 9: 0}
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_stop_on_nonfinite_is_read_at_the_next_logged_step(corpus_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(corpus_dir, tmp_path, [*QUIET, *FAULTY, "model.kwargs.nan_at=2", "train.on_nonfinite=stop"])
    with pytest.raises(NonFiniteError, match=r"non-finite gradient norm \(nan\) at step 2 \(checked at step 4\)"):
        fit_recorded(trainer)
    assert trainer.step == 3  # steps 1 and 3 trained, step 2 was skipped, step 4 raised before its update
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_an_optimizer_without_found_inf_still_skips(corpus_dir: Path, tmp_path: Path) -> None:
    """A factory's optimizer that cannot take found_inf (plain SGD) skips the step by reading the flag."""
    sgd = ["optim.target=custom_optim:build_sgd", "model.kwargs.nan_at=2"]
    trainer = make_trainer(corpus_dir, tmp_path, [*FAULTY, *sgd])
    trainer.train_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train_step()
    assert result.skipped.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert not trainer.train_step().skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
