"""The prepare lock and the atomic publish: one holder at a time, waiters bounded, dead preparers' debris
recovered, and a folder that is only ever the old corpus, nothing, or the new one."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sysconfig
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.data.corpus import PrepareOptions, corpus_ready, prepare_corpus, read_meta
from ddptrain.data.publish import PREPARE_LOCK, PrepareLock
from ddptrain.data.tokenizer import sha256_file
from ddptrain.errors import Contention, DataError, DdptrainError
from ddptrain.lockfile import STALE_S, LockFile, me, read_owner

Op = tuple[int, str]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = [STDLIB / n for n in ("argparse.py", "typing.py", "inspect.py")]


def _files(folder: Path, hidden: bool = True) -> dict[str, bytes]:
    """Every file in folder by name, with its bytes (a folder there fails the comparisons)."""
    return {p.name: p.read_bytes() if p.is_file() else b"<dir>" for p in folder.iterdir() if hidden or p.name[0] != "."}


def _assert_whole(folder: Path) -> None:
    """A complete corpus: meta.json and exactly the shards it lists, each with its recorded SHA-256."""
    meta = read_meta(folder)
    for split in ("train", "val"):
        for shard in meta["shards"][split]:
            assert sha256_file(folder / shard["file"]) == shard["sha256"]


@given(ops=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["attempt", "release", "die"])), max_size=12))
@settings(max_examples=40, deadline=None)
def test_at_most_one_holder_whatever_the_order(tmp_path_factory: pytest.TempPathFactory, ops: list[Op]) -> None:
    """Three contenders attempt, release and die in any order: the lock file always names the one holder
    of the model, a release by a non-holder removes nothing, and a dead holder's lock is taken over."""
    folder = tmp_path_factory.mktemp("lock")
    locks = [LockFile(folder, PREPARE_LOCK) for _ in range(3)]
    holder: int | None = None
    recorded: str | None = None  # the token the lock file should name
    try:
        for who, op in ops:
            if op == "attempt":
                taken, live = locks[who].attempt()
                if holder is None:
                    taken = taken or locks[who].attempt()[0]  # a dead owner's lock: broken first, then taken
                    assert taken
                    holder, recorded = who, locks[who].owner.token
                else:
                    assert not taken and live is not None and live.token == recorded
            elif op == "release":
                locks[who].release()
                if holder == who:
                    holder = recorded = None
            elif holder == who:  # the holder dies: its file stays, naming a pid that is gone
                locks[who].release()
                dead = replace(locks[who].owner, pid=_dead_pid())
                (folder / PREPARE_LOCK).write_text(json.dumps(asdict(dead)))
                locks[who] = LockFile(folder, PREPARE_LOCK)
                holder, recorded = None, dead.token
            current = read_owner(folder / PREPARE_LOCK)
            assert (current.token if current else None) == recorded
    finally:
        for lock in locks:
            lock.release()


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_waiter_gives_up_naming_the_holder_and_writes_nothing(tmp_path: Path) -> None:
    holder = LockFile(tmp_path, PREPARE_LOCK)
    assert holder.attempt()[0]
    said: list[str] = []
    try:
        with pytest.raises(Contention, match=rf"being prepared by pid {os.getpid()} on .*gave up after waiting"):
            prepare_corpus(FILES, tmp_path, 0.1, PrepareOptions(wait_s=0.6), say=said.append)
    finally:
        holder.release()
    assert Contention("x").exit_code == 1  # not bad input (2)
    assert said and f"waiting for another prepare of {tmp_path} (pid {os.getpid()} on " in said[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the waiter left nothing


def test_another_hosts_lock_is_honoured_until_its_heartbeat_is_stale(tmp_path: Path) -> None:
    elsewhere = replace(me(), host="node-elsewhere", pid=4242, heartbeat=time.time())
    (tmp_path / PREPARE_LOCK).write_text(json.dumps(asdict(elsewhere)))
    with pytest.raises(Contention, match="pid 4242 on node-elsewhere"):
        prepare_corpus(FILES, tmp_path, 0.1, PrepareOptions(wait_s=0.3), say=lambda _: None)
    stale = replace(elsewhere, heartbeat=time.time() - STALE_S - 1)
    (tmp_path / PREPARE_LOCK).write_text(json.dumps(asdict(stale)))
    said: list[str] = []
    prepare_corpus(FILES, tmp_path, 0.1, say=said.append)
    assert any("took over the prepare lock" in s and "node-elsewhere" in s for s in said)
    _assert_whole(tmp_path)
    assert not (tmp_path / PREPARE_LOCK).exists()


def _die_mid_prepare(out: str, stage: str, ready: mp.Event) -> None:  # type: ignore[type-arg]
    """A real preparer SIGKILLed with the lock held: after writing part of a shard, or a whole corpus that
    it had not published yet."""
    from ddptrain.data.prepare import TokenizerSpec, _prepare_into, recipe_of
    from ddptrain.data.shards import ShardWriter

    lock = PrepareLock(Path(out), 60, print).__enter__()
    lock.private.mkdir()
    if stage == "mid-shard":
        ShardWriter(lock.private, "train", 1 << 20, np.dtype(np.uint8)).append(np.arange(5000, dtype=np.uint8))
    else:
        opts = PrepareOptions(shard_tokens=50_000)  # several train shards: names the old corpus does not have
        spec = TokenizerSpec.parse("bytes")
        _prepare_into(FILES, lock.private, 0.1, opts, spec, recipe_of(FILES, 0.1, opts, spec))
    if stage == "mid-publish":  # publish's first steps (PrepareLock.publish), then killed before meta.json
        os.replace(Path(out) / "meta.json", lock.private / "meta.old.json")
        for shard in sorted(lock.private.glob("train-*.bin")):
            os.replace(shard, Path(out) / shard.name)
    ready.set()
    time.sleep(60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", ["mid-shard", "before-publish", "mid-publish"])
def test_a_killed_preparers_lock_and_private_folder_are_recovered(tmp_path: Path, stage: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    prepare_corpus(FILES[:2], out, 0.1)  # an older corpus, which a dead preparer must not have damaged
    (out / "notes.txt").write_text("the user's")  # prepare never removes what it did not write
    before = _files(out)
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_die_mid_prepare, args=(str(out), stage, ready))
    child.start()
    assert ready.wait(30)
    os.kill(child.pid or 0, signal.SIGKILL)
    child.join(10)
    debris = {p.name for p in out.iterdir() if p.name.startswith(".prepare")}
    private = debris - {PREPARE_LOCK}
    assert PREPARE_LOCK in debris and len(private) == 1 and any((out / private.pop()).iterdir())
    if stage == "mid-publish":  # no meta.json: the shards in OUT are known from the dead one's private folder
        assert not corpus_ready(out) and len(list(out.glob("train-*.bin"))) > 1  # the old corpus had one
    else:
        assert corpus_ready(out) and _files(out, hidden=False) == before
    said: list[str] = []
    # Only the user's file is foreign: the dead preparer's lock, private folder and half-published shards are a prepare's.
    with pytest.raises(DataError, match=r"holds files prepare did not write \('notes.txt'\), left untouched"):
        prepare_corpus(FILES, out, 0.1, say=said.append)
    prepare_corpus(FILES, out, 0.1, PrepareOptions(force=True), say=said.append)
    assert any("took over the prepare lock" in s for s in said)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    _assert_whole(out)
    assert (out / "notes.txt").read_text() == "the user's"
    reference = tmp_path / "reference"
    prepare_corpus(FILES, reference, 0.1)
    assert {n: b for n, b in _files(out).items() if n != "notes.txt"} == _files(reference)


@given(corpora=st.lists(st.tuples(st.integers(1, 3), st.sampled_from([9000, 40_000, 1 << 20])), min_size=1, max_size=4))
@settings(max_examples=12, deadline=None)
def test_publishing_replaces_only_what_prepare_wrote(tmp_path_factory: pytest.TempPathFactory, corpora: list) -> None:  # type: ignore[type-arg]
    """Corpora of other files and shard counts prepared over each other with --force: after each the folder is
    exactly that corpus (an old corpus's extra shards removed) beside the user's files, byte for byte."""
    out = tmp_path_factory.mktemp("out")
    users = {"train.bin": b"nanoGPT data", "draft.tmp": b"x", "val-final.bin": b"y", "train-00099.bin.bak": b"z"}
    for name, data in users.items():
        (out / name).write_bytes(data)
    with pytest.raises(DataError, match=r"\('draft.tmp', 'train-00099.bin.bak', 'train.bin' and 1 more\)"):
        prepare_corpus(FILES, out, 0.1)  # refused without --force: nothing written
    assert _files(out) == users
    for n_files, shard_tokens in corpora:
        prepare_corpus(FILES[:n_files], out, 0.1, PrepareOptions(shard_tokens=shard_tokens, force=True))
        _assert_whole(out)
        meta = read_meta(out)
        listed = {s["file"] for split in ("train", "val") for s in meta["shards"][split]}
        assert set(_files(out)) == listed | {"meta.json"} | set(users)
        assert all((out / name).read_bytes() == data for name, data in users.items())


def test_failing_prepare_keeps_the_old_corpus(tmp_path: Path) -> None:
    prepare_corpus(FILES, tmp_path, 0.1)
    before = _files(tmp_path)
    tiny = tmp_path.parent / "tiny.txt"
    tiny.write_text("too small")
    with pytest.raises(DdptrainError, match="corpus too small"):
        prepare_corpus([tiny], tmp_path, 0.1)
    assert _files(tmp_path) == before
