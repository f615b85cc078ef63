"""The checkpoint policy (when to save, on_error) and the config checks at resume."""

from __future__ import annotations

import pytest
import torch.nn as nn

from ddptrain.checkpoint.compat import check_resume, run_identity
from ddptrain.checkpoint.policy import SavePolicy, SaveResult
from ddptrain.config import CkptConfig
from ddptrain.data.kinds import data_source
from ddptrain.errors import CheckpointError, CheckpointSaveError


def result(step: int, ok: bool) -> SaveResult:
    return SaveResult(step, ok, None if ok else "disk full", 0.0, 0.0, None)


def test_due_every_n_the_final_step_and_a_stop() -> None:
    policy = SavePolicy(CkptConfig(every_steps=3))
    assert [s for s in range(1, 10) if policy.due(s)] == [3, 6, 9]
    assert policy.due(4, final=True) and policy.due(5, stop=True)
    assert not SavePolicy(CkptConfig(every_steps=0)).due(3)


def test_on_error_stop_raises_at_once() -> None:
    with pytest.raises(CheckpointSaveError, match="step 3 failed: disk full"):
        SavePolicy(CkptConfig(on_error="stop")).judge(result(3, False))


def test_on_error_continue_retries_the_final_state_and_names_the_newest_safe_step() -> None:
    policy = SavePolicy(CkptConfig(on_error="continue"))
    policy.judge(result(3, True))
    policy.judge(result(6, False))
    assert policy.final_retry_needed(6)
    policy.judge(result(6, False))  # the retry fails too
    with pytest.raises(
        CheckpointSaveError,
        match="final state at step 6 could not be committed: disk full; the newest safe checkpoint is step 3",
    ):
        policy.require_final(6)
    policy.judge(result(6, True))
    policy.require_final(6)


def cfg(*overrides: str) -> dict:
    from ddptrain.config import config_from_mapping

    return config_from_mapping({}, list(overrides)).model_dump(mode="json", by_alias=True)


def identity(config: dict, width: int = 8) -> dict:
    from ddptrain.config import config_from_mapping

    data = data_source(config_from_mapping(config).data).resume_identity()
    return run_identity(data, nn.Linear(width, 2))


def test_identity_changes_are_refused_naming_each_key() -> None:
    saved = cfg()
    now = cfg("model.n_embd=64", "train.global_batch_size=16", "run.seed=1")
    with pytest.raises(CheckpointError) as e:
        check_resume("step-00000006", saved, identity(saved), now, identity(now))
    text = str(e.value)
    for part in (
        "model.n_embd (128 -> 64)",
        "train.global_batch_size (32 -> 16)",
        "run.seed (1337 -> 1)",
        "run.name=NEW_NAME",
        "ckpt.existing=archive",
    ):
        assert part in text, text
    assert "\n" not in text


def test_parameter_shapes_and_data_identity_are_checked() -> None:
    saved, now = cfg("model.target=m:f"), cfg("model.target=m:f", "model.kwargs={w: 9}")
    with pytest.raises(CheckpointError, match=r"model.kwargs \(parameter weight: \[2, 8\] -> \[2, 9\]\)"):
        check_resume("s", saved, identity(saved), now, identity(now, 9))
    a, b = cfg("data.target=d:f", "data.kwargs={n: 1}"), cfg("data.target=d:f", "data.kwargs={n: 2}")
    with pytest.raises(CheckpointError, match=r"data.kwargs \(\{\"n\": 1\} -> \{\"n\": 2\}\)"):
        check_resume("s", a, identity(a), b, identity(b))
    ia, ib = identity(cfg()), identity(cfg())
    ia["data"], ib["data"] = {"source": "corpus", "sha256": "a" * 64}, {"source": "corpus", "sha256": "b" * 64}
    with pytest.raises(CheckpointError, match=r"data.dir \(corpus SHA-256 aaaaaaaaaaaa -> bbbbbbbbbbbb\)"):
        check_resume("s", cfg(), ia, cfg(), ib)


def test_hyper_parameter_changes_are_applied_and_listed() -> None:
    saved = cfg()
    now = cfg("train.max_steps=900", "train.lr=0.001", "ckpt.keep=5", "log.every_steps=3", "dist.timeout_s=30")
    changes = check_resume("s", saved, identity(saved), now, identity(now))
    assert {c.key: (c.old, c.new) for c in changes} == {
        "train.max_steps": (300, 900),
        "train.lr": (0.003, 0.001),
        "ckpt.keep": (3, 5),
        "log.every_steps": (10, 3),
        "dist.timeout_s": (600.0, 30.0),
    }
