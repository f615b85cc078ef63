"""Transactional checkpoints: a folder is either fully committed and verified, or never loaded.

Layout of one checkpoint, `run.dir/checkpoints/step-00000100/`: the files of the run's format
(ckpt.format; formats/, each module's docstring lists its files), written by the ranks as the
format says, and

    manifest.json                          every file's digest (ckpt.hash) and size, step, world size, timeline,
                                           writer (the format's name), config, identity, and its own checksum
                                           (manifest.py)

A run resumes from a checkpoint of any format: its manifest names the one that reads it.

The protocol: every rank writes its files as new files under a new `.tmp-step-00000100.<tag>/`
(never through an existing name or link; the tag is the run's lease token, so two runs never share
a temp folder) and fsyncs them; the ranks agree (one all-gather) whether every write succeeded;
only then rank 0 re-reads the run folder's lease (a run whose lease was taken commits nothing),
writes the manifest, fsyncs the folder, renames it to `step-00000100` (atomic on POSIX) and fsyncs
the parent. A crash at any point leaves either the
old set of committed checkpoints or the new one. Pruning follows a commit (in a thread of its own,
joined by the next save and by wait()) and touches only the current timeline (store.py). Resume
verifies and reads in one pass (verify.py; several ranks share it out by node and exchange the
rest, shared_load.py), checks the config (compat.py), and moves checkpoints newer than its starting
point into checkpoints/archive/.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddptrain.checkpoint.best import write_best
from ddptrain.checkpoint.compat import ConfigChange, check_resume
from ddptrain.checkpoint.durable import write_durable
from ddptrain.checkpoint.formats.base import CheckpointFormat
from ddptrain.checkpoint.formats.registry import checkpoint_format
from ddptrain.checkpoint.lease import live_tokens
from ddptrain.checkpoint.load_plan import nodes_of
from ddptrain.checkpoint.manifest import (
    MANIFEST,
    TMP_PREFIX,
    FileEntry,
    Manifest,
    ManifestError,
    checkpoint_name,
    step_of,
)
from ddptrain.checkpoint.policy import SavePolicy, SaveResult
from ddptrain.checkpoint.shared_load import SharedLoad
from ddptrain.checkpoint.store import archive, committed_checkpoints, prune, search
from ddptrain.checkpoint.verify import VerifiedCheckpoint, verify_checkpoint
from ddptrain.config import CkptConfig
from ddptrain.dist import DistContext
from ddptrain.errors import CheckpointError
from ddptrain.run_folder import checkpoints_dir
from ddptrain.safe_files import fsync_dir, refuse_symlink


@dataclass
class ResumePoint:
    """The checkpoint a run continues from, and how the config differs from the one it was saved with."""

    checkpoint: VerifiedCheckpoint
    changes: list[ConfigChange] = field(default_factory=list)


def remove_stale_temps(folder: Path, tag: str) -> None:
    """Remove the temp folders in `folder` whose writer holds no live lease on the run folder (never `tag`'s own).

    Listed before the leases are read: a writer takes its lease before its first save, so a temp folder seen
    here whose writer is alive has its token in a lease file read after. An unreadable lease file proves no
    writer dead: then nothing is removed."""
    temps = [entry for entry in folder.glob(f"{TMP_PREFIX}*") if not (tag and entry.name.endswith(f".{tag}"))]
    if not temps:
        return
    live = live_tokens(folder.parent)
    if live is None:
        return
    for stale in temps:
        if stale.name.rsplit(".", 1)[-1] in live:
            continue  # a live writer's save in progress (another replica group's)
        if stale.is_symlink() or not stale.is_dir():
            stale.unlink(missing_ok=True)  # a planted link: remove the link, never what it points at
        else:
            shutil.rmtree(stale, ignore_errors=True)  # a save interrupted by a crash


class Checkpointer:
    """Saves and finds checkpoints for one run; all ranks call setup(), then find_resume() and save() together.

    config: the resolved config (stored in every manifest, compared at resume). identity: what resume
    must agree with beyond the config (compat.run_identity); None skips those checks. tag: names this
    run's temp folders (the lease token, the same on every rank). lease_lost: rank 0 reads the lease
    before each commit; it returns who took it, or None while it is this run's.
    """

    def __init__(
        self,
        cfg: CkptConfig,
        run_dir: Path,
        ctx: DistContext,
        config: dict[str, Any],
        identity: dict[str, Any] | None = None,
        writer: CheckpointFormat | None = None,
        tag: str = "",
        lease_lost: Callable[[], str | None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.tag, self._lease_lost = tag, lease_lost
        self.dir = checkpoints_dir(run_dir)
        self.ctx = ctx
        self.config = config
        self.identity = identity or {}
        # Alone (benchmarks, tests) a Checkpointer saves full, replicated state: ckpt.format as under DDP.
        self.writer = writer or checkpoint_format(cfg.format, "ddp")
        self.policy = SavePolicy(cfg)
        self.timeline = uuid.uuid4().hex  # replaced by the resumed checkpoint's (find_resume)
        self._thread: threading.Thread | None = None
        self._pruning: threading.Thread | None = None  # rank 0: the prune behind the last commit
        self._prune_error: BaseException | None = None
        self._done: list[SaveResult] = []
        self._group: dist.ProcessGroup | None = None
        self._known_good: set[str] = set()  # folders this process committed or verified (rank 0)
        self._best: tuple[int, dict[str, Any]] | None = None  # (step, detail) to mark once committed

    def setup(self) -> None:
        """All ranks together: the checkpoint's own process group; rank 0 removes the temp folders of dead writers.

        A temp folder is a save in progress only while its writer holds a lease on the run folder (its tag is
        the lease token; checkpoint/lease.py): every other one is the leftover of a writer that released its
        lease (its saves were over) or died mid-save (a SIGKILL), or that was judged dead by the lease's rule
        (its pid gone on this host, its heartbeat stale, an earlier round of this job), which, if it is in
        fact still running, commits nothing from then on (its commit re-reads the lease) and writes only into
        its own temp folder. The live writers' (other replica groups' in the in-place mode) are left alone.
        """
        # Saves coordinate on a gloo group of their own: an async save's collectives run in a
        # background thread and must never interleave with the training loop's.
        if self.ctx.is_distributed:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.timeout_s))
        self.writer.bind(self._group)  # a format with collectives of its own runs them on this group
        if self.ctx.is_main and self.dir.is_dir() and not self.dir.is_symlink():
            remove_stale_temps(self.dir, self.tag)

    # ---- the policy the Trainer asks ------------------------------------------------------

    def due(self, step: int, final: bool = False, stop: bool = False) -> bool:
        """Whether every rank saves after `step` (ckpt.every_steps, the final step, a coordinated stop)."""
        return self.policy.due(step, final, stop)

    def mark_best(self, step: int, detail: dict[str, Any]) -> None:
        """Before save(step): once committed, rank 0 marks it the best (checkpoint/best.py) ahead of the prune."""
        self._best = (step, detail)

    # ---- saving -------------------------------------------------------------------------

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) state in the form this run's format saves: the full state, or this rank's shards."""
        return self.writer.capture(model, optimizer)

    def save(self, step: int, shared: dict[str, Any], local: dict[str, Any]) -> None:
        """Checkpoint `step`. shared: model and optimizer as capture() gives them, and the trainer state
        (identical on every rank); local: this rank's own.

        A synchronous save is committed (or failed) when this returns. An async save first waits
        for the previous one (a save never starts before the previous commit), snapshots the
        state to the CPU and returns; the write runs in a background thread. Results are read
        with finished(), which every rank calls at the same step so that all agree.
        """
        t0 = time.perf_counter()
        if not self.cfg.async_save:
            self._join_prune()  # a commit and the previous prune never overlap
            result = self._write_and_commit(step, shared, local, t0)
            result.blocked_s = result.total_s
            self._done.append(result)
            return
        self.wait()
        snapshot = self.writer.snapshot(self.ctx.rank, self.ctx.world_size, shared, local)
        blocked = time.perf_counter() - t0

        def work() -> None:
            result = self._write_and_commit(step, snapshot[0], snapshot[1], t0)
            result.blocked_s = blocked
            self._done.append(result)

        self._thread = threading.Thread(target=work, name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()

    def holds(self, step: int) -> bool:
        """Whether the folder holds a committed checkpoint of `step` (its manifest is there)."""
        return (self.dir / checkpoint_name(step) / MANIFEST).is_file()

    def wait(self) -> None:
        """Block until an in-flight async save is committed or failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._join_prune()

    def _prune_behind(self, step: int) -> None:
        """Rank 0, after the commit of `step`: prune (store.prune) in a thread of its own.

        The save is committed and durable before this starts, so a save returns without waiting for the
        unlinks of the oldest checkpoint (milliseconds per file where freed blocks are discarded; a third
        of a small save's time). wait() and the next save join it: prunes never overlap a commit or each
        other, and a run ends with its checkpoints pruned.
        """

        def work() -> None:
            try:
                prune(self.dir, self.timeline, step, self.cfg.keep, self._known_good)
            except BaseException as e:  # raised where the prune is joined, as a sync prune raised from save()
                self._prune_error = e

        self._pruning = threading.Thread(target=work, name=f"ckpt-prune-{step}")
        self._pruning.start()

    def _join_prune(self) -> None:
        if self._pruning is not None:
            self._pruning.join()
            self._pruning = None
        error, self._prune_error = self._prune_error, None
        if error is not None:
            raise error

    def finished(self) -> list[SaveResult]:
        """Results of the saves that completed since the last call, oldest first."""
        done, self._done = self._done, []
        return done

    def _agree(self, mine: tuple[str | None, dict[str, FileEntry]]) -> list[tuple[str | None, dict[str, FileEntry]]]:
        if self._group is None:
            return [mine]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, mine, group=self._group)
        return out

    def _make_tmp(self, tmp: Path) -> None:
        """The temp folder: created here, or (another rank's) a real folder; never a link."""
        refuse_symlink(self.dir.parent)
        refuse_symlink(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(tmp)
        except FileExistsError:
            if tmp.is_symlink() or not tmp.is_dir():
                raise OSError(17, "a planted file or link has the temp folder's name", str(tmp)) from None
            if self.ctx.world_size == 1:
                raise OSError(17, "the temp folder exists already (another writer?)", str(tmp)) from None

    def _write_and_commit(self, step: int, shared: dict[str, Any], local: dict[str, Any], t0: float) -> SaveResult:
        tmp = self.dir / (f"{TMP_PREFIX}{step:08d}" + (f".{self.tag}" if self.tag else ""))
        final = self.dir / checkpoint_name(step)
        error: str | None = None
        entries: dict[str, FileEntry] = {}
        try:
            self._make_tmp(tmp)
            entries = self.writer.write(tmp, self.ctx.rank, self.ctx.world_size, shared, local, self.cfg.hash)
        except Exception as e:  # any failure must reach the agreement below, or the other ranks would hang
            reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
            error = f"rank {self.ctx.rank} on {self.ctx.hostname}: {reason} while writing {tmp.name}"
        results = self._agree((error, entries))
        errors = [e for e, _ in results if e]
        committed_error: str | None = "; ".join(errors) if errors else None
        lost: str | None = None
        if self.ctx.is_main:
            lost = self._lease_lost() if self._lease_lost is not None else None
            if lost is not None:
                committed_error = f"another run took the run folder's lease ({lost})"
            elif committed_error is None:
                committed_error = self._commit(step, tmp, final, results)
            if committed_error is not None and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)  # our own temp folder (its tag is ours): debris to nobody
        committed_error, lost = self._broadcast((committed_error, lost))
        if committed_error is None and self.ctx.is_main:
            self._known_good.add(final.name)
            if self._best is not None and self._best[0] == step:
                write_best(self.dir, self.timeline, step, self._best[1])
            self._prune_behind(step)
        return SaveResult(
            step,
            committed_error is None,
            committed_error,
            0.0,
            time.perf_counter() - t0,
            final if committed_error is None else None,
            lost,
        )

    def _commit(
        self, step: int, tmp: Path, final: Path, results: list[tuple[str | None, dict[str, FileEntry]]]
    ) -> str | None:
        files: dict[str, FileEntry] = {}
        for _, entries in results:
            files.update(entries)
        manifest = Manifest(
            step,
            self.ctx.world_size,
            self.timeline,
            self.writer.name,
            time.time(),
            files,
            self.config,
            self.identity,
            self.cfg.hash,
        )
        try:
            write_durable(tmp / MANIFEST, manifest.to_bytes(), manifest.hash)
            fsync_dir(tmp)
            if final.exists() or final.is_symlink():  # never replaced silently: kept in the archive
                archive(self.dir, [final], f"replaced-step-{step}")
            os.rename(tmp, final)
            fsync_dir(self.dir)
        except (OSError, ManifestError) as e:  # every rank waits for this answer: an error string, never a raise
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            return f"rank 0 on {self.ctx.hostname}: {reason} while committing {final.name}"
        return None

    def _broadcast(self, value: tuple[str | None, str | None]) -> tuple[str | None, str | None]:
        if self._group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    # ---- resuming -----------------------------------------------------------------------

    def find_resume(self, warn: Callable[[str], None]) -> ResumePoint | None:
        """The checkpoint to resume from by ckpt.resume, verified and config-checked; None to start fresh.

        Rank 0 decides and every rank receives its decision, so all ranks load the same one. Several
        ranks verify it together (shared_load.py: each node reads about 1/N of it, by ckpt.load) and then
        receive the rest from the ranks that verified it; one process verifies every file itself.
        """
        if not self.ctx.is_distributed:
            found = self._choose(warn)
            if found is not None:
                self.policy.newest_committed = found.checkpoint.step
            return found
        loader = SharedLoad(self.ctx.rank, self.ctx.world_size, self._group, self._nodes())
        candidates: list[Path] = []
        existing: list[Path] = []
        error: str | None = None
        if self.ctx.is_main:
            try:
                candidates, existing = self._candidates(warn)
            except CheckpointError as e:
                error = str(e)  # every rank learns it with the decision below
        ckpt, failure = loader.search(candidates, warn, named=self.cfg.resume not in ("auto", "never"))
        decision: tuple[Any, ...] = (None, None, [], self.timeline, None)
        if self.ctx.is_main:
            decision = self._decide(ckpt, error or failure, candidates, existing, warn)
        box = [decision]
        dist.broadcast_object_list(box, src=0, group=self._group)
        path, manifest, changes, self.timeline, error = box[0]
        if error:
            raise CheckpointError(error)
        if path is None or ckpt is None:
            return None
        self.policy.newest_committed = manifest.step
        return ResumePoint(loader.exchange(ckpt), changes)

    def _nodes(self) -> tuple[int, ...]:
        """Each rank's node for the shared load, by ckpt.load: auto groups the ranks by host (the ranks of
        one host share its page cache), every-rank puts them all on one, shared gives each its own."""
        world = self.ctx.world_size
        if self.cfg.load == "every-rank":
            return (0,) * world
        if self.cfg.load == "auto" and len(self.ctx.hosts) == world:
            return nodes_of(self.ctx.hosts)
        return tuple(range(world))

    def _decide(
        self,
        ckpt: VerifiedCheckpoint | None,
        error: str | None,
        candidates: list[Path],
        existing: list[Path],
        warn: Callable[[str], None],
    ) -> tuple[Any, ...]:
        """Rank 0, after the ranks verified a checkpoint together: (path, manifest, changes, timeline, error)."""
        if error is None and ckpt is None and candidates:
            error = str(self._none_verified(existing))
        if error is None and ckpt is not None:
            try:
                found = self._settle(ckpt, existing, warn)
                return (str(ckpt.path), ckpt.manifest, found.changes, self.timeline, None)
            except CheckpointError as e:
                error = str(e)
        return (None, None, [], self.timeline, error)

    def read(self, ckpt: VerifiedCheckpoint) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(shared, local) state of this rank from a verified checkpoint; local None at a new world size."""
        state = ckpt.writer.read(ckpt, self.ctx.rank, self.ctx.world_size)
        ckpt.release()  # the state now owns the tensors: a second read reads (and verifies) the files again
        return state

    def restore(
        self, ckpt: VerifiedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """All ranks: load a verified checkpoint, whatever its format; read()'s (shared, local) state.

        The checkpoint's format first loads into model and optimizer, in place, what it keeps sharded
        (resharded for this run's world size and strategy, from verified bytes only); shared holds the
        rest (for a full-state format, model and optimizer too).
        """
        fmt = ckpt.writer
        fmt.bind(self._group)
        fmt.restore(ckpt, model, optimizer)
        return self.read(ckpt)

    def _inside_own_folder(self, path: Path) -> bool:
        return path.parent.resolve() == self.dir.resolve()

    def _candidates(self, warn: Callable[[str], None]) -> tuple[list[Path], list[Path]]:
        """Rank 0: (the folders to try, newest first; the committed checkpoints); none to try: a fresh start."""
        if self.dir.is_symlink():
            raise CheckpointError(
                f"{self.dir} is a symbolic link; ddptrain never writes through links inside run.dir: "
                "make it a real folder (or point run.dir itself elsewhere)"
            )
        if os.path.lexists(self.dir) and not self.dir.is_dir():  # before training, not at the first save
            raise CheckpointError(
                f"{self.dir} is not a folder (a file, FIFO or socket has its name): move it away so that "
                "checkpoints can be saved there"
            )
        existing = committed_checkpoints(self.dir)
        if self.cfg.resume == "never":
            self._clear_for_fresh_start(existing, warn)
            return [], existing
        if self.cfg.resume == "auto":
            return existing, existing
        explicit = Path(self.cfg.resume)
        if explicit.is_symlink() or not explicit.is_dir():
            raise CheckpointError(f"ckpt.resume={self.cfg.resume!r}: no such checkpoint folder")
        return [explicit], existing

    def _none_verified(self, existing: list[Path]) -> CheckpointError:
        return CheckpointError(
            f"all {len(existing)} checkpoint(s) in {self.dir} failed verification; refusing to start over "
            "silently. Move them away, or start fresh with ckpt.resume=never ckpt.existing=archive"
        )

    def _choose(self, warn: Callable[[str], None]) -> ResumePoint | None:
        """One process: verify every file of the candidates itself, newest first."""
        candidates, existing = self._candidates(warn)
        if not candidates:
            return None
        if self.cfg.resume == "auto":
            ckpt = search(candidates, warn)
            if ckpt is None:
                raise self._none_verified(existing)
        else:
            ckpt = verify_checkpoint(candidates[0])
        return self._settle(ckpt, existing, warn)

    def _settle(self, ckpt: VerifiedCheckpoint, existing: list[Path], warn: Callable[[str], None]) -> ResumePoint:
        """Rank 0, the checkpoint chosen: check the config against it; archive what is newer; take its timeline."""
        changes = check_resume(ckpt.path.name, ckpt.manifest.config, ckpt.manifest.identity, self.config, self.identity)
        if not self._inside_own_folder(ckpt.path):
            self._clear_for_fresh_start(existing, warn)  # another folder's checkpoint starts a new timeline here
            return ResumePoint(ckpt, changes)
        newer = [p for p in existing if (step_of(p.name) or 0) > ckpt.step]
        if newer:
            moved = archive(self.dir, newer, f"after-step-{ckpt.step}")
            warn(
                f"warning: resuming from step {ckpt.step}: {len(newer)} newer checkpoint folder(s) "
                f"({', '.join(p.name for p in newer[:3])}) moved to {moved} so the run never returns to them"
            )
        self.timeline = ckpt.manifest.timeline
        self._known_good.add(ckpt.path.name)  # every byte verified (by this process, or by the ranks together)
        return ResumePoint(ckpt, changes)

    def _clear_for_fresh_start(self, existing: list[Path], warn: Callable[[str], None]) -> None:
        """A fresh timeline in a folder holding checkpoints: refused, unless ckpt.existing=archive."""
        if not existing:
            return
        if self.cfg.existing != "archive":
            raise CheckpointError(
                f"ckpt.resume={self.cfg.resume} but {self.dir} already holds {len(existing)} checkpoint(s) "
                f"(newest {existing[0].name}), which a fresh run would mix with its own; train into a new folder "
                "(run.name=NEW_NAME), or add ckpt.existing=archive to move them to checkpoints/archive/ first"
            )
        moved = archive(self.dir, existing, "before-fresh-start")
        warn(f"warning: {len(existing)} existing checkpoint(s) moved to {moved} (ckpt.existing=archive)")
