"""One preparer at a time per corpus folder, and a prepared corpus published all at once.

Several processes can find a corpus folder missing at the same moment: every node of a job on a
shared home, two jobs, two `ddptrain prepare --out X`. Each prepare first takes the folder's lock,
`OUT/.prepare.lock` (a `ddptrain.lockfile` lock: link(2) of a private file, atomic on NFS too,
with the owner's host, pid and a heartbeat; a dead owner's lock is taken over). The others wait,
saying who they wait for, up to a bound, then fail with `Contention` (exit 1: not bad input).

The holder writes the new corpus into a private folder `OUT/.prepare-<token>/` and publishes it
with renames: meta.json (the completeness marker) is removed, the shards and tokenizer are
renamed into OUT, the old corpus's files that the new one does not list are removed, and
meta.json is renamed in last. Until then the previous corpus (if any) stays whole and usable; a
reader never sees a meta.json naming files that are not there. The next holder of the lock removes
the private folders of preparers that died; it never removes a file that no prepare wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddptrain.errors import Contention
from ddptrain.lockfile import LockFile, Owner
from ddptrain.safe_files import fsync_dir

META = "meta.json"
PREPARE_LOCK = ".prepare.lock"
PREPARE_WAIT_S = 3600.0
_SAY_EVERY_S = 30.0
_PRIVATE_PREFIX = ".prepare-"
_PRIVATE = re.compile(r"\.prepare-[0-9a-f]{32}")
# The temporary names of prepares from before private folders (shards and meta.json written in place).
_OLD_TMP = re.compile(r"\.(?:(?:train|val)-\d{5}\.bin|meta\.json|tokenizer\.json)\.\d+\.tmp")


class PrepareLock:
    """OUT's prepare lock (OUT exists), held from __enter__ (which may wait for another preparer) to __exit__."""

    def __init__(self, out_dir: Path, wait_s: float, say: Callable[[str], None]) -> None:
        self.out_dir, self.wait_s, self.say = out_dir, wait_s, say
        self.lock = LockFile(out_dir, PREPARE_LOCK)
        self.waited = False  # True when another preparer held the lock at first
        self.private = out_dir / f"{_PRIVATE_PREFIX}{self.lock.owner.token}"

    def __enter__(self) -> PrepareLock:
        self._acquire()
        if self.lock.took_over is not None:
            self.say(f"took over the prepare lock on {self.out_dir} from a preparer that is gone ({self._who()})")
        _remove_debris(self.out_dir)
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.private, ignore_errors=True)
        self.lock.release()

    def _who(self) -> str:
        assert self.lock.took_over is not None
        return self.lock.took_over.describe()

    def _acquire(self) -> None:
        start = time.monotonic()
        said_at: float | None = None
        holder: Owner | None = None
        while True:
            taken, live = self.lock.attempt()
            if taken:
                return
            holder = live or holder
            waited = time.monotonic() - start
            if waited >= self.wait_s:
                who = f"by {holder.describe()}" if holder else "by other processes that keep taking its lock"
                raise Contention(
                    f"{self.out_dir} is being prepared {who}; gave up after waiting {waited:.0f}s "
                    "(run again once it is done, or prepare into another folder)"
                )
            if live is None:
                continue  # a lock being written or a stale one just broken: try again at once
            self.waited = True
            if said_at is None or time.monotonic() - said_at >= _SAY_EVERY_S:
                self.say(
                    f"waiting for another prepare of {self.out_dir} ({live.describe()}); "
                    f"waited {waited:.0f}s of at most {self.wait_s:.0f}s"
                )
                said_at = time.monotonic()
            time.sleep(min(0.5, max(0.0, self.wait_s - waited)))

    def publish(self) -> None:
        """Move the corpus prepared in the private folder into OUT, meta.json last."""
        if not self.lock.held():
            raise Contention(
                f"lost the prepare lock on {self.out_dir} while preparing (this process stalled and another "
                "judged it dead); nothing was published: run again"
            )
        out, private = self.out_dir, self.private
        old = _listed_files(out)
        (out / META).unlink(missing_ok=True)  # from here the folder is incomplete until meta.json is back
        new = {p.name for p in private.iterdir()}
        for name in sorted(new - {META}):
            os.replace(private / name, out / name)
        for name in sorted(old - new):
            (out / name).unlink(missing_ok=True)  # the old corpus's shards that the new one does not have
        fsync_dir(out)
        os.replace(private / META, out / META)
        fsync_dir(out)


def _listed_files(out_dir: Path) -> set[str]:
    """The files the folder's meta.json says a prepare wrote (plain names only: nothing outside OUT)."""
    try:
        meta: Any = json.loads((out_dir / META).read_text())
        if "shards" not in meta:  # the format before shards: train.bin and val.bin
            return {"train.bin", "val.bin"}
        names = [s["file"] for split in meta["shards"].values() for s in split]
        tokenizer = (meta.get("tokenizer") or {}).get("file")
        names += [tokenizer] if tokenizer else []
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return set()
    return {n for n in names if isinstance(n, str) and Path(n).name == n and n not in ("", ".", "..")}


def _remove_debris(out_dir: Path) -> None:
    """What dead preparers left (only the lock holder calls this, so none of it is a live preparer's)."""
    for p in out_dir.iterdir():
        if _PRIVATE.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif _OLD_TMP.fullmatch(p.name) and p.is_file():
            p.unlink(missing_ok=True)


def read_recipe(out_dir: Path) -> str | None:
    """The recipe recorded in the folder's meta.json (what was prepared from what), if any."""
    try:
        recipe = json.loads((out_dir / META).read_text()).get("recipe")
    except (OSError, ValueError, AttributeError):
        return None
    return recipe if isinstance(recipe, str) else None
