"""The checkpoints folder: listing, the one resume search, archiving and pruning.

Rules (docs/checkpoints.md):
- Only real folders named `step-<digits>` directly in checkpoints/ are candidates; temp folders,
  links and anything else are never listed.
- The search goes newest first and returns the first checkpoint that verifies; each rejected
  one is reported as a warning.
- Nothing is deleted but by prune(), and prune() removes only fully verified checkpoints of the
  current timeline, older than the newest committed one of that timeline, and never the one
  checkpoints/best.json marks for that timeline (checkpoint/best.py: early stopping's best).
  Everything else that must leave the top level (an abandoned branch, a rejected folder newer
  than the resume point, an earlier run's checkpoints) is moved into checkpoints/archive/.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ddptrain.checkpoint.best import best_step
from ddptrain.checkpoint.manifest import checkpoint_name, step_of
from ddptrain.checkpoint.verify import VerifiedCheckpoint, read_manifest, verify_checkpoint
from ddptrain.errors import CheckpointError
from ddptrain.run_folder import checkpoints_dir
from ddptrain.safe_files import fsync_dir

ARCHIVE = "archive"


def committed_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Committed checkpoint folders directly in ckpt_dir, newest first (links and temp folders never listed)."""
    if ckpt_dir.is_symlink() or not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if step_of(p.name) is not None and not p.is_symlink() and p.is_dir()]
    return sorted(found, key=lambda p: step_of(p.name) or 0, reverse=True)


def search(candidates: Iterable[Path], warn: Callable[[str], None]) -> VerifiedCheckpoint | None:
    """The first candidate that verifies (newest first); every rejected one goes to warn. The one resume search."""
    for path in candidates:
        try:
            return verify_checkpoint(path)
        except CheckpointError as e:
            warn(f"warning: checkpoint rejected: {e}; trying an older one")
    return None


def newest_verified(ckpt_dir: Path, warn: Callable[[str], None]) -> VerifiedCheckpoint:
    """The newest committed checkpoint that verifies; CheckpointError when there is none."""
    candidates = committed_checkpoints(ckpt_dir)
    if not candidates:
        raise CheckpointError(f"no committed checkpoint in {ckpt_dir}")
    found = search(candidates, warn)
    if found is None:
        raise CheckpointError(f"every checkpoint in {ckpt_dir} failed verification")
    return found


def select_checkpoint(run_dir: Path, step: int | None, warn: Callable[[str], None]) -> VerifiedCheckpoint:
    """A run's verified checkpoint of `step`, or its newest verified one when step is None."""
    ckpt_dir = checkpoints_dir(run_dir)
    if step is None:
        return newest_verified(ckpt_dir, warn)
    path = ckpt_dir / checkpoint_name(step)
    if not path.is_dir() or path.is_symlink():
        steps = sorted(step_of(p.name) or 0 for p in committed_checkpoints(ckpt_dir))
        there = f"the steps there: {_listed(steps)}" if steps else "it holds no committed checkpoint"
        raise CheckpointError(f"no checkpoint for step {step} in {ckpt_dir}; {there}")
    return verify_checkpoint(path)


def _listed(steps: list[int], shown: int = 10) -> str:
    """The steps, the first and last few when there are many (`2, 4, ... (+30 more) ..., 96, 98`)."""
    if len(steps) <= shown:
        return ", ".join(map(str, steps))
    head, tail = steps[: shown // 2], steps[-(shown // 2) :]
    return f"{', '.join(map(str, head))}, ... ({len(steps) - len(head) - len(tail)} more), {', '.join(map(str, tail))}"


def archive(ckpt_dir: Path, folders: list[Path], reason: str) -> Path | None:
    """Move folders into checkpoints/archive/<reason>-<time>/ (never deleted); the archive folder, if any."""
    if not folders:
        return None
    dest = ckpt_dir / ARCHIVE / f"{reason}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    dest.mkdir(parents=True)
    for folder in folders:
        os.rename(folder, dest / folder.name)
    fsync_dir(dest)
    fsync_dir(ckpt_dir)
    return dest


def prune(ckpt_dir: Path, timeline: str, newest_step: int, keep: int, known_good: set[str]) -> list[Path]:
    """Delete verified checkpoints of `timeline` beyond the newest `keep`, never newest_step's nor the marked
    best one (checkpoint/best.py); the deleted.

    known_good: folder names this process wrote or fully verified itself; any other folder is
    verified (every byte) before it is deleted. A folder that does not verify, or belongs to
    another timeline, is never deleted.
    """
    ours: list[Path] = []
    for path in committed_checkpoints(ckpt_dir):
        step = step_of(path.name)
        if step is None or step > newest_step:
            continue
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        if manifest.timeline == timeline and manifest.step == step:
            ours.append(path)
    if not ours or step_of(ours[0].name) != newest_step:
        return []  # the newest commit is not where it should be: delete nothing
    doomed = []
    best = best_step(ckpt_dir, timeline)
    for path in ours[max(keep, 1) :]:
        if step_of(path.name) == best:
            continue
        if path.name not in known_good:
            try:
                verify_checkpoint(path, keep=False)
            except CheckpointError:
                continue  # not verifiable: not ours to judge, left in place (resume skips it)
        shutil.rmtree(path, ignore_errors=True)
        known_good.discard(path.name)
        doomed.append(path)
    return doomed
