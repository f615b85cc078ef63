"""One training variant of a benchmark session, in its own process(es), taking rounds from a baton.

    python -m bench.train_worker KIND --baton DIR --name NAME --steps S [--model default|tiny] ...

KIND is ddptrain (the Trainer's own fit loop), raw (bench/raw_loop.py), lightning or accelerate
(bench/peers.py). Every kind trains the same model on the same data with the same batch and seed,
S optimizer steps per round, and reports the round's wall time and rank 0's per-step losses.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.build import DEFAULT_MODEL, TINY_MODEL, bench_config, build_trainer
from bench.common import Baton
from ddptrain.config import Config
from ddptrain.dist import close_distributed, init_distributed
from ddptrain.train.trainer import StepResult, Trainer

MODELS = {"default": DEFAULT_MODEL, "tiny": TINY_MODEL}


class BenchTrainer(Trainer):
    """The Trainer with per-step losses kept (for the equality check) and no checkpoints written."""

    losses: list[torch.Tensor]

    def train_step(self) -> StepResult:
        result = super().train_step()
        self.losses.append(result.loss)
        return result

    def save_checkpoint(self) -> None:
        """The raw loop saves nothing either; checkpoint cost has a figure of its own."""

    def finish_saves(self) -> None:
        """Nothing was saved, so there is no final state to wait for or to require."""


def ddptrain_worker(cfg: Config, baton: Baton, steps: int) -> None:
    """ddptrain's Trainer.fit(), S more steps per round."""
    ctx = init_distributed(cfg.dist)
    trainer = build_trainer(cfg, ctx, BenchTrainer)
    assert isinstance(trainer, BenchTrainer)
    trainer.losses = []
    sync = (lambda: dist.barrier(group=ctx.group)) if ctx.is_distributed else (lambda: None)

    def run_round() -> None:
        trainer.cfg.train.max_steps = trainer.step + steps
        trainer.fit()

    baton.serve_rounds(run_round, sync, steps, cfg.train.global_batch_size, lambda: _drain(trainer.losses))
    trainer.metrics.close()
    close_distributed(ctx)


def raw_worker(cfg: Config, baton: Baton, steps: int) -> None:
    """The hand-written loop, S steps per round."""
    from bench.raw_loop import RawLoop

    dist.init_process_group("gloo")
    loop = RawLoop(cfg)

    def run_round() -> None:
        for _ in range(steps):
            loop.train_step()

    baton.serve_rounds(run_round, dist.barrier, steps, cfg.train.global_batch_size, lambda: _drain(loop.losses))
    dist.destroy_process_group()


def _drain(losses: list[torch.Tensor]) -> list[float]:
    out = [float(x) for x in losses]
    losses.clear()
    return out


def main() -> None:
    """Parse the variant's arguments and serve its rounds."""
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["ddptrain", "raw", "lightning", "accelerate"])
    p.add_argument("--baton", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--total-steps", type=int, required=True, help="all rounds' steps: the LR warm-up length")
    p.add_argument("--model", choices=sorted(MODELS), default="default")
    p.add_argument("--data", required=True)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # A warm-up as long as the whole run keeps the LR independent of max_steps, which fit() is
    # given round by round: every variant then sees the same LR at every step.
    extra = [f"train.warmup_steps={args.total_steps}", f"train.max_steps={args.total_steps}"]
    cfg = bench_config(MODELS[args.model], Path(args.data), Path(args.run_dir), extra)
    rank = int(os.environ.get("RANK", "0"))
    baton = Baton(args.baton, args.name, rank)
    workers: dict[str, Callable[[Config, Baton, int], Any]] = {"ddptrain": ddptrain_worker, "raw": raw_worker}
    if args.kind in ("lightning", "accelerate"):
        from bench import peers

        workers = {"lightning": peers.lightning_worker, "accelerate": peers.accelerate_worker}
    workers[args.kind](cfg, baton, args.steps)


if __name__ == "__main__":
    main()
