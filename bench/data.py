"""Data loading vs compute: the Trainer's loader alone, its step on pre-built batches, and the stall.

One process, one thread, the default model (global batch 32 = 2 micro-batches of 16). Per round,
interleaved: draw batches from the Trainer's own loader (sampler + memmap + collate) with no model;
train on batches built beforehand (no loading at all); train end to end, timing every wait for a
batch inside the step. The stall is that waiting time as a share of the end-to-end step.

Measured twice: on the corpus, and on a mixture of 3 sources (data.sources: the same corpus under
three names, weights 5:3:2), whose loader also computes each batch's quotas and per-source order.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from bench.build import DEFAULT_MODEL, SMOKE_MODEL, bench_config, build_trainer
from bench.common import Options, Row, interleave, summary
from ddptrain.dist import DistContext


def _mixture(data_dir: Path) -> list[str]:
    parts = [f"{{name: {n}, weight: {w}, dir: {data_dir}}}" for n, w in (("web", 5), ("code", 3), ("math", 2))]
    return [f"data.sources=[{', '.join(parts)}]"]


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Loader throughput over step throughput, and the end-to-end stall: on the corpus, then on a mixture."""
    rows, data = measure(opts, "data-run", [], "")
    mixed_rows, mixed = measure(opts, "data-mixture-run", _mixture(opts.data_dir), ", mixture of 3 sources")
    return rows + mixed_rows, {**data, "mixture": mixed}


def measure(opts: Options, folder: str, extra: list[str], label: str) -> tuple[list[Row], dict[str, Any]]:
    """The two rows (loader/step ratio, stall) for the config with `extra` overrides; label ends their names."""
    steps = 2 if opts.smoke else 10
    model = SMOKE_MODEL if opts.smoke else DEFAULT_MODEL
    cfg = bench_config(model, opts.data_dir, opts.work_dir / folder, extra)
    trainer = build_trainer(cfg, DistContext())
    micro, per_step = cfg.data.micro_batch_size, trainer.accum
    load_batch = trainer.next_batch
    prebuilt = [load_batch() for _ in range(steps * per_step)]
    waited = [0.0]

    def loader_alone() -> float:
        t0 = time.perf_counter()
        for _ in range(steps * per_step * 4):  # 4x the batches of a round: a steadier figure
            load_batch()
        return steps * per_step * 4 * micro / (time.perf_counter() - t0)

    def timed_batch() -> Any:
        t0 = time.perf_counter()
        batch = load_batch()
        waited[0] += time.perf_counter() - t0
        return batch

    def steps_per_s(next_batch: Any) -> float:
        trainer.next_batch = next_batch  # type: ignore[method-assign]
        shares = stall if next_batch is timed_batch else []
        waited[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        seconds = time.perf_counter() - t0
        del trainer.next_batch  # back to the class's method
        shares.append(waited[0] / seconds)
        return steps * cfg.train.global_batch_size / seconds

    stall: list[float] = []  # the end-to-end rounds' stall, warm-up included
    t = interleave(
        {
            "loader": loader_alone,
            "step (pre-built batches)": lambda: steps_per_s(itertools.cycle(prebuilt).__next__),
            "end to end": lambda: steps_per_s(timed_batch),
        },
        opts,
    )
    e2e_stall = stall[opts.warmup :]
    ratio = summary([a / b for a, b in zip(t["loader"], t["step (pre-built batches)"])])
    st = summary([s * 100 for s in e2e_stall])
    trainer.metrics.close()
    rows = [
        Row(
            "data",
            f"loader samples/s / training samples/s (pre-built batches){label}",
            ratio,
            "x",
            ">= 2",
            ratio["median"] >= 2,
            f"loader {summary(t['loader'])['median']:,.0f} samples/s, "
            f"step {summary(t['step (pre-built batches)'])['median']:.0f} samples/s",
        ),
        Row(
            "data",
            f"end-to-end data stall (time waiting for batches / step time){label}",
            st,
            "%",
            "<= 1%" if extra else "<= 5%",
            st["median"] <= (1 if extra else 5),
            f"end to end {summary(t['end to end'])['median']:.0f} samples/s",
        ),
    ]
    return rows, {"samples_per_s": t, "stall": e2e_stall}
