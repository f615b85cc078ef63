"""gloo all-reduce bus bandwidth over loopback, 1 KB to 64 MB, 2 ranks x 1 thread.

Bus bandwidth = bytes x 2(n-1)/n / time (the NCCL-tests convention: comparable across world sizes).
Sizes are interleaved within every round; each measurement is the mean over enough iterations
to last ~0.1 s (decided once in warm-up by rank 0 and broadcast).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import Options, Row, Variant, run_job, summary

SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KB, 4 KB, ... 64 MB
SMOKE_SIZES = [1 << 10, 1 << 16]


def _time(buf: torch.Tensor, iters: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    return (time.perf_counter() - t0) / iters


def worker(out: Path, rounds: int, sizes: list[int], target_s: float) -> None:
    """Inside torchrun: measure every size per round, rank 0 writes the JSON."""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    bufs = {n: torch.ones(n // 4, dtype=torch.float32) for n in sizes}
    iters = {}
    for n, buf in bufs.items():  # warm-up, and the iteration count that lasts ~target_s
        t = _time(buf, 3)
        count = torch.tensor([max(10, min(2000, int(target_s / max(t, 1e-7))))])
        dist.broadcast(count, 0)
        iters[n] = int(count)
    per_size: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(rounds):
        for n in sizes if r % 2 == 0 else reversed(sizes):
            t = _time(bufs[n], iters[n])
            per_size[n].append(n * 2 * (world - 1) / world / t / 1e9)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"world": world, "iters": iters, "busbw_GBps": per_size}))
    dist.destroy_process_group()


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Launch the 2-rank job and tabulate bus bandwidth per size."""
    out = opts.work_dir / "allreduce.json"
    sizes = SMOKE_SIZES if opts.smoke else SIZES
    args = [
        "--out",
        str(out),
        "--rounds",
        str(opts.rounds),
        "--sizes",
        ",".join(map(str, sizes)),
        "--target-s",
        "0.01" if opts.smoke else "0.1",
    ]
    run_job(Variant("allreduce", "bench.allreduce", args, nproc=2, forked=opts.smoke), opts.work_dir / "allreduce.log")
    data = json.loads(out.read_text())
    rows = []
    for n, values in data["busbw_GBps"].items():
        n = int(n)
        label = f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"
        rows.append(
            Row(
                "gloo all-reduce",
                f"bus bandwidth, {label}, 2 ranks",
                summary(values),
                "GB/s",
                "reported",
                None,
                f"{data['iters'][str(n)]} iterations per round",
            )
        )
    return rows, data


def main() -> None:
    """Worker entry point (under torchrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--target-s", type=float, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    worker(a.out, a.rounds, [int(x) for x in a.sizes.split(",")], a.target_s)


if __name__ == "__main__":
    main()
