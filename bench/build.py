"""Build ddptrain's Trainer for a benchmark exactly as `ddptrain train` does (ddptrain.run.build_run)."""

from __future__ import annotations

from pathlib import Path

from ddptrain.config import Config, load_config
from ddptrain.dist import DistContext
from ddptrain.run import build_run
from ddptrain.train.trainer import Trainer

# The default model (4 x 128 GPT, 128-token context, 32 samples a step): compute-heavy here.
DEFAULT_MODEL: list[str] = []
# A model whose step takes milliseconds: what is left is the training loop's own cost.
TINY_MODEL = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.micro_batch_size=4",
    "train.global_batch_size=8",
]
SMOKE_MODEL = TINY_MODEL
# About 100 MB of model + AdamW state (9M parameters x 3 x 4 bytes).
LARGE_MODEL = ["model.n_layer=6", "model.n_head=4", "model.n_embd=352"]
# Benchmarks time steps only: no evaluation, no periodic checkpoints.
QUIET = ["train.eval_every=0", "ckpt.every_steps=0", "ckpt.resume=never"]


def bench_config(model: list[str], data_dir: Path, run_dir: Path, extra: list[str] = ()) -> Config:  # type: ignore[assignment]
    """A validated config for a benchmark run of `model` on the corpus in data_dir."""
    return load_config(None, [*QUIET, *model, f"data.dir={data_dir}", f"run.dir={run_dir}", *extra])


def build_trainer(cfg: Config, ctx: DistContext, cls: type[Trainer] = Trainer) -> Trainer:
    """The Trainer exactly as `ddptrain train` builds it (ddptrain.run.build_run), of class cls.

    The run folder's lease is released at once: a benchmark builds several trainers on one scratch
    folder, one after another, in one process.
    """
    run = build_run(cfg, ctx, trainer_cls=cls)
    if run.lease is not None:
        run.lease.release()
    return run.trainer
