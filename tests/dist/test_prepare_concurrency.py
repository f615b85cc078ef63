"""Real processes preparing one corpus folder at once: `ddptrain prepare --out X` twice, and two
`ddptrain train` runs (different run folders) that find the default corpus missing. One prepares,
the other waits and reuses; nobody fails, nobody sees a half-written corpus; a wait that runs out
exits 1 (not bad input) naming the holder."""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from helpers import TINY, start_ddptrain

from ddptrain.config import DataConfig
from ddptrain.data.corpus import PrepareOptions, corpus_ready, prepare_corpus, read_meta, stdlib_sources
from ddptrain.data.publish import PREPARE_LOCK
from ddptrain.data.tokenizer import sha256_file
from ddptrain.lockfile import LockFile

pytestmark = pytest.mark.dist

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = [str(STDLIB / n) for n in ("argparse.py", "typing.py", "inspect.py")]
SHORT = [*TINY, "train.max_steps=2", "train.warmup_steps=1", "ckpt.every_steps=2"]
WAITING = "waiting for another prepare of"
VAL_FRACTION = DataConfig.model_fields["val_fraction"].default  # what prepare and the default corpus use


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


class Reader(threading.Thread):
    """Polls a corpus folder the whole time: whenever meta.json is there, every shard it lists is there
    with its recorded SHA-256 (a reader never sees a half-written corpus)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder = folder
        self.looks = 0
        self.broken: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if corpus_ready(self.folder):
                meta = read_meta(self.folder)
                shards = [s for split in ("train", "val") for s in meta["shards"][split]]
                self.broken += [s["file"] for s in shards if sha256_file(self.folder / s["file"]) != s["sha256"]]
                self.looks += 1
            time.sleep(0.005)


def _start(args: list[str], log: Path, cwd: Path) -> tuple[subprocess.Popen[str], IO[str]]:
    out = open(log, "w")
    proc = start_ddptrain(args, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    return proc, out


def _wait_for_line(procs: list[subprocess.Popen[str]], logs: list[Path], text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(text in log.read_text() for log in logs):
        exited = [(p.args, p.poll(), log.read_text()) for p, log in zip(procs, logs) if p.poll() is not None]
        assert not exited and time.monotonic() < deadline, exited
        time.sleep(0.05)


def _finish(procs: list[tuple[subprocess.Popen[str], IO[str]]], timeout: float = 120) -> list[int]:
    try:
        return [p.wait(timeout) for p, _ in procs]
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            out.close()


@pytest.mark.timeout(240)
def test_two_prepares_of_one_folder_one_prepares_the_other_reuses(tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    out.mkdir()
    holder = LockFile(out, PREPARE_LOCK)  # held until both have started and wait: then they contend for real
    assert holder.attempt()[0]
    reader = Reader(out)
    reader.start()
    logs = [tmp_path / f"prepare-{i}.log" for i in range(2)]
    procs = [_start(["prepare", "--out", str(out), *FILES], log, tmp_path) for log in logs]
    try:
        _wait_for_line([p for p, _ in procs], logs, WAITING)
        assert os.listdir(out) == [PREPARE_LOCK]  # a waiter writes nothing
    finally:
        holder.release()
    codes = _finish(procs)
    deadline = time.monotonic() + 30
    while reader.looks == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # at least one look at the finished corpus
    reader.stop.set()
    reader.join(10)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    assert sorted(t.splitlines()[-1].split(" ")[0] for t in texts) == ["prepared", "reused"], texts
    reference = prepare_corpus([Path(f) for f in FILES], tmp_path / "reference", VAL_FRACTION)
    assert _files(out) == _files(reference.out_dir)
    assert reader.looks > 0 and reader.broken == []


@pytest.mark.timeout(240)
def test_two_prepares_started_together_both_succeed(tmp_path: Path) -> None:
    """The report's case, unarranged: two prepares of the default corpus into one new folder started at
    the same moment (small shards make the prepares overlap: before the lock, one failed 3 times of 3 with
    `No such file or directory: .../.train-00487.bin.NNNN.tmp` and exit 2)."""
    out = tmp_path / "corpus"
    logs = [tmp_path / f"prepare-{i}.log" for i in range(2)]
    args = ["prepare", "--out", str(out), "--shard-tokens", "4096"]
    procs = [_start(args, log, tmp_path) for log in logs]
    assert _finish(procs) == [0, 0], [log.read_text() for log in logs]
    reference = prepare_corpus(
        stdlib_sources(), tmp_path / "reference", VAL_FRACTION, PrepareOptions(shard_tokens=4096)
    )
    assert _files(out) == _files(reference.out_dir)


@pytest.mark.timeout(300)
def test_two_trainings_find_the_default_corpus_missing_and_share_it(tmp_path: Path) -> None:
    data = tmp_path / "data" / "stdlib"  # data.dir's default, relative to the working folder
    data.mkdir(parents=True)
    holder = LockFile(data, PREPARE_LOCK)
    assert holder.attempt()[0]
    logs = [tmp_path / f"train-{i}.log" for i in range(2)]
    procs = [_start(["train", *SHORT, f"run.dir={tmp_path / f'run-{i}'}"], log, tmp_path) for i, log in enumerate(logs)]
    try:
        _wait_for_line([p for p, _ in procs], logs, WAITING)
    finally:
        holder.release()
    codes = _finish(procs, timeout=240)
    assert codes == [0, 0], [log.read_text() for log in logs]
    reference = prepare_corpus(stdlib_sources(), tmp_path / "reference", VAL_FRACTION)
    assert _files(data) == _files(reference.out_dir)
    assert all((tmp_path / f"run-{i}" / "checkpoints" / "step-00000002").is_dir() for i in range(2))


@pytest.mark.timeout(180)
def test_a_training_that_waits_too_long_exits_1_naming_the_holder(tmp_path: Path) -> None:
    data = tmp_path / "data" / "stdlib"
    data.mkdir(parents=True)
    holder = LockFile(data, PREPARE_LOCK)
    assert holder.attempt()[0]
    try:
        log = tmp_path / "train.log"
        proc = _start(["train", *SHORT, f"run.dir={tmp_path / 'run'}", "dist.timeout_s=2"], log, tmp_path)
        (code,) = _finish([proc])
    finally:
        holder.release()
    text = log.read_text()
    assert code == 1, text  # a busy folder is no bad input (2): a retry succeeds
    line = f"data/stdlib is being prepared by pid {os.getpid()} on "
    assert line in text and re.search(r"gave up after waiting \d+s", text), text
    assert os.listdir(data) == []
