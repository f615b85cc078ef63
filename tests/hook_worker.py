"""Train through the Python API with a hook, alone or as one rank under torchrun (argv: RUN_DIR OUT_DIR STOP_AT).

The hook records what it is shown and whether its records are read-only; on the last rank only, it asks
to stop at its first logged step from STOP_AT on. Rank r writes OUT_DIR/hook-rank<r>.json: the RunResult
and what the hook saw.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ddptrain


class Watcher(ddptrain.TrainingHook):
    """Watches every kind of record; the asking rank returns a reason to stop."""

    def __init__(self, asks: bool, stop_at: int) -> None:
        self.asks, self.stop_at = asks, stop_at
        self.seen: dict[str, list[int]] = {"log": [], "eval": [], "checkpoint": []}
        self.log_keys: list[str] = []
        self.read_only = True

    def on_log(self, record: Mapping[str, Any]) -> str | None:
        self.seen["log"].append(record["step"])
        self.log_keys = sorted(record)
        try:
            record["loss"] = 0.0  # type: ignore[index]
            self.read_only = False
        except TypeError:
            pass
        if self.asks and record["step"] >= self.stop_at:
            return f"loss {record['loss']:.3f} is low enough"
        return None

    def on_eval(self, record: Mapping[str, Any]) -> None:
        self.seen["eval"].append(record["step"])

    def on_checkpoint(self, record: Mapping[str, Any]) -> None:
        self.seen["checkpoint"].append(record["step"])


def main(run_dir: str, out: str, stop_at: str) -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    watcher = Watcher(asks=rank == world - 1, stop_at=int(stop_at))
    config = {
        "run": {"dir": run_dir},
        "model": {"target": "metrics_toy:plateau_model"},
        "data": {"target": "varlen_toy:bare_datasets", "micro_batch_size": 2},
        "train": {"global_batch_size": 4, "max_steps": 30, "warmup_steps": 0, "eval_every": 2, "eval_batches": 1},
        "log": {"every_steps": 1},
        "ckpt": {"every_steps": 100},
    }
    result = ddptrain.train(config, hooks=[watcher])
    summary = {"status": result.status, "step": result.step, **watcher.seen}
    summary |= {"read_only": watcher.read_only, "log_keys": watcher.log_keys}
    (Path(out) / f"hook-rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(*sys.argv[1:])
