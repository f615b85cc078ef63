"""FSDP vs DDP on 2 ranks under torchrun (gloo): the cost of sharding a model that fits, and the memory it saves.

- step time: one job holds the default GPT (4 x 128) twice, wrapped by ddptrain's own wrap_model as
  DDP and as FSDP (dist.strategy), and times training steps (forward, backward, AdamW) of each in
  interleaved rounds, the order alternating; a round's value is the slowest rank's mean step.
- peak memory: a GPT of 12 x 768 (~85M parameters: parameters + AdamW state ~1 GB in fp32) trains a
  few steps in one job per strategy (the RSS high-water mark only grows, so each needs its own
  processes); the figure is the larger of the 2 ranks' max RSS, FSDP over DDP, with
  dist.cpu_release_memory (without it glibc keeps FSDP's freed buffers: 1.3x DDP's, measured).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import Options, Row, Variant, interleave, run_job, summary
from ddptrain.config import Config, DistConfig
from ddptrain.dist import DistContext, close_distributed, init_distributed
from ddptrain.models.gpt import GPT
from ddptrain.train.parallel import wrap_model

DEFAULT = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
LARGE = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 64}
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}


class _Model:
    """One wrapped model, its optimizer and a fixed batch: step() trains once."""

    def __init__(self, shape: dict[str, int], strategy: str, ctx: DistContext, batch: int, release: bool) -> None:
        dist_cfg = {"strategy": strategy, "cpu_release_memory": release}
        cfg = Config.model_validate({"model": shape, "dist": dist_cfg})
        torch.manual_seed(0)
        self.module = wrap_model(GPT(cfg.model), cfg, ctx)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4, fused=True)
        g = torch.Generator().manual_seed(ctx.rank)
        self.x = torch.randint(0, 256, (batch, shape["block_size"] + 1), generator=g)

    def step(self) -> None:
        self.module(self.x[:, :-1], self.x[:, 1:]).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(model: _Model, steps: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        model.step()
    return _slowest((time.perf_counter() - t0) / steps)


def worker(out: Path, mode: str, rounds: int, warmup: int, smoke: bool) -> None:
    """Inside torchrun: `steps` times both strategies interleaved; `ddp`/`fsdp` measure that one's peak RSS."""
    torch.set_num_threads(1)
    ctx = init_distributed(DistConfig(timeout_s=300))
    result: dict[str, Any]
    if mode == "steps":
        shape, batch, steps = (TINY, 2, 1) if smoke else (DEFAULT, 16, 3)
        models = {s: _Model(shape, s, ctx, batch, False) for s in ("ddp", "fsdp")}
        times = interleave(
            {s: lambda m=m: _timed(m, steps) for s, m in models.items()},  # type: ignore[misc]
            Options(rounds=rounds, warmup=warmup),
        )
        result = {"seconds": times}
    else:
        model = _Model(TINY if smoke else LARGE, mode, ctx, 2, release=True)  # the memory-saving setting
        for _ in range(2 if smoke else 3):
            model.step()
        rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], dtype=torch.float64)
        per_rank = [torch.zeros_like(rss) for _ in range(ctx.world_size)]
        dist.all_gather(per_rank, rss)
        n = sum(p.numel() for p in model.module.parameters())
        result = {"peak_rss_mb": [float(r) for r in per_rank], "parameters": n}
    if ctx.is_main:
        out.write_text(json.dumps(result))
    close_distributed(ctx)


def _job(opts: Options, mode: str) -> dict[str, Any]:
    out = opts.work_dir / f"fsdp-{mode}.json"
    args = ["--out", str(out), "--mode", mode, "--rounds", str(opts.rounds), "--warmup", str(opts.warmup)]
    run_job(Variant(f"fsdp-{mode}", "bench.fsdp", [*args, *(["--smoke"] if opts.smoke else [])], nproc=2, forked=opts.smoke),
            opts.work_dir / f"fsdp-{mode}.log")  # fmt: skip
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Three jobs: the interleaved step times, then one per strategy for peak memory."""
    steps = _job(opts, "steps")
    t = steps["seconds"]
    ratio = summary([f / d for f, d in zip(t["fsdp"], t["ddp"])])
    ms = {s: summary(v)["median"] * 1000 for s, v in t.items()}
    mem = {s: _job(opts, s) for s in ("ddp", "fsdp")}
    peak = {s: max(m["peak_rss_mb"]) for s, m in mem.items()}
    gb = mem["ddp"]["parameters"] * 12 / 1e9  # fp32 parameters + AdamW's two moments
    rows = [
        Row(
            "fsdp (2 ranks)",
            "step time FSDP / DDP, default model (sharding a model that fits)",
            ratio,
            "x",
            "reported",
            None,
            f"FSDP {ms['fsdp']:.0f} ms, DDP {ms['ddp']:.0f} ms",
        ),
        Row(
            "fsdp (2 ranks)",
            f"peak RSS per rank FSDP / DDP ({gb:.2f} GB parameters + AdamW; dist.cpu_release_memory)",
            summary([peak["fsdp"] / peak["ddp"]]),
            "x",
            "<= 0.6",
            peak["fsdp"] / peak["ddp"] <= 0.6,
            f"FSDP {peak['fsdp']:.0f} MB, DDP {peak['ddp']:.0f} MB (max RSS, the larger rank)",
        ),
    ]
    return rows, {"steps": steps, "memory": mem}


def main() -> None:
    """Worker entry point (under torchrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=("steps", "ddp", "fsdp"), required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    worker(a.out, a.mode, a.rounds, a.warmup, a.smoke)


if __name__ == "__main__":
    main()
