"""The resume certificate's cost (`log.certificate`): training steps with and without its digest, side by side.

One process, the default model, two Trainers built as `ddptrain train` builds them (log.certificate true and
false, no checkpoints written: bench/train_worker.py's BenchTrainer). Per round, interleaved A B B A ...: each
trains STEPS more steps through Trainer.fit at the default log.every_steps, so a round holds STEPS /
log.every_steps logged steps, each digesting every parameter and optimizer-state tensor (observe/certificate.py)
in the "on" variant; then the same at log.every_steps=1 (every step logged, the worst case). Reported: seconds
per step of each, and the per-round ratio on / off.
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

STEPS = 20  # a round at the default log.every_steps (10): 2 logged steps
STEPS_EVERY_STEP = 10  # a round at log.every_steps=1, the worst case: every step logged and digested


def _round(trainer: BenchTrainer, steps: int) -> float:
    """Seconds per step of `steps` more steps of Trainer.fit (the last one is logged: it waits for the device)."""
    trainer.losses = []
    trainer.cfg.train.max_steps = trainer.step + steps
    t0 = time.perf_counter()
    trainer.fit()
    return (time.perf_counter() - t0) / steps


def _ratio(opts: Options, model: list[str], every: int, steps: int) -> tuple[Row, dict[str, Any]]:
    """Both variants at log.every_steps=every, interleaved; the row of their per-round ratio."""
    variants = {}
    for name, on in (("on", "true"), ("off", "false")):
        folder = opts.work_dir / "certificate" / f"{name}-{every}"
        shutil.rmtree(folder, ignore_errors=True)
        extra = [f"log.certificate={on}", f"log.every_steps={every}", "log.straggler_every=0"]
        trainer = build_trainer(bench_config(model, opts.data_dir, folder, extra), DistContext(), BenchTrainer)
        assert isinstance(trainer, BenchTrainer)
        variants[name] = partial(_round, trainer, steps)
    t = interleave(variants, opts)
    ratio = summary([a / b for a, b in zip(t["on"], t["off"])])
    ms = {k: summary(v)["median"] * 1000 for k, v in t.items()}
    label = "smoke" if opts.smoke else "default"
    note = f"{steps} steps a round; step {ms['off']:.0f} ms off, {ms['on']:.0f} ms on"
    metric = f"step time with / without log.certificate, log.every_steps={every}, {label} model"
    return Row("certificate", metric, ratio, "x", "reported", None, note), {"times_s": t, "steps_per_round": steps}


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """The ratio at the default log.every_steps and at 1 (every step digested)."""
    model = SMOKE_MODEL if opts.smoke else DEFAULT_MODEL
    default = LogConfig().every_steps
    rows, data = [], {}
    for every, steps in ((default, default if opts.smoke else STEPS), (1, 2 if opts.smoke else STEPS_EVERY_STEP)):
        row, data[f"every_{every}"] = _ratio(opts, model, every, steps)
        rows.append(row)
    return rows, data
