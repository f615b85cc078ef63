"""Metrics of your own (names, what a forward's output gives) and early stopping's decision and patience."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import one_line_exit_2
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.config.train import EarlyStopConfig
from ddptrain.dist import DistContext
from ddptrain.errors import ConfigError
from ddptrain.train.custom_metrics import CustomMetrics, check_metric_name, merge_metrics
from ddptrain.train.early_stop import EarlyStop

# ---- metric names ------------------------------------------------------------------------------


@settings(deadline=None)  # the first example imports mlflow
@given(st.text(max_size=80))
def test_every_accepted_metric_name_is_one_mlflow_takes_and_a_python_identifier(name: str) -> None:
    validation = pytest.importorskip("mlflow.utils.validation")
    try:
        check_metric_name(name, "model m")
    except ConfigError as e:
        assert "\n" not in str(e) and "model m" in str(e)
        return
    assert name.isidentifier() and not name.startswith("val_") and len(name) <= 64
    validation._validate_metric_name(f"train/{name}")  # raises for a name MLflow refuses
    validation._validate_metric_name(f"eval/val_{name}")


@pytest.mark.parametrize("name", ["", "5x", "acc-1", "a b", "val_acc", "x" * 65, "ümlaut", 3])
def test_bad_metric_names_are_named(name: object) -> None:
    with pytest.raises(ConfigError, match="returned the metric name"):
        check_metric_name(name, "model m")


def test_what_a_forward_gives_and_what_it_may_not() -> None:
    metrics = CustomMetrics(None, "m")
    out = {"loss": torch.tensor(1.0), "acc": torch.tensor(0.5), "logits": torch.zeros(2, 3), "past": None}
    assert metrics.measure(out, None) == {"acc": torch.tensor(0.5)}  # logits and others are outputs, not metrics
    with pytest.raises(ConfigError, match="'acc' as a Python float; return a 0-dim tensor"):
        metrics.measure({"loss": torch.tensor(1.0), "acc": 0.5}, None)
    with pytest.raises(ConfigError, match="'top-1'"):
        metrics.measure({"loss": torch.tensor(1.0), "top-1": torch.tensor(0.5)}, None)
    per_sample = CustomMetrics("metrics_toy:per_sample", "m")
    with pytest.raises(ConfigError, match=r"returned 'targets' as a tensor of shape \(3,\); a metric is a 0-dim"):
        per_sample.measure(torch.tensor(1.0), torch.zeros(3, 2))
    record = {"step": 1, "loss": 2.0}
    with pytest.raises(ConfigError, match=r"\['loss'\] clash with ddptrain's own keys"):
        merge_metrics(record, {"loss": 1.0, "acc": 0.5}, "train.metrics='x:y'")


def test_a_window_is_the_mean_of_its_micro_batches_and_steps() -> None:
    metrics = CustomMetrics("metrics_toy:target_mean", "m")
    for step_rows in ([1.0, 3.0], [5.0, 7.0]):  # two steps of two micro-batches (accumulation 2)
        for target in step_rows:
            metrics.add(
                {"loss": torch.tensor(0.0), "acc": torch.tensor(target / 10)}, torch.tensor([[0.0, target]]), 0.5
            )
    assert metrics.take(DistContext(), 2) == pytest.approx({"acc": 0.4, "target_mean": 4.0})
    assert metrics.take(DistContext(), 1) == {}  # the window starts again


# ---- early stopping ----------------------------------------------------------------------------

values = st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=30)


def stop_index(stopper: EarlyStop, sequence: list[float], first: int = 0) -> int | None:
    for i, v in enumerate(sequence[first:], first):
        if stopper.observe({"val_loss": v}, step=i).stop:
            return i
    return None


@settings(max_examples=200)
@given(values, st.integers(1, 5))
def test_the_stop_comes_after_patience_evaluations_that_beat_nothing_before_them(
    seq: list[float], patience: int
) -> None:
    stopped = stop_index(EarlyStop(EarlyStopConfig(patience=patience)), seq)
    for i in range(patience, len(seq)):
        # No value of the last `patience` evaluations is below everything before them: the run stops there.
        stalled = min(seq[i - patience + 1 : i + 1]) >= min(seq[: i - patience + 1])
        if stalled:
            assert stopped == i
            return
    assert stopped is None


@settings(max_examples=200)
@given(values, st.integers(1, 5), st.floats(0, 5), st.sampled_from(["min", "max"]), st.data())
def test_a_resume_anywhere_continues_the_count(
    seq: list[float], patience: int, delta: float, mode: str, data: st.DataObject
) -> None:
    cfg = EarlyStopConfig(patience=patience, min_delta=delta, mode=mode)
    whole = stop_index(EarlyStop(cfg), seq)
    cut = data.draw(st.integers(0, len(seq) if whole is None else whole))
    first = EarlyStop(cfg)
    assert stop_index(first, seq[:cut]) is None
    resumed = EarlyStop(cfg)
    resumed.load_state_dict(first.state_dict())  # what the checkpoint carries
    assert stop_index(resumed, seq, first=cut) == whole
    mirrored = EarlyStop(EarlyStopConfig(patience=patience, min_delta=delta, mode="max" if mode == "min" else "min"))
    assert stop_index(mirrored, [-v for v in seq]) == whole  # max is min of the negated values


def test_a_nan_never_improves_and_another_metric_starts_afresh() -> None:
    stopper = EarlyStop(EarlyStopConfig(patience=2))
    assert [stopper.observe({"val_loss": v}, i).stop for i, v in enumerate([1.0, math.nan, math.nan])] == [
        False,
        False,
        True,
    ]
    other = EarlyStop(EarlyStopConfig(metric="val_acc", patience=2))
    other.load_state_dict(stopper.state_dict())
    assert not other.stopped
    with pytest.raises(ConfigError, match=r"'val_acc' is not recorded at evaluations \(they record \['val_loss'\]\)"):
        other.observe({"step": 3, "val_loss": 1.0}, 3)


def test_early_stop_on_a_metric_nan_at_every_evaluation_stops_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN never improves: patience evaluations of NaN end the run as any early stop does (exit 0), the reason
    saying no evaluation gave a number (it once raised TypeError formatting the best value, None)."""
    from ddptrain.cli import main

    run = tmp_path / "run"
    argv = ["train", "model.target=metrics_toy:plateau_model", "data.target=varlen_toy:bare_datasets"]
    argv += ["train.metrics=metrics_toy:always_nan", "data.micro_batch_size=2", "train.global_batch_size=2"]
    argv += ["train.max_steps=20", "train.warmup_steps=0", "train.eval_every=2", "train.eval_batches=1"]
    argv += ["train.early_stop={metric: val_nothing, patience: 2}", f"run.dir={run}"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    reason = (
        "early stop: val_nothing did not improve by more than 0 (min) in 2 evaluations; no evaluation gave a number"
    )
    assert f"finished early at step 4: {reason}" in out + err
    end = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert end["event"] == "finished_early" and end["exit_code"] == 0 and reason in end["reason"]
    # eval of a model.target: its loss, no perplexity (exp of an MSE means nothing)
    assert main(["eval", str(run)]) == 0
    printed = capsys.readouterr().out
    assert ", loss " in printed and "perplexity" not in printed, printed


def test_a_metric_no_evaluation_records_exits_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_line_exit_2(["train", f"run.dir={tmp_path / 'run'}", "train.early_stop={metric: accuracy}"], capsys)
    assert "train.early_stop.metric: 'accuracy' is never logged at an evaluation" in line
    assert not (tmp_path / "run").exists()
    line = one_line_exit_2(
        ["train", f"run.dir={tmp_path / 'run'}", "train.early_stop={}", "train.eval_every=0"], capsys
    )
    assert "set train.eval_every above 0" in line


def test_early_stop_without_a_validation_set_is_refused_before_training(tmp_path: Path) -> None:
    from metrics_toy import plateau_model
    from varlen_toy import bare_datasets

    import ddptrain

    config = {
        "run": {"dir": str(tmp_path / "run")},
        "data": {"micro_batch_size": 4},
        "train": {"early_stop": {}, "global_batch_size": 4},
    }
    with pytest.raises(ConfigError, match="^train.early_stop judges evaluations, and the data has no validation set$"):
        ddptrain.train(config, model=plateau_model(), datasets=(bare_datasets()[0], None))
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the run was accepted
