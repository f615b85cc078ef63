"""One preparer at a time per corpus folder, and a prepared corpus published all at once.

Several processes can find a corpus folder missing at the same moment: every node of a job on a
shared home, two jobs, two `ddptrain prepare --out X`. Each prepare first takes the folder's lock,
`OUT/.prepare.lock` (a `ddptrain.lockfile` lock: link(2) of a private file, atomic on NFS too,
with the owner's host, pid and a heartbeat; a dead owner's lock is taken over). The others wait,
saying who they wait for, up to a bound, then fail with `Contention` (exit 1: not bad input).

The holder writes the new corpus into a private folder `OUT/.prepare-<token>/` and publishes it
with renames: meta.json (the completeness marker) is moved into the private folder, the shards and
tokenizer are renamed into OUT, the old corpus's files that the new one does not list are removed,
and the new meta.json is renamed in last. Until then the previous corpus (if any) stays whole and
usable; a reader never sees a meta.json naming files that are not there. The next holder of the
lock removes the private folders of preparers that died, keeping what their meta.json files list
(a publish cut short leaves the old and the new list there) as its own.

A prepare never deletes or replaces what no prepare wrote: under the lock, it refuses an OUT
holding anything it does not recognise (`PrepareLock.foreign`) unless told to go ahead (`--force`,
which replaces only files named like its own output). Its own are: a meta.json that passes the
schema (data/meta.py) and the shards and tokenizer it lists, the lock's files, the private folders
and the temporary files of older prepares.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ddptrain.data.meta import META, listed_files, read_meta_file
from ddptrain.errors import Contention, DataError
from ddptrain.lockfile import LockFile, Owner
from ddptrain.safe_files import fsync_dir

PREPARE_LOCK = ".prepare.lock"
PREPARE_WAIT_S = 3600.0
_SAY_EVERY_S = 30.0
_PRIVATE_PREFIX = ".prepare-"
_PRIVATE = re.compile(r"\.prepare-[0-9a-f]{32}")
# The temporary names of prepares from before private folders (shards and meta.json written in place).
_OLD_TMP = re.compile(r"\.(?:(?:train|val)-\d{5}\.bin|meta\.json|tokenizer\.json)\.\d+\.tmp")
# The lock and its helpers (lockfile.py): NAME, NAME.break, and their private and heartbeat files.
_LOCK_FILES = re.compile(r"\.prepare\.lock(?:\.break)?(?:\.[0-9a-f]{32}\.(?:tmp|beat))?")
_OLD_META = "meta.old.json"  # the replaced corpus's meta.json, in the private folder during a publish
_SHOWN = 3  # foreign names a refusal lists before "and N more"


class PrepareLock:
    """OUT's prepare lock (OUT exists), held from __enter__ (which may wait for another preparer) to __exit__."""

    def __init__(self, out_dir: Path, wait_s: float, say: Callable[[str], None]) -> None:
        self.out_dir, self.wait_s, self.say = out_dir, wait_s, say
        self.lock = LockFile(out_dir, PREPARE_LOCK)
        self.waited = False  # True when another preparer held the lock at first
        self.private = out_dir / f"{_PRIVATE_PREFIX}{self.lock.owner.token}"
        self.inherited: set[str] = set()  # files in OUT that dead preparers' meta.json files list
        self._dead: list[Path] = []  # their private folders, kept for those lists until a publish

    def __enter__(self) -> PrepareLock:
        self._acquire()
        if self.lock.took_over is not None:
            self.say(f"took over the prepare lock on {self.out_dir} from a preparer that is gone ({self._who()})")
        self.inherited, self._dead = _remove_debris(self.out_dir)
        return self

    def foreign(self) -> list[str]:
        """The names in OUT that no prepare wrote (sorted): what publishing could replace or remove."""
        own = _listed_files(self.out_dir) | self.inherited | {p.name for p in self._dead}
        own |= {META} if _valid_meta(self.out_dir) else set()
        return sorted(p.name for p in self.out_dir.iterdir() if p.name not in own and not _LOCK_FILES.fullmatch(p.name))

    def refuse_foreign(self, how: str) -> None:
        """DataError naming (a few of) the foreign names in OUT, if any; how: what the user can do instead."""
        names = self.foreign()
        if names:
            shown = ", ".join(repr(n) for n in names[:_SHOWN])
            more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
            raise DataError(f"{self.out_dir} holds files prepare did not write ({shown}{more}), left untouched; {how}")

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
        old = _listed_files(out) | self.inherited
        new = {p.name for p in private.iterdir()}
        try:
            # From here OUT is incomplete until meta.json is back; the old list stays where the next holder
            # of the lock finds it (and knows the old files as a prepare's) should this process die now.
            os.replace(out / META, private / _OLD_META)
        except FileNotFoundError:
            pass
        for name in sorted(new - {META}):
            os.replace(private / name, out / name)
        for name in sorted(old - new):
            (out / name).unlink(missing_ok=True)  # the old corpus's shards that the new one does not have
        fsync_dir(out)
        os.replace(private / META, out / META)
        fsync_dir(out)
        for folder in self._dead:  # the files they listed are gone or this corpus's now
            shutil.rmtree(folder, ignore_errors=True)


def _listed_files(folder: Path, name: str = META) -> set[str]:
    """The files the folder's meta.json (valid per the schema) says a prepare wrote: plain names only."""
    try:
        return listed_files(read_meta_file(folder, name))
    except (DataError, OSError):
        return set()


def _valid_meta(folder: Path) -> bool:
    try:
        read_meta_file(folder)
        return True
    except (DataError, OSError):
        return False


def _remove_debris(out_dir: Path) -> tuple[set[str], list[Path]]:
    """Remove what dead preparers left (only the lock holder calls this, so none of it is a live preparer's).

    Returns the names their meta.json files list (after a publish cut short, those files in OUT are a
    prepare's) and the private folders kept for those lists: emptied of all else now, removed by the
    next publish, which removes the files they list first; until then every holder learns them again.
    """
    listed: set[str] = set()
    kept: list[Path] = []
    for p in out_dir.iterdir():
        if _PRIVATE.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            names = _listed_files(p) | _listed_files(p, _OLD_META)
            for entry in p.iterdir() if names else ():
                if entry.name not in (META, _OLD_META):
                    _remove(entry)
            if names:
                listed |= names
                kept.append(p)
            else:
                shutil.rmtree(p, ignore_errors=True)
        elif _OLD_TMP.fullmatch(p.name) and p.is_file():
            p.unlink(missing_ok=True)
    return listed, kept


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def read_recipe(out_dir: Path) -> str | None:
    """The recipe recorded in the folder's meta.json (what was prepared from what), if any."""
    try:
        recipe = read_meta_file(out_dir).get("recipe")
    except (DataError, OSError):
        return None
    return recipe if isinstance(recipe, str) else None
