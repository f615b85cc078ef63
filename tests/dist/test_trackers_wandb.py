"""Weights & Biases in offline mode: the run folder holds the config and the metric history, and a
resumed run continues the same W&B run id, each step once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TINY, run_ddptrain
from tracking_harness import wandb_records

pytestmark = pytest.mark.dist
pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'ddptrain[wandb]')")


def history_and_config(run_file: Path) -> tuple[list[int], dict[str, str], str]:
    """(the steps of train/loss, the config, the run id) in one offline run file."""
    steps, config, run_id = [], {}, ""
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            if "train/loss" in items:
                steps.append(record.history.step.num)
    return steps, config, run_id


@pytest.mark.timeout(300)
def test_offline_run_resumed_continues_the_same_run(corpus_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "train",
        *TINY,
        f"data.dir={corpus_dir}",
        f"run.dir={run_dir}",
        "ckpt.every_steps=2",
        "log.trackers=[wandb]",
        "log.wandb.mode=offline",
        "log.wandb.project=ddptrain-test",
    ]
    env = {"WANDB_SILENT": "true"}
    first = run_ddptrain([*args, "train.max_steps=4"], timeout=150, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    second = run_ddptrain([*args, "train.max_steps=8"], timeout=150, env=env)  # resumes at step 4
    assert second.returncode == 0, second.stdout + second.stderr
    assert "step-00000004" in second.stdout

    stored = json.loads((run_dir / "trackers.json").read_text())["wandb"]["run_id"]
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [f.name.rsplit("-", 1)[1] for f in folders] == [stored, stored]  # one run id, two attempts
    seen = [history_and_config(folder / f"run-{stored}.wandb") for folder in folders]
    assert [run_id for _, _, run_id in seen] == [stored, stored]
    assert [steps for steps, _, _ in seen] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # each step once, in order
    assert [config["train.max_steps"] for _, config, _ in seen] == [4, 8]
    assert all(config["log.wandb.mode"] == "offline" and config["model.n_embd"] == 32 for _, config, _ in seen)
