"""Transactional checkpoints: a folder is either fully committed and verified, or never loaded.

Layout of one checkpoint, `run.dir/checkpoints/step-00000100/`:

    model.pt  optimizer.pt  trainer.pt     written by rank 0 (DDP keeps them identical on all ranks)
    rng-rank0.pt ... rng-rank{W-1}.pt      written by each rank (its own RNG streams)
    manifest.json                          SHA-256 and size of every file, step, world size, config

The protocol: every rank writes its files under `.tmp-step-00000100/` and fsyncs them; the ranks
agree (one all-gather) whether every write succeeded; only then rank 0 writes the manifest,
fsyncs the folder, renames it to `step-00000100` (atomic on POSIX) and fsyncs the parent. A crash
at any point leaves either the old set of committed checkpoints or the new one. Old checkpoints
are pruned only after a newer commit. On load the manifest is verified file by file; a bad
checkpoint is skipped with a warning naming the file, and the next older one is tried.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
import torch.distributed as dist

from ddptrain.config import CkptConfig
from ddptrain.dist import DistContext
from ddptrain.errors import CheckpointError

MANIFEST = "manifest.json"
_PREFIX = "step-"
_TMP_PREFIX = ".tmp-step-"


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after `step` optimizer steps."""
    return f"{_PREFIX}{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A file wrapper that hashes what passes through: torch.save streams into the file and the
    SHA-256 comes for free, with no second in-memory copy of the state and no re-read."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            self.f.write(data)
        except OSError as e:
            self.error = e  # torch's zip writer reports only "unexpected pos": keep the real cause
            raise
        self.sha256.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def _write_durable(path: Path, obj: Any) -> dict[str, Any]:
    """Write obj (bytes as they are, anything else through torch.save), fsync, return its manifest entry."""
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        if isinstance(obj, bytes):
            writer.write(obj)
        else:
            try:
                torch.save(obj, writer)  # type: ignore[arg-type]
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": writer.sha256.hexdigest(), "size": writer.size}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def committed_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Committed checkpoint folders, newest first (temporary folders are never listed)."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit():
            found.append(p)
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]), reverse=True)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint whose every file matches it; CheckpointError naming what does not."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path.name}: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path.name}: {MANIFEST} is unreadable ({e})") from None
    for name, entry in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path.name}: file {name} is missing")
        size = f.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{path.name}: file {name} has {size} bytes, the manifest says {entry['size']} (truncated?)")
        if _sha256_file(f) != entry["sha256"]:
            raise CheckpointError(f"{path.name}: file {name} does not match its SHA-256 in the manifest (corrupted)")
    return manifest


def newest_verified(ckpt_dir: Path, warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    """The newest committed checkpoint that passes verification; rejected ones are passed to warn."""
    candidates = committed_checkpoints(ckpt_dir)
    if not candidates:
        raise CheckpointError(f"no committed checkpoint in {ckpt_dir}")
    for path in candidates:
        try:
            return path, verify_checkpoint(path)
        except CheckpointError as e:
            warn(f"warning: checkpoint rejected: {e}")
    raise CheckpointError(f"every checkpoint in {ckpt_dir} failed verification")


def load_file(path: Path, name: str) -> Any:
    """One file of a verified checkpoint, onto the CPU."""
    return torch.load(path / name, map_location="cpu", weights_only=True)


def _to_cpu(obj: Any) -> Any:
    """A deep copy with every tensor on the CPU: the snapshot an async save writes from."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


@dataclass
class SaveResult:
    """How a save went, as all ranks agreed."""

    step: int
    ok: bool
    error: str | None
    blocked_s: float  # time the training loop waited
    total_s: float  # time until committed (or failed)
    path: Path | None


class Checkpointer:
    """Saves and finds checkpoints for one run; all ranks call save() together."""

    def __init__(self, cfg: CkptConfig, run_dir: Path, ctx: DistContext, config: dict[str, Any]) -> None:
        self.cfg = cfg
        self.dir = run_dir / "checkpoints"
        self.ctx = ctx
        self.config = config
        self._thread: threading.Thread | None = None
        self._done: list[SaveResult] = []
        # Saves coordinate on a gloo group of their own: an async save's collectives run in a
        # background thread and must never interleave with the training loop's.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s)) if ctx.is_distributed else None
        if ctx.is_main and self.dir.is_dir():
            for stale in self.dir.glob(f"{_TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)  # a save interrupted by a crash

    # ---- saving -------------------------------------------------------------------------

    def save(self, step: int, shared: dict[str, Any], local: dict[str, Any]) -> None:
        """Checkpoint `step`. shared: rank-0 objects (one file each); local: this rank's objects.

        A synchronous save is committed (or failed) when this returns. An async save first waits
        for the previous one (a save never starts before the previous commit), snapshots the
        state to the CPU and returns; the write runs in a background thread. Results are read
        with finished(), which every rank calls at the same step so that all agree.
        """
        t0 = time.perf_counter()
        if not self.cfg.async_save:
            result = self._write_and_commit(step, shared, local, t0)
            result.blocked_s = result.total_s
            self._done.append(result)
            return
        self.wait()
        snapshot = (_to_cpu(shared) if self.ctx.is_main else {}, _to_cpu(local))
        blocked = time.perf_counter() - t0

        def work() -> None:
            result = self._write_and_commit(step, snapshot[0], snapshot[1], t0)
            result.blocked_s = blocked
            self._done.append(result)

        self._thread = threading.Thread(target=work, name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until an in-flight async save is committed or failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finished(self) -> list[SaveResult]:
        """Results of the saves that completed since the last call, oldest first."""
        done, self._done = self._done, []
        return done

    def _agree(self, mine: tuple[str | None, dict[str, Any]]) -> list[tuple[str | None, dict[str, Any]]]:
        if self._group is None:
            return [mine]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, mine, group=self._group)
        return out

    def _write_and_commit(self, step: int, shared: dict[str, Any], local: dict[str, Any], t0: float) -> SaveResult:
        tmp = self.dir / f"{_TMP_PREFIX}{step:08d}"
        final = self.dir / checkpoint_name(step)
        error: str | None = None
        entries: dict[str, Any] = {}
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            items = {f"{k}.pt": v for k, v in shared.items()} | {f"{k}-rank{self.ctx.rank}.pt": v for k, v in local.items()}
            # One thread per file: while one thread serializes (holding the GIL), another's
            # SHA-256 and fsync run without it, so the files' costs overlap.
            with ThreadPoolExecutor(max_workers=len(items)) as pool:
                futures = {name: pool.submit(_write_durable, tmp / name, obj) for name, obj in items.items()}
                entries = {name: f.result() for name, f in futures.items()}
        except Exception as e:  # any failure must reach the agreement below, or the other ranks would hang
            reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
            error = f"rank {self.ctx.rank} on {self.ctx.hostname}: {reason} while writing {tmp.name}"
        results = self._agree((error, entries))
        errors = [e for e, _ in results if e]
        committed_error: str | None = "; ".join(errors) if errors else None
        if self.ctx.is_main:
            if committed_error is None:
                committed_error = self._commit(step, tmp, final, results)
            if committed_error is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        committed_error = self._broadcast(committed_error)
        if committed_error is None and self.ctx.is_main:
            self._prune()
        return SaveResult(step, committed_error is None, committed_error, 0.0, time.perf_counter() - t0,
                          final if committed_error is None else None)

    def _commit(self, step: int, tmp: Path, final: Path, results: list[tuple[str | None, dict[str, Any]]]) -> str | None:
        files: dict[str, Any] = {}
        for _, entries in results:
            files.update(entries)
        manifest = {
            "format": 1,
            "step": step,
            "world_size": self.ctx.world_size,
            "created": time.time(),
            "files": files,
            "config": self.config,
        }
        try:
            _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again (e.g. after a restart): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.dir)
        except OSError as e:
            return f"rank 0 on {self.ctx.hostname}: {e.strerror or e} while committing {final.name}"
        return None

    def _broadcast(self, value: str | None) -> str | None:
        if self._group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _prune(self) -> None:
        for old in committed_checkpoints(self.dir)[self.cfg.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- finding what to resume from ----------------------------------------------------

    def find_resume(self, warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint to resume from by ckpt.resume, verified; None to start fresh.

        Rank 0 verifies and every rank receives its decision, so all ranks load the same one.
        """
        decision: tuple[str | None, dict[str, Any] | None, str | None] = (None, None, None)
        if self.ctx.is_main:
            try:
                found = self._choose(warn)
                decision = (str(found[0]), found[1], None) if found else (None, None, None)
            except CheckpointError as e:
                decision = (None, None, str(e))
        if self.ctx.is_distributed:
            box = [decision]
            dist.broadcast_object_list(box, src=0)
            decision = box[0]
        path, manifest, error = decision
        if error:
            raise CheckpointError(error)
        return (Path(path), manifest) if path and manifest is not None else None

    def _choose(self, warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
        if self.cfg.resume == "never":
            return None
        if self.cfg.resume != "auto":
            path = Path(self.cfg.resume)
            if not path.is_dir():
                raise CheckpointError(f"ckpt.resume={self.cfg.resume!r}: no such checkpoint folder")
            return path, verify_checkpoint(path)
        candidates = committed_checkpoints(self.dir)
        for path in candidates:
            try:
                return path, verify_checkpoint(path)
            except CheckpointError as e:
                warn(f"warning: checkpoint rejected: {e}; trying an older one")
        if candidates:
            raise CheckpointError(
                f"all {len(candidates)} checkpoint(s) in {self.dir} failed verification; refusing to start over "
                "silently. Move them away or set ckpt.resume=never to start fresh"
            )
        return None
