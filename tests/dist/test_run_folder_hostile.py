"""Every file a run, a failed step and `ddptrain report` write in run.dir, with a link or a FIFO planted in its place.

A link is never followed (the victim outside the run keeps every byte): an appended file (the
certificate, metrics, the rank logs, the stacks file) or a folder (logs, stacks, checkpoints, report)
is refused before training in one line with exit 2; a file rewritten whole (config.yaml, the report's
summary and plots) is replaced by a rename. A FIFO is refused the same way, never waited on (each
command runs under a timeout, so a regression fails instead of hanging); a FIFO inside a checkpoint
fails that checkpoint's verification and every command falls back to the previous one. Then the
"lower" cases of the issue: a `checkpoints` that is not a folder, and a disk that fills up mid-run.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TINY, mounted_tmpfs, one_error_line, run_ddptrain, start_ddptrain

from ddptrain.cli import main

pytestmark = pytest.mark.dist

HOST = socket.gethostname()
STACKS_TXT = f"stacks/rank-0-{HOST}.txt"
FOLDERS = {"logs", "stacks", "checkpoints", "report"}


@pytest.fixture(scope="module")
def trained(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 6-step run (checkpoints at steps 3 and 6, a report), copied by every case."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    done = run_ddptrain(["train", *TINY, f"data.dir={corpus_dir}", f"run.dir={run_dir}"])
    assert done.returncode == 0, done.stderr
    assert main(["report", str(run_dir)]) == 0
    return run_dir


@pytest.fixture
def victims(tmp_path: Path) -> tuple[Path, Path]:
    """A file and a folder outside any run: what a planted link points at."""
    folder = tmp_path / "victim-dir"
    folder.mkdir()
    (folder / "precious.txt").write_text("keep me")
    file = tmp_path / "victim.txt"
    file.write_text("precious bytes\n")
    return file, folder


def assert_untouched(victims: tuple[Path, Path]) -> None:
    file, folder = victims
    assert file.read_text() == "precious bytes\n"
    assert [p.name for p in folder.iterdir()] == ["precious.txt"] and (folder / "precious.txt").read_text() == "keep me"


def plant(run_dir: Path, entry: str, kind: str, victims: tuple[Path, Path]) -> Path:
    """Replace run_dir/entry by a link to a victim (a folder's name: to the victim folder) or a FIFO."""
    path = run_dir / entry
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(victims[1] if entry in FOLDERS else victims[0])
    return path


def entries(folder: Path) -> dict[str, str]:
    """folder_bytes (helpers.py), with "fifo" for a FIFO: looked at, never opened."""
    out = {}
    for entry in sorted(folder.rglob("*")):
        mode, name = entry.lstat().st_mode, str(entry.relative_to(folder))
        if stat.S_ISLNK(mode):
            out[name] = "-> " + os.readlink(entry)
        elif stat.S_ISFIFO(mode):
            out[name] = "fifo"
        elif stat.S_ISDIR(mode):
            out[name] = "dir"
        else:
            out[name] = hashlib.sha256(entry.read_bytes()).hexdigest()
    return out


def copy_run(trained: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir, symlinks=True)
    return run_dir


REFUSED = ["certificate.jsonl", "metrics.jsonl", "logs/rank-0.log", "logs", "stacks", STACKS_TXT, "checkpoints"]


@pytest.mark.parametrize("kind", ["link", "fifo"])
@pytest.mark.parametrize("entry", [*REFUSED, ".lease"])
@pytest.mark.timeout(120)
def test_a_planted_link_or_fifo_is_refused_before_training(
    corpus_dir: Path, trained: Path, tmp_path: Path, victims: tuple[Path, Path], entry: str, kind: str
) -> None:
    run_dir = copy_run(trained, tmp_path)
    plant(run_dir, entry, kind, victims)
    before = entries(run_dir)
    r = run_ddptrain(["train", *TINY, f"data.dir={corpus_dir}", f"run.dir={run_dir}", "train.max_steps=7"], timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = one_error_line(r)
    assert line.startswith("ddptrain train: error: ") and str(run_dir / entry) in line, line
    assert_untouched(victims)
    assert entries(run_dir) == before  # refused before anything was written


@pytest.mark.timeout(120)
def test_a_planted_config_yaml_link_is_replaced(
    corpus_dir: Path, trained: Path, tmp_path: Path, victims: tuple[Path, Path]
) -> None:
    run_dir = copy_run(trained, tmp_path)
    shutil.copy(run_dir / "config.yaml", victims[0])
    kept = victims[0].read_bytes()
    plant(run_dir, "config.yaml", "link", victims)
    r = run_ddptrain(["train", *TINY, f"data.dir={corpus_dir}", f"run.dir={run_dir}", "train.max_steps=7"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert victims[0].read_bytes() == kept
    assert not (run_dir / "config.yaml").is_symlink() and "max_steps: 7" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("entry", ["stacks", STACKS_TXT])
@pytest.mark.timeout(120)
def test_a_failing_step_never_writes_its_stacks_through_a_link(
    tmp_path: Path, victims: tuple[Path, Path], entry: str
) -> None:
    failing = [
        "model.target=faulty:build_model",
        "model.kwargs={fail_at: 2}",
        "data.target=toy:build_datasets",
        "data.micro_batch_size=4",
        "train.global_batch_size=8",
        "train.max_steps=4",
        f"run.dir={tmp_path / 'run'}",
    ]
    control = run_ddptrain(["train", *failing], timeout=60)  # the failed step writes its stacks here...
    assert control.returncode == 1 and "failed in step 1" in control.stderr, control.stderr
    assert "Traceback" in (tmp_path / "run" / STACKS_TXT).read_text()
    plant(tmp_path / "run", entry, "link", victims)  # ...and never through a link planted there
    r = run_ddptrain(["train", *failing], timeout=60)
    assert r.returncode == 2 and str(tmp_path / "run" / entry) in one_error_line(r)
    assert_untouched(victims)


@pytest.mark.parametrize(
    "entry",
    [
        "report",
        "report/summary.txt",
        *(f"report/{n}.png" for n in ("loss", "lr", "throughput", "step_time", "goodput")),
    ],
)
@pytest.mark.timeout(120)
def test_report_replaces_a_planted_file_link_and_refuses_a_folder_link(
    trained: Path, tmp_path: Path, victims: tuple[Path, Path], capsys: pytest.CaptureFixture[str], entry: str
) -> None:
    run_dir = copy_run(trained, tmp_path)
    plant(run_dir, entry, "link", victims)
    capsys.readouterr()
    rc = main(["report", str(run_dir)])
    out, err = capsys.readouterr()
    assert_untouched(victims)
    if entry == "report":
        assert (
            rc == 2 and out == "" and err.count("\n") == 1 and f"cannot write the report into {run_dir / entry}" in err
        )
    else:
        assert rc == 0, err
        assert (run_dir / entry).is_file() and not (run_dir / entry).is_symlink()
        assert not list((run_dir / "report").glob(".*.tmp"))  # no temp file left behind


@pytest.mark.parametrize(
    ("command", "name"),
    [
        ("train", "rng-rank0.pt"),
        ("train", "structure.pt"),
        ("train", "manifest.json"),
        ("export", "rng-rank0.pt"),
        ("generate", "structure.pt"),
        ("eval", "manifest.json"),
    ],
)
@pytest.mark.timeout(120)
def test_a_fifo_in_a_checkpoint_fails_its_verification_and_the_previous_one_is_used(
    corpus_dir: Path, trained: Path, tmp_path: Path, command: str, name: str
) -> None:
    run_dir = copy_run(trained, tmp_path)
    fifo = run_dir / "checkpoints" / "step-00000006" / name
    fifo.unlink()
    os.mkfifo(fifo)
    args = {
        "train": ["train", *TINY, f"data.dir={corpus_dir}", f"run.dir={run_dir}", "train.max_steps=7"],
        "export": ["export", str(run_dir), "--out", str(tmp_path / "out" / "model.safetensors")],
        "generate": ["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "4"],
        "eval": ["eval", str(run_dir), "--batches", "2"],
    }[command]
    r = run_ddptrain(args, timeout=90)
    assert r.returncode == 0, r.stderr
    rejected = [x for x in (r.stdout + r.stderr).splitlines() if "checkpoint rejected" in x]
    assert len(rejected) == 1 and "step-00000006" in rejected[0] and name in rejected[0], rejected
    assert "not a regular file" in rejected[0]


@pytest.mark.parametrize("kind", ["file", "fifo"])
@pytest.mark.timeout(120)
def test_checkpoints_that_is_not_a_folder_is_refused_before_training(
    tiny_args: list[str], tmp_path: Path, kind: str
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if kind == "fifo":
        os.mkfifo(run_dir / "checkpoints")
    else:
        (run_dir / "checkpoints").write_text("not a folder")
    r = run_ddptrain(["train", *tiny_args], timeout=60)
    assert r.returncode == 2
    assert f"{run_dir / 'checkpoints'} is not a folder" in one_error_line(r)
    assert not (run_dir / "certificate.jsonl").exists() and "step 1" not in r.stdout  # not one step trained


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "small-disk", "4m") as mount_point:
        yield mount_point


def fill(folder: Path) -> None:
    """Write a filler file until the disk is full. The run may have filled it first (a tiny model
    writes its certificate and metrics at ~1 MB/s), and then even creating the filler fails."""
    try:
        with open(folder / "filler", "wb") as f:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC, e


@pytest.mark.timeout(180)
def test_a_disk_that_fills_up_mid_run_stops_it_naming_the_file_and_step(corpus_dir: Path, small_disk: Path) -> None:
    run_dir = small_disk / "run"
    args = [*TINY, f"data.dir={corpus_dir}", f"run.dir={run_dir}", "train.max_steps=100000", "ckpt.every_steps=100000"]
    proc = start_ddptrain(["train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 5:
                break
            time.sleep(0.1)
        assert metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 5, proc.communicate()
        fill(small_disk)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, (out[-2000:], err)
    errors = [line for line in err.splitlines() if " error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"cannot write the resume certificate {run_dir / 'certificate.jsonl'} at step " in errors[0], errors
    assert "No space left on device" in errors[0]
    assert not (run_dir / ".lease").exists()  # released: the next run need not wait for it to go stale
