"""Run under torchrun (2 ranks): how much of the parameters and AdamW state each rank holds, DDP vs FSDP.

Builds a DDP run and an FSDP run of the same model through build_run, trains one step in each (so
the optimizer state exists), and writes OUT/rank-r.json: per strategy, the numel this rank holds of
the parameters and of the optimizer state, the full (global) sizes, and the numel this rank holds
of the model state the checkpoint writer receives (under FSDP its shards: the dcp writer).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from helpers import TINY

from ddptrain.config import load_config
from ddptrain.dist import DistContext
from ddptrain.run import build_run, distributed


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank stores: a DTensor's local shard, else the whole tensor."""
    to_local = getattr(t, "to_local", None)
    return int(to_local().numel()) if callable(to_local) else t.numel()


def measure(common: list[str], strategy: str, out: Path, ctx: DistContext) -> dict[str, Any]:
    cfg = load_config(None, [*common, f"dist.strategy={strategy}", f"run.dir={out / strategy}"])
    run = build_run(cfg, ctx)
    try:
        trainer = run.trainer
        trainer.train_step()
        params = list(trainer.model.parameters())
        states = [v for p in params for v in trainer.optimizer.state[p].values() if v.dim() > 0]
        saved = trainer.state_dict()
        return {
            "param_local": sum(local_numel(p) for p in params),
            "param_full": sum(p.numel() for p in params),
            "optim_local": sum(local_numel(v) for v in states),
            "optim_full": sum(v.numel() for v in states),
            "state_dict_local": sum(local_numel(v) for v in saved["model"].values()),
        }
    finally:
        run.close()


def main() -> None:
    corpus, out = Path(sys.argv[1]), Path(sys.argv[2])
    common = [*TINY, "model.n_layer=2", "model.n_embd=64", f"data.dir={corpus}"]  # later overrides win
    with distributed(load_config(None, common)) as ctx:
        result = {s: measure(common, s, out, ctx) for s in ("ddp", "fsdp")}
    (out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
