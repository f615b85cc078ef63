"""Profiles behind docs/benchmarks.md: where the time of a step or a save goes.

    torchrun --standalone --nproc-per-node 2 -m bench.profiling step [--model tiny] [--raw]
    python -m bench.profiling step --threads 2         # one process, two threads
    python -m bench.profiling save [--model large]     # cProfile: sync save, torch.save, async save

`step` runs torch.profiler over a few steps of ddptrain's Trainer (or, with --raw, the hand-written
loop) after warm-up and prints rank 0's operators by self CPU time; `save` prints cProfile's top
functions by own time for a Checkpointer sync save, torch.save + fsync of the same state, and the
part of an async save that blocks the training loop.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from bench.build import DEFAULT_MODEL, LARGE_MODEL, TINY_MODEL, bench_config, build_trainer
from bench.common import REPO
from ddptrain.checkpoint import Checkpointer
from ddptrain.dist import DistContext, init_distributed

MODELS = {"default": DEFAULT_MODEL, "tiny": TINY_MODEL, "large": LARGE_MODEL}


def profile_steps(model: str, raw: bool, steps: int, rows: int) -> None:
    """torch.profiler over `steps` steps after 3 warm-up steps; rank 0 prints the table."""
    run_dir = REPO / "runs" / "bench" / "profile"
    cfg = bench_config(MODELS[model], REPO / "data" / "stdlib", run_dir)
    if raw:
        from bench.raw_loop import RawLoop

        dist.init_process_group("gloo")
        step = RawLoop(cfg).train_step
        rank = dist.get_rank()
    else:
        ctx = init_distributed(cfg.dist)
        trainer = build_trainer(cfg, ctx)
        step, rank = trainer.train_step, ctx.rank
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    if dist.is_initialized():
        dist.destroy_process_group()


def profile_save(model: str, rows: int) -> None:
    """cProfile of one Checkpointer sync save and one torch.save + fsync of the same state."""
    from ddptrain.train.rng import rng_state

    run_dir = REPO / "runs" / "bench" / "profile-save"
    shutil.rmtree(run_dir, ignore_errors=True)  # keep= must not prune this run's saves for an older run's
    cfg = bench_config(MODELS[model], REPO / "data" / "stdlib", run_dir)
    trainer = build_trainer(cfg, DistContext())
    trainer.train_step()

    def torch_save() -> None:
        with open(run_dir / "torch-save.pt", "wb") as f:
            torch.save({"state": trainer.state_dict(), "rng": rng_state()}, f)
            f.flush()
            os.fsync(f.fileno())

    async_ckpt = Checkpointer(
        cfg.ckpt.model_copy(update={"async_save": True}),
        run_dir / "async",
        DistContext(),
        cfg.model_dump(mode="json", by_alias=True),
    )

    def async_blocked() -> None:  # only the part the training loop waits for
        trainer.step += 1
        async_ckpt.save(trainer.step, trainer.state_dict(), {"rng": rng_state()})

    for name, fn in (
        ("Checkpointer sync save", trainer.save_checkpoint),
        ("torch.save + fsync", torch_save),
        ("Checkpointer async save, blocked part", async_blocked),
    ):
        fn()  # warm-up (first file creation, page cache)
        async_ckpt.wait()
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime").print_stats(rows)
        print(f"== {name} ==\n" + out.getvalue().split("\n\n", 1)[-1])
    async_ckpt.wait()
    trainer.metrics.close()


def main() -> None:
    """Parse and profile."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["step", "save"])
    p.add_argument("--model", choices=sorted(MODELS), default="default")
    p.add_argument("--raw", action="store_true", help="profile the hand-written loop instead (needs torchrun)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument("--rows", type=int, default=15)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.what == "step":
        profile_steps(a.model, a.raw, a.steps, a.rows)
    else:
        profile_save(a.model, a.rows)


if __name__ == "__main__":
    main()
