"""`ddptrain train` end to end, single-process and under torchrun: metrics, config and checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import read_metrics, run_ddptrain

pytestmark = pytest.mark.dist


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", [0, 2])
def test_train_writes_metrics_config_and_checkpoints(tiny_args: list[str], tmp_path: Path, nproc: int) -> None:
    run_dir = tmp_path / "run"
    result = run_ddptrain(["train", *tiny_args, "train.eval_every=3"], nproc=nproc)
    assert result.returncode == 0, result.stderr
    assert "training default: world size" in result.stdout
    assert result.stdout.count("training default") == 1  # only rank 0 prints

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 6 and saved["ckpt"]["async"] is False

    train = read_metrics(run_dir)
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    world = max(nproc, 1)
    for m in train:
        assert m["world_size"] == world and m["global_batch_size"] == 8
        assert m["samples_per_s"] > 0 and m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 32)
        assert m["lr"] > 0
    evals = read_metrics(run_dir, "eval")
    assert [e["step"] for e in evals] == [3, 6] and all(e["val_loss"] > 0 for e in evals)

    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-00000003", "step-00000006"]
    manifest = json.loads((run_dir / "checkpoints" / "step-00000006" / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["world_size"] == world
    assert {f"rng-rank{r}.pt" for r in range(world)} <= set(manifest["files"])


@pytest.mark.timeout(240)
def test_default_model_learns(corpus_dir: Path, tmp_path: Path) -> None:
    """The built-in defaults (on the small corpus): the loss falls well below uniform within 40 steps."""
    run_dir = tmp_path / "run"
    result = run_ddptrain(
        [
            "train",
            f"data.dir={corpus_dir}",
            f"run.dir={run_dir}",
            "train.max_steps=40",
            "train.eval_every=0",
            "ckpt.every_steps=0",
            "log.every_steps=1",
        ],
        timeout=220,
    )
    assert result.returncode == 0, result.stderr
    losses = [m["loss"] for m in read_metrics(run_dir)]
    assert losses[0] > 4.5 and losses[-1] < 3.4, losses


@pytest.mark.timeout(180)
def test_user_model_and_data_through_targets(tmp_path: Path) -> None:
    """A model and dataset the package does not define, named by import path."""
    run_dir = tmp_path / "run"
    result = run_ddptrain(
        [
            "train",
            "model.target=toy:build_model",
            "data.target=toy:build_datasets",
            "model.kwargs={dim: 8}",
            "data.kwargs={n: 128, dim: 8}",
            f"run.dir={run_dir}",
            "train.max_steps=20",
            "train.global_batch_size=16",
            "data.micro_batch_size=8",
            "train.eval_every=10",
            "log.every_steps=5",
            "train.lr=0.01",
        ],
        nproc=2,
    )
    assert result.returncode == 0, result.stderr
    train = read_metrics(run_dir)
    assert train[-1]["loss"] < train[0]["loss"]
    assert "tokens_per_s" not in train[0]  # no tokens in this task
    assert len(read_metrics(run_dir, "eval")) == 2


@pytest.mark.timeout(180)
def test_shipped_example_trains_under_torchrun(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "regression"
    run_dir = tmp_path / "run"
    result = run_ddptrain(
        [
            "train",
            "-c",
            str(example / "config.yaml"),
            f"run.dir={run_dir}",
            "train.max_steps=60",
            "log.every_steps=1",
            "train.eval_every=60",
        ],
        nproc=2,
        env={"PYTHONPATH": str(example)},
    )
    assert result.returncode == 0, result.stderr
    losses = [m["loss"] for m in read_metrics(run_dir)]
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5]), losses
