"""The in-place mode's recipe check (train/agreement.py, train/in_place_transport.py) and its refusals before the
run folder is written. The groups themselves are in tests/dist/test_in_place.py."""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from helpers import folder_bytes

from ddptrain.cli import main
from ddptrain.errors import ConfigError
from ddptrain.train.agreement import FROM_FOLDER, IN_JOB, NEW, job_outsiders, recipe_of, recipe_slot

A, B = recipe_slot(recipe_of({"train": {"lr": 1e-3}}, {})), recipe_slot(recipe_of({"train": {"lr": 1e-2}}, {}))


def test_the_jobs_recipe_is_the_highest_standing_groups_then_the_most_common_then_the_lowest_ranked() -> None:
    # A group that trained in the job outweighs any number of newcomers of another recipe.
    assert job_outsiders([A, B, B], [IN_JOB, NEW, NEW], [0, 1, 2], 0, A) == [1, 2]
    with pytest.raises(ConfigError, match=r"^replica group 2 trains another recipe than groups \[0\], the job's "):
        job_outsiders([A, B, B], [IN_JOB, NEW, NEW], [0, 1, 2], 2, B)
    # Newcomers resuming from a checkpoint of their own recipe outweigh those that changed it.
    assert job_outsiders([B, A], [NEW, FROM_FOLDER], [0, 1], 1, A) == [0]
    # The first quorum on a fresh folder: the most common recipe, a tie going to the lowest-ranked group's.
    assert job_outsiders([B, A, A], [NEW, NEW, NEW], [5, 3, 4], 3, A) == [5]
    assert job_outsiders([B, A], [NEW, NEW], [2, 1], 2, B) == [1]
    assert job_outsiders([A, A], [NEW, IN_JOB], [0, 1], 0, A) == []


def test_a_recipe_reads_the_same_from_a_checkpoints_manifest() -> None:
    config = {"model": {"n_layer": 2}, "train": {"lr": 0.001}, "data": {"micro_batch_size": 4}, "run": {"seed": 1}}
    identity = {"data": {"sha256": "ab"}, "model": {"w": (4, 4)}}
    stored = json.loads(json.dumps({"config": config, "identity": identity}))  # as manifest.json holds them
    assert recipe_of(stored["config"], stored["identity"]) == recipe_of(config, identity)
    assert recipe_of({**config, "log": {"every_steps": 5}}, identity) == recipe_of(config, identity)
    assert recipe_of({**config, "run": {"seed": 2}}, identity) != recipe_of(config, identity)


class Recorded:
    """An inner transport that records what it is asked (the heal's bytes are torchft's PGTransport's)."""

    def __init__(self) -> None:
        self.received: list[str] = []

    def metadata(self) -> str:
        return "inner"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        self.received.append(metadata)
        return {"state": "from the donor"}


def test_a_joiner_refuses_a_donor_of_another_recipe_before_receiving_anything() -> None:
    pytest.importorskip("torchft")
    from ddptrain.train.in_place_transport import RecipeRefused, RecipeTransport

    inner = Recorded()
    donor, joiner = RecipeTransport(inner, 0, "aa" * 32), RecipeTransport(inner, 1, "aa" * 32)
    assert joiner.recv_checkpoint(0, donor.metadata(), 7, timedelta(seconds=1)) == {"state": "from the donor"}
    assert inner.received == ["inner"] and joiner.refused_by is None
    other = RecipeTransport(inner, 2, "bb" * 32)
    with pytest.raises(RecipeRefused):
        other.recv_checkpoint(0, donor.metadata(), 7, timedelta(seconds=1))
    assert other.refused_by == 0 and inner.received == ["inner"]  # nothing more was received
    with pytest.raises(RecipeRefused):  # a donor that names no recipe (torchft's own metadata)
        other.recv_checkpoint(0, "<n/a>", 7, timedelta(seconds=1))
    assert other.refused_by == -1


def test_in_place_data_weighted_by_answer_tokens_is_refused_before_the_run_folder_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Samples batched with labels (SFT data, or data.collate=pad's) are refused in one line, exit 2, before
    config.yaml, metrics.jsonl or a log line is written (a listening socket stands for the Lighthouse)."""
    pytest.importorskip("torchft")
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank-0.log").write_text("an earlier run's lines\n")
    before = folder_bytes(run_dir)
    with socket.socket() as lighthouse:
        lighthouse.bind(("127.0.0.1", 0))
        lighthouse.listen()
        monkeypatch.setenv("RUST_LOG", "warn")
        monkeypatch.setenv("DDPTRAIN_REPLICA_GROUP", "0")
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{lighthouse.getsockname()[1]}")
        rc = main(
            [
                "train",
                "model.target=toy:build_model",
                "data.target=varlen_toy:varlen_datasets",
                "data.collate=pad",
                "data.micro_batch_size=4",
                "train.global_batch_size=8",
                f"run.dir={run_dir}",
            ]
        )
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, (rc, out, err)
    assert "does not weight a loss by answer tokens (SFT data)" in lines[0]
    assert folder_bytes(run_dir) == before
