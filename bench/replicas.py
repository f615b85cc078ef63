"""The replica check's cost: the state digest (observe/digest.py) against the training step, side by side.

One process, the default model and the ~100 MB-of-state model, after one optimizer step (the AdamW
moments exist). Per round, interleaved: STEPS training steps (time per step), and DIGESTS digests of
every parameter and optimizer-state tensor, each read back to the host as the check does (time per
digest). The all-gather of one int64 per rank is not in it (a 1 KB gloo all-reduce: the allreduce
figure). Overhead at the default interval = digest / (log.replica_check_every x step).
"""

from __future__ import annotations

import shutil
import time
from functools import partial
from typing import Any

from bench.build import DEFAULT_MODEL, LARGE_MODEL, SMOKE_MODEL, bench_config, build_trainer
from bench.common import Options, Row, interleave, summary
from ddptrain.config import LogConfig
from ddptrain.dist import DistContext
from ddptrain.observe.digest import combine, named_state, state_digests
from ddptrain.train.trainer import Trainer

STEPS, DIGESTS = 5, 5
TARGET = 0.005  # the budget: <= 0.5% of step time at the default interval


def _steps(trainer: Trainer, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        float(trainer.train_step().loss)  # waits for the step, as a logged step does
    return (time.perf_counter() - t0) / n


def _digests(trainer: Trainer, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        tensors = named_state(trainer.model, trainer.optimizer)
        int(combine(state_digests(tensors, trainer.ctx.device)).item())
    return (time.perf_counter() - t0) / n


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Both models; per-round step and digest times; the overhead at the default interval."""
    models = {"smoke": SMOKE_MODEL} if opts.smoke else {"default": DEFAULT_MODEL, "~100 MB": LARGE_MODEL}
    every = LogConfig().replica_check_every
    steps, digests = (1, 1) if opts.smoke else (STEPS, DIGESTS)
    rows: list[Row] = []
    data: dict[str, Any] = {}
    for label, model in models.items():
        folder = opts.work_dir / "replicas" / label.replace(" ", "").replace("~", "")
        shutil.rmtree(folder, ignore_errors=True)
        trainer = build_trainer(bench_config(model, opts.data_dir, folder), DistContext())
        trainer.train_step()
        mb = sum(t.numel() * t.element_size() for _, t in named_state(trainer.model, trainer.optimizer)) / 1e6
        variants = {"step": partial(_steps, trainer, steps), "digest": partial(_digests, trainer, digests)}
        t = interleave(variants, opts)
        share = summary([d / s for d, s in zip(t["digest"], t["step"])])
        overhead = summary([d / (every * s) for d, s in zip(t["digest"], t["step"])])
        ms = {k: summary(v)["median"] * 1000 for k, v in t.items()}
        note = f"{mb:.0f} MB of state; digest {ms['digest']:.1f} ms, step {ms['step']:.0f} ms"
        rows += [
            Row("replica check", f"digest time / step time, {label} model", share, "x", "reported", None, note),
            Row(
                "replica check",
                f"overhead at log.replica_check_every={every}, {label} model",
                overhead,
                "",
                f"<= {TARGET:g}",
                overhead["median"] <= TARGET,
                "one digest per interval",
            ),
        ]
        data[label] = {"times_s": t, "state_mb": mb}
    return rows, data
