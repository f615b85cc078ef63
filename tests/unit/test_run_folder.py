"""The run folder's layout (run_folder.py), checked against the names spelled out here, and reading a run's config back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddptrain import run_folder
from ddptrain.config import Config
from ddptrain.errors import ConfigError


def test_every_entry_has_the_name_users_and_docs_know(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert run_folder.config_file(run) == run / "config.yaml"
    assert run_folder.metrics_file(run) == run / "metrics.jsonl"
    assert run_folder.certificate_file(run) == run / "certificate.jsonl"
    assert run_folder.trackers_file(run) == run / "trackers.json"
    assert run / run_folder.LEASE == run / ".lease"
    assert run_folder.checkpoints_dir(run) == run / "checkpoints"
    assert run_folder.rank_log(run, 3) == run / "logs" / "rank-3.log"
    assert run_folder.stacks_dir(run) == run / "stacks"
    assert run_folder.report_dir(run) == run / "report"
    assert run_folder.export_dir(run) == run / "export"
    assert run_folder.tensorboard_dir(run) == run / "tensorboard"
    assert run_folder.replay_dir(run, 20) == run / "verify-resume" / "from-20"
    assert run_folder.slurm_dir(run) == run / "slurm"


def test_a_run_config_reads_back_as_written_with_overrides(tmp_path: Path) -> None:
    cfg = Config.model_validate({"train": {"max_steps": 7}, "run": {"dir": str(tmp_path)}})
    run_folder.config_file(tmp_path).write_text(cfg.to_yaml())
    again = run_folder.read_config(tmp_path, ["train.max_steps=9"])
    assert again.train.max_steps == 9 and again.run_dir == cfg.run_dir
    assert run_folder.read_config_sections(tmp_path)["train"]["max_steps"] == 7


def test_an_older_run_config_reads_back_as_sections_but_not_as_a_config(tmp_path: Path) -> None:
    run_folder.config_file(tmp_path).write_text("run:\n  name: old\ntrain:\n  max_steps: 5\n  retired_key: 1\n")
    assert run_folder.read_config_sections(tmp_path)["run"]["name"] == "old"
    with pytest.raises(ConfigError) as e:
        run_folder.read_config(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.yaml'}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "config file not found"),
        ("fifo", "is not a file"),
        ("train: {max_steps: 3\n", "is not valid YAML"),
        ("- a\n- list\n", "must hold a mapping of sections"),
        ("a: &x [1]\na: *x\n", "duplicate key"),
    ],
)
def test_an_unreadable_run_config_is_one_line_naming_the_file(tmp_path: Path, content: str | None, says: str) -> None:
    path = run_folder.config_file(tmp_path)
    if content == "fifo":
        os.mkfifo(path)  # refused, never waited on
    elif content is not None:
        path.write_text(content)
    for read in (run_folder.read_config_sections, run_folder.read_config):
        with pytest.raises(ConfigError) as e:
            read(tmp_path)
        assert says in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
