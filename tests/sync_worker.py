"""Train a tiny run (alone, or as one rank under torchrun) and record its host syncs step by step.

    python sync_worker.py OUT_DIR override...

Every call host_syncs.HostSyncRecorder sees during `Run.fit()` is tagged with the step it belongs
to (from the start of train_step(k) until train_step(k+1) starts: the step, its logging, its
checkpoint). Rank r writes OUT_DIR/syncs-rank<r>.json: {"calls": [[step, kind, where, host_side], ...]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from host_syncs import HostSyncRecorder

from ddptrain.config import load_config
from ddptrain.run import build_run, distributed
from ddptrain.train.trainer import StepResult, Trainer

recorder = HostSyncRecorder()


class TaggingTrainer(Trainer):
    """Tags the recorder with the step being trained."""

    def train_step(self) -> StepResult:
        recorder.tag = self.step + 1
        return super().train_step()


def main() -> None:
    """Build the run from the overrides, fit it under the recorder, write the calls."""
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    cfg = load_config(None, overrides)
    with distributed(cfg) as ctx:
        run = build_run(cfg, ctx, trainer_cls=TaggingTrainer)
        try:
            with recorder:
                run.fit()
        finally:
            run.close()
        calls = [[c.tag, c.kind, c.where, c.host_side] for c in recorder.calls]
        (out / f"syncs-rank{ctx.rank}.json").write_text(json.dumps({"calls": calls}))


if __name__ == "__main__":
    main()
