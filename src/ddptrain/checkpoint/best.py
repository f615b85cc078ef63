"""The best checkpoint of an early-stopped run: checkpoints/best.json marks it, and pruning keeps it.

Rank 0 writes the marker right after committing a checkpoint the Trainer saved at a new best
evaluation (train.early_stop), before that commit's prune: {"step", "timeline", "metric", "value"}.
store.prune never deletes the marked step of its own timeline, whatever ckpt.keep says; a marker
of another timeline (an earlier run in the folder) protects nothing. `ddptrain eval RUN --step N`
and `ddptrain export --step N` read the best one by its step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ddptrain.checkpoint.manifest import checkpoint_name
from ddptrain.safe_files import read_bytes_no_follow, write_text_replace

BEST = "best.json"
_LIMIT = 64 * 1024  # a marker is a few hundred bytes: anything larger is not ours
log = logging.getLogger(__name__)


def write_best(ckpt_dir: Path, timeline: str, step: int, detail: dict[str, Any]) -> None:
    """Rank 0: mark `step` (committed) as the best checkpoint of `timeline` (replacing the file, never a link)."""
    try:
        write_text_replace(ckpt_dir / BEST, json.dumps({"step": step, "timeline": timeline, **detail}) + "\n")
    except OSError as e:  # the checkpoint is committed: only its protection from pruning is lost
        log.warning("cannot mark %s as the best checkpoint: %s", checkpoint_name(step), e.strerror or e)


def best_step(ckpt_dir: Path, timeline: str) -> int | None:
    """The step best.json marks for `timeline`; None when there is no readable marker of that timeline."""
    try:
        marker = json.loads(read_bytes_no_follow(ckpt_dir / BEST, _LIMIT))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("timeline") != timeline:
        return None
    step = marker.get("step")
    return step if isinstance(step, int) else None
