"""Hostile and careless use of a run folder, end to end: other runs' checkpoints, changed configs at resume,
planted links, two runs at once, a killed run's lease. Each checks the exit code, the one line, and that
no committed checkpoint was deleted or replaced."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import folder_bytes, one_error_line, read_metrics, run_ddptrain, start_ddptrain
from toys import TINY

from ddptrain.checkpoint.manifest import manifest_checksum
from ddptrain.data.corpus import prepare_corpus

pytestmark = pytest.mark.dist


def snapshot(run_dir: Path) -> dict[str, str]:
    """SHA-256 of every file of every committed checkpoint (to prove none was deleted or replaced)."""
    out = {}
    for f in sorted((run_dir / "checkpoints").glob("step-*/*")):
        out[f"{f.parent.name}/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


@pytest.fixture
def trained(tiny_args: list[str], tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    r = run_ddptrain(["train", *tiny_args])
    assert r.returncode == 0, r.stderr
    return run_dir


@pytest.mark.timeout(180)
def test_resume_never_over_an_older_run_is_refused_then_archived(tiny_args: list[str], trained: Path) -> None:
    before = snapshot(trained)
    refused = run_ddptrain(["train", *tiny_args, "ckpt.resume=never", "ckpt.keep=1"])
    assert refused.returncode == 2
    line = one_error_line(refused)
    assert "already holds 2 checkpoint(s)" in line and "run.name=NEW_NAME" in line and "ckpt.existing=archive" in line
    assert snapshot(trained) == before
    fresh = run_ddptrain(
        [
            "train",
            *tiny_args,
            "ckpt.resume=never",
            "ckpt.existing=archive",
            "ckpt.keep=1",
            "train.max_steps=2",
            "ckpt.every_steps=1",
        ]
    )
    assert fresh.returncode == 0, fresh.stderr
    assert sorted(p.name for p in (trained / "checkpoints").glob("step-*")) == ["step-00000002"]
    archived = {
        f"{f.parent.name}/{f.name}": hashlib.sha256(f.read_bytes()).hexdigest()
        for f in (trained / "checkpoints" / "archive").glob("*/step-*/*")
    }
    assert archived == before  # the older run's checkpoints, byte for byte
    again = run_ddptrain(["train", *tiny_args, "train.max_steps=3", "ckpt.keep=1"])
    assert again.returncode == 0 and "step-00000002 (step 2" in again.stdout  # never the old run's step 6


@pytest.fixture(scope="module")
def untouched_run(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """tiny_args of a trained run that the tests using it only read (their commands are refused)."""
    args = [*TINY, f"data.dir={corpus_dir}", f"run.dir={tmp_path_factory.mktemp('identity') / 'run'}"]
    r = run_ddptrain(["train", *args])
    assert r.returncode == 0, r.stderr
    return args


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (["model.n_embd=64"], "model.n_embd (32 -> 64)"),
        (["train.global_batch_size=16"], "train.global_batch_size (8 -> 16)"),
        (["train.global_batch_size=4"], "train.global_batch_size (8 -> 4)"),
        (
            ["model.n_layer=2", "train.global_batch_size=16"],
            "model.n_layer (1 -> 2), train.global_batch_size (8 -> 16)",
        ),
        (["DATA"], "data.dir (corpus SHA-256"),
    ],
)
@pytest.mark.timeout(180)
def test_resume_with_a_changed_identity_exits_2_naming_each_key(
    untouched_run: list[str], tmp_path: Path, change: list[str], named: str
) -> None:
    """Each refusal leaves the run folder as it was, so the cases share one trained run (per worker)."""
    tiny_args, trained = untouched_run, Path(untouched_run[-1].removeprefix("run.dir="))
    if change == ["DATA"]:
        other = tmp_path / "other-corpus"
        prepare_corpus([Path(json.__file__), Path(shutil.__file__)], other, 0.1)
        change = [f"data.dir={other}"]
    before = folder_bytes(trained)
    refused = run_ddptrain(["train", *tiny_args, *change, "train.max_steps=9"])
    assert refused.returncode == 2
    line = one_error_line(refused)
    assert named in line and "Ways forward" in line and "run.name=NEW_NAME" in line, line
    assert folder_bytes(trained) == before  # config.yaml, logs, metrics and checkpoints: every byte


@pytest.mark.timeout(180)
def test_hyper_parameter_changes_are_applied_and_logged(tiny_args: list[str], trained: Path) -> None:
    r = run_ddptrain(["train", *tiny_args, "train.max_steps=8", "train.lr=0.0005", "log.every_steps=2"])
    assert r.returncode == 0, r.stderr
    (event,) = [e for e in read_metrics(trained, "event") if e["event"] == "config_change"]
    assert event["step"] == 6 and event["checkpoint"] == "step-00000006"
    assert {c["key"]: c["new"] for c in event["changes"]} == {
        "train.max_steps": 8,
        "train.lr": 0.0005,
        "log.every_steps": 2,
    }
    assert "config changed since step-00000006" in r.stdout
    lrs = {m["step"]: m["lr"] for m in read_metrics(trained)}
    # both ends of the cosine (min_lr_ratio 0.1): the old peak before the resume, the new one after
    assert lrs[6] == pytest.approx(0.003 * 0.1) and lrs[8] == pytest.approx(0.0005 * 0.1)


def flip_world_size(folder: Path) -> None:
    p = folder / "manifest.json"
    p.write_text(p.read_text().replace('"world_size": 1', '"world_size": 3'))


def files_emptied(folder: Path) -> None:
    p = folder / "manifest.json"
    fields = json.loads(p.read_text())
    fields["files"] = {}
    fields["checksum"] = manifest_checksum(fields)
    p.write_text(json.dumps(fields))


def invalid_utf8(folder: Path) -> None:
    p = folder / "manifest.json"
    data = bytearray(p.read_bytes())
    data[20] = 0xFF
    p.write_bytes(bytes(data))


def escaping_name(name: str):  # type: ignore[no-untyped-def]
    def mutate(folder: Path) -> None:
        p = folder / "manifest.json"
        fields = json.loads(p.read_text())
        fields["files"][name] = {"sha256": "0" * 64, "size": 1}
        fields["checksum"] = manifest_checksum(fields)
        p.write_text(json.dumps(fields))

    return mutate


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (flip_world_size, "does not match its own checksum"),
        (files_emptied, "does not list rng-rank0.pt, structure.pt, tensors-0-of-2.bin, tensors-1-of-2.bin"),
        (invalid_utf8, "not valid UTF-8"),
        (escaping_name("../../../../etc/passwd"), "not a plain file name"),
        (escaping_name("/etc/passwd"), "not a plain file name"),
    ],
)
@pytest.mark.timeout(180)
def test_a_malformed_newest_manifest_falls_back_with_one_warning(
    tiny_args: list[str], trained: Path, mutate, reason: str
) -> None:  # type: ignore[no-untyped-def]
    mutate(trained / "checkpoints" / "step-00000006")
    r = run_ddptrain(["train", *tiny_args, "train.max_steps=7"])
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "checkpoint rejected" in line]  # a warning: stderr
    assert len(warnings) == 1 and "step-00000006" in warnings[0] and reason in warnings[0], r.stderr
    assert "resuming from" in r.stdout and "step-00000003 (step 3" in r.stdout
    assert "passwd" not in (r.stdout + r.stderr).replace("'../../../../etc/passwd'", "").replace("'/etc/passwd'", "")


@pytest.mark.timeout(180)
def test_planted_links_are_never_followed(tiny_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / ".tmp-step-00000003").symlink_to(victim)
    r = run_ddptrain(["train", *tiny_args])
    assert r.returncode == 0, r.stderr
    assert [p.name for p in victim.iterdir()] == ["precious.txt"] and (victim / "precious.txt").read_text() == "keep me"
    assert not (run_dir / "checkpoints" / ".tmp-step-00000003").is_symlink()
    (run_dir / "metrics.jsonl").rename(tmp_path / "old-metrics.jsonl")
    (run_dir / "metrics.jsonl").symlink_to(victim / "precious.txt")
    before = snapshot(run_dir)
    refused = run_ddptrain(["train", *tiny_args, "train.max_steps=7"])
    assert refused.returncode == 2
    assert "metrics.jsonl" in one_error_line(refused)
    assert (victim / "precious.txt").read_text() == "keep me" and snapshot(run_dir) == before


def start(args: list[str], nproc: int = 0) -> Any:
    """`ddptrain ARGS` (on nproc local ranks through `ddptrain launch` when nproc > 0), not waited for."""
    return start_ddptrain(
        args, nproc=nproc, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("nproc", [0, 2])
@pytest.mark.timeout(300)
def test_two_runs_on_one_folder_exactly_one_trains(tiny_args: list[str], tmp_path: Path, nproc: int) -> None:
    # The winner trains until it is stopped: however late the other one starts on a busy machine, the lease is
    # still held (a 30-step winner once finished first, and the other then resumed its last checkpoint).
    args = ["train", *tiny_args, "train.max_steps=100000", "ckpt.every_steps=5"]
    runs = [start(args, nproc), start(args, nproc)]  # the same moment
    deadline = time.monotonic() + 240
    while all(p.poll() is None for p in runs):
        assert time.monotonic() < deadline, "both runs are still going: neither was refused"
        time.sleep(0.05)
    [loser] = [p for p in runs if p.poll() is not None]
    [winner] = [p for p in runs if p is not loser]
    run_dir = tmp_path / "run"
    while not read_metrics(run_dir, "train"):  # stopped once it trains, so that its stop commits a checkpoint
        assert time.monotonic() < deadline and winner.poll() is None, "the winner never trained"
        time.sleep(0.05)
    os.killpg(winner.pid, signal.SIGTERM)
    (_, lost), (_, won) = loser.communicate(timeout=30), winner.communicate(timeout=120)
    assert (loser.returncode, winner.returncode) == (2, 75), (lost, won)  # `ddptrain launch` exits with its workers'
    assert lost.count("is in use by another run (pid ") == max(nproc, 1), lost
    assert "src/ddptrain" not in lost and "Traceback" not in lost, lost  # no traceback, worker's or agent's
    starts = [e for e in read_metrics(run_dir, "event") if e["event"] in ("start", "resume")]
    assert len(starts) == 1  # the loser never wrote a record
    stopped = [e for e in read_metrics(run_dir, "event") if e["event"] == "preempted"]
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1].name
    assert len(stopped) == 1 and newest == f"step-{stopped[0]['step']:08d}", (stopped, newest)


@pytest.mark.timeout(240)
def test_a_sigkilled_runs_lease_is_taken_over(tiny_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    victim = start(["train", *tiny_args, "train.max_steps=100000", "ckpt.every_steps=3"])
    wait_for(run_dir / "checkpoints" / "step-00000003")
    held = run_ddptrain(["train", *tiny_args, "train.max_steps=9"])
    assert held.returncode == 2 and f"pid {victim.pid} on" in one_error_line(held)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=30)
    assert (run_dir / ".lease").exists()  # a SIGKILLed owner cannot clean up
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1].name
    after = run_ddptrain(
        ["train", *tiny_args, "train.max_steps=1000000", "train.max_steps=" + str(int(newest[5:]) + 2)]
    )
    assert after.returncode == 0, after.stderr
    assert f"took over the lease of a run that is gone (pid {victim.pid} on" in after.stderr  # a warning
    assert not (run_dir / ".lease").exists()
