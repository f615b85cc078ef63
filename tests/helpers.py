"""Helpers for tests that run the real `ddptrain` command, alone or on several local workers."""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from toys import TINY
from zygote import Zygote

from ddptrain.checkpoint import verify_checkpoint
from ddptrain.data.corpus import prepare_corpus
from ddptrain.data.dataset import SftDataset, TokenDataset, load_split
from ddptrain.launch.worker_start import is_script
from ddptrain.models.loss import extract_loss, model_output

TESTS_DIR = Path(__file__).resolve().parent


def prepare_tiny_corpus(out: Path) -> Path:
    """A ~200 KB corpus from a few standard-library modules."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in ("argparse.py", "typing.py", "inspect.py")]
    prepare_corpus(files, out, val_fraction=0.1)
    return out


def folder_bytes(folder: Path) -> dict[str, str]:
    """Every entry under folder: a file's SHA-256, a link's target, "dir" for a folder (to prove a
    command changed nothing on disk)."""
    out = {}
    for entry in sorted(folder.rglob("*")):
        name = str(entry.relative_to(folder))
        if entry.is_symlink():
            out[name] = "-> " + os.readlink(entry)
        elif entry.is_dir():
            out[name] = "dir"
        else:
            out[name] = hashlib.sha256(entry.read_bytes()).hexdigest()
    return out


def env_for_subprocess(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: tests/ importable (for toy models), no inherited torchrun vars."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused command printed on stderr (asserting there is exactly one and no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def default_launcher() -> Literal["launch", "torchrun"]:
    """The launcher of run_ddptrain's multi-worker runs when a test names none: DDPTRAIN_TEST_LAUNCHER, else launch."""
    name = os.environ.get("DDPTRAIN_TEST_LAUNCHER", "launch")
    if name not in ("launch", "torchrun"):
        raise ValueError(f"DDPTRAIN_TEST_LAUNCHER={name!r}: use launch or torchrun")
    return "torchrun" if name == "torchrun" else "launch"


def run_ddptrain(
    args: list[str],
    *,
    nproc: int = 0,
    launcher: Literal["launch", "torchrun"] | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    max_file_bytes: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python -m ddptrain ARGS`, or with nproc > 0 the same command on N local workers (ARGS may also start with a
    Python script, `script.py ARGS`, run on every worker as torchrun runs one).

    The workers start through `ddptrain launch --nproc-per-node N --max-restarts 0 -- ARGS` (forked from its
    preloaded server: torch is imported once, not once per worker), or with launcher="torchrun" through plain
    `torchrun --standalone --nproc-per-node N -m ddptrain ARGS`, for the tests about torchrun's own agent.
    With no restarts both end the job at the first failed worker; launch exits with that worker's code when
    it is 2, 73, 75 or 130, and 1 otherwise (torchrun: 1 whatever the worker's code). Left out, the launcher is
    DDPTRAIN_TEST_LAUNCHER's (launch or torchrun; default launch), to compare the two on a machine.
    max_file_bytes sets RLIMIT_FSIZE (`ulimit -f`) for the processes: a larger write fails with EFBIG.
    """

    def limit() -> None:
        if max_file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    launcher = launcher or default_launcher()
    if nproc and launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += args if args and is_script(args[0]) else ["-m", "ddptrain", *args]
    else:
        args = _launched(args, nproc)
        if use_zygote():
            return _zygote().run(args, env_for_subprocess(env), cwd, timeout, max_file_bytes)
        cmd = [sys.executable, "-m", "ddptrain", *args]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_for_subprocess(env),
        cwd=cwd,
        preexec_fn=limit if max_file_bytes is not None else None,
    )


def start_ddptrain(
    args: list[str],
    *,
    nproc: int = 0,
    env: dict[str, str] | None = None,
    **popen_options: Any,
) -> Any:
    """Start `python -m ddptrain ARGS` (with nproc > 0: on N local workers through `ddptrain launch`, as
    run_ddptrain does) without waiting: a subprocess.Popen, or the zygote's process with the same interface.
    popen_options: stdout, stderr, text, cwd, start_new_session."""
    args = _launched(args, nproc)
    if use_zygote():
        return _zygote().start(args, env_for_subprocess(env), **popen_options)
    return subprocess.Popen([sys.executable, "-m", "ddptrain", *args], env=env_for_subprocess(env), **popen_options)


def _launched(args: list[str], nproc: int) -> list[str]:
    """ARGS as run on nproc local workers through `ddptrain launch` (unchanged when nproc is 0)."""
    return ["launch", "--nproc-per-node", str(nproc), "--max-restarts", "0", "--", *args] if nproc else args


def use_zygote() -> bool:
    """Whether run_ddptrain forks its `python -m ddptrain` processes from the preloaded test zygote
    (tests/zygote.py) instead of starting interpreters: yes unless DDPTRAIN_TEST_ZYGOTE=0."""
    return os.environ.get("DDPTRAIN_TEST_ZYGOTE", "1") != "0"


_ZYGOTES: list[Zygote] = []
_ZYGOTE_STARTING = threading.Lock()  # a test's threads may run commands at once: one zygote all the same


def _zygote() -> Zygote:
    """This pytest process's zygote, started on first use and ended with the process."""
    with _ZYGOTE_STARTING:
        if not _ZYGOTES:
            _ZYGOTES.append(Zygote(env_for_subprocess()))
            atexit.register(_ZYGOTES[0].close)
    return _ZYGOTES[0]


def cached_run(
    cache: Path, args: list[str], *, nproc: int = 0, launcher: Literal["launch", "torchrun"] = "launch"
) -> Path:
    """The run folder of `ddptrain ARGS` (nproc as in run_ddptrain; "{out}" in ARGS stands for that folder),
    trained once per cache: the uninterrupted reference runs that several tests compare with. A file lock
    lets pytest-xdist's workers share one cache folder; the tests only read the folder."""
    key = hashlib.sha256(json.dumps([args, nproc, launcher]).encode()).hexdigest()[:16]
    folder = cache / key
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / "trained").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a run that failed before in this session
            done = run_ddptrain(
                [a.replace("{out}", str(folder)) for a in args], nproc=nproc, launcher=launcher, timeout=240
            )
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
            (folder / "trained").touch()
    return folder


def descendants(pid: int) -> list[int]:
    """pid's child processes, theirs, and so on, from /proc's children lists."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def kill_job(pid: int) -> None:
    """SIGKILL the launcher pid and every process below it (workers, fork server, resource tracker): the job ends
    whole, as a lost node ends it. A kill of the launcher or its process group alone reaches none of its workers
    (sessions of their own): they stop on their own then (train/agent_watch.py), which is another test's subject."""
    victims = [pid, *descendants(pid)]  # walked before the kill: an orphan's parent changes
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # Until reaped, a killed worker's pid still exists (a zombie) and its run folder lease counts as held.
    deadline = time.monotonic() + 30
    while (left := [v for v in victims if v != pid and Path(f"/proc/{v}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes {left} of the killed job are still there"


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict[str, Any]]:
    """The records of one kind from run_dir/metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def final_model_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Model weights of the newest committed checkpoint."""
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    state: dict[str, torch.Tensor] = verify_checkpoint(ckpts[-1]).state("model")
    return state


def make_trainer(corpus: Path, run_dir: Path, overrides: list[str]) -> Any:
    """An in-process, single-process Trainer on the tiny corpus (no process group), built as `ddptrain train` does."""
    from ddptrain.config import load_config
    from ddptrain.dist import DistContext
    from ddptrain.run import build_run

    cfg = load_config(None, [*TINY, f"data.dir={corpus}", f"run.dir={run_dir}", *overrides])
    run = build_run(cfg, DistContext())
    run.triage.close()  # the step tests drive train_step() directly: no watchdog
    if run.lease is not None:
        run.lease.release()  # in-process tests build several trainers on one folder, one after another
    return run.trainer


def one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """main(argv) exits 2 with exactly one stderr line, `ddptrain CMD: error: ...`; that line."""
    from ddptrain.cli import main

    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, (rc, out, err)
    assert lines[0].startswith(f"ddptrain {argv[0]}: error: ") and "Traceback" not in out + err, lines
    return lines[0]


@contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. 64k, 4m) mounted at a new folder mount_point, unmounted afterwards: a disk
    that fills up for real. Needs root and mount rights; the test is skipped, with the reason, without them."""
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'not root'})")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


# `python -c HELD_BACK GATE ARGS`: `python -m ddptrain ARGS` once the file GATE exists, its imports done before (then
# it touches GATE.ready): a start that takes no time.
HELD_BACK = """
import pathlib, runpy, sys, time
import ddptrain.cli, ddptrain.run
gate = pathlib.Path(sys.argv.pop(1))
gate.with_name(gate.name + ".ready").touch()
while not gate.exists():
    time.sleep(0.05)
sys.argv[0] = "ddptrain"
runpy.run_module("ddptrain", run_name="__main__", alter_sys=True)
"""


def write_run_records(folder: Path, records: list[Any], name: str, max_steps: int) -> Path:
    """A run folder holding only metrics.jsonl (these records) and a minimal config.yaml: what
    `ddptrain report` reads, for tests of the report without a training run."""
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "config.yaml").write_text(f"run:\n  name: {name}\ntrain:\n  max_steps: {max_steps}\n")
    return folder


def load_token_datasets(data_dir: Path, block_size: int) -> tuple[TokenDataset | SftDataset, TokenDataset | SftDataset]:
    """A prepared corpus's train and validation datasets."""
    return load_split(data_dir, "train", block_size), load_split(data_dir, "val", block_size)


def call_model(model: torch.nn.Module, batch: Any, name: str) -> torch.Tensor:
    """The loss of one batch, as the trainer takes it (model_output, then extract_loss)."""
    return extract_loss(model_output(model, batch), name)
