"""The resume certificate's cost (`log.certificate`): training steps with and without its digest, side by side.

One process, the default model, two Trainers built as `ddptrain train` builds them (log.certificate true and
false, no checkpoints written: bench/train_worker.py's BenchTrainer). Per round, interleaved A B B A ...: each
trains STEPS more steps through Trainer.fit at the default log.every_steps, so a round holds STEPS /
log.every_steps logged steps, each digesting every parameter and optimizer-state tensor (observe/certificate.py)
in the "on" variant. Reported: seconds per step of each, and the per-round ratio on / off.
"""

from __future__ import annotations

import shutil
import time
from functools import partial
from typing import Any

from bench.build import DEFAULT_MODEL, SMOKE_MODEL, bench_config, build_trainer
from bench.common import Options, Row, interleave, summary
from bench.train_worker import BenchTrainer
from ddptrain.config import LogConfig
from ddptrain.dist import DistContext

STEPS = 20


def _round(trainer: BenchTrainer, steps: int) -> float:
    """Seconds per step of `steps` more steps of Trainer.fit (the last one is logged: it waits for the device)."""
    trainer.losses = []
    trainer.cfg.train.max_steps = trainer.step + steps
    t0 = time.perf_counter()
    trainer.fit()
    return (time.perf_counter() - t0) / steps


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Seconds per step with and without the certificate; the ratio per round."""
    model = SMOKE_MODEL if opts.smoke else DEFAULT_MODEL
    every = LogConfig().every_steps
    steps = every if opts.smoke else STEPS
    variants = {}
    for name, on in (("on", "true"), ("off", "false")):
        folder = opts.work_dir / "certificate" / name
        shutil.rmtree(folder, ignore_errors=True)
        cfg = bench_config(model, opts.data_dir, folder, [f"log.certificate={on}", "log.straggler_every=0"])
        trainer = build_trainer(cfg, DistContext(), BenchTrainer)
        assert isinstance(trainer, BenchTrainer)
        variants[name] = partial(_round, trainer, steps)
    t = interleave(variants, opts)
    ratio = summary([a / b for a, b in zip(t["on"], t["off"])])
    ms = {k: summary(v)["median"] * 1000 for k, v in t.items()}
    note = f"{steps} steps a round, 1 in {every} logged; step {ms['off']:.0f} ms off, {ms['on']:.0f} ms on"
    rows = [
        Row(
            "certificate", "step time with / without log.certificate, default model", ratio, "x", "reported", None, note
        )
    ]
    return rows, {"times_s": t, "steps_per_round": steps, "log_every_steps": every}
