"""Step 8 of the set-up (run.py): resume from a verified checkpoint or start (from model.init_from or fresh),
and say which in the log and in metrics.jsonl."""

from __future__ import annotations

import logging
import os

from ddptrain.checkpoint import Checkpointer
from ddptrain.checkpoint.weights import init_weights_from
from ddptrain.config import Config
from ddptrain.observe.metrics import MetricsWriter
from ddptrain.observe.recovery import RecoveryTimeline
from ddptrain.train.trainer import Trainer

log = logging.getLogger(__name__)


def say(text: str) -> None:
    """The callback through which the checkpoint search and the trackers still report (they take a
    `say` function, not a logger): their warnings come prefixed with "warning: "."""
    if text.startswith("warning: "):
        log.warning(text.removeprefix("warning: "))
    else:
        log.info(text)


def resume_or_start(
    cfg: Config, trainer: Trainer, checkpointer: Checkpointer, metrics: MetricsWriter, timeline: RecoveryTimeline | None
) -> None:
    """Step 8 of run.py: load the checkpoint ckpt.resume names (if any), else model.init_from, and announce the run."""
    ctx = trainer.ctx
    found = checkpointer.find_resume(say)
    if found:
        ckpt = found.checkpoint
        trainer.resume(ckpt)
        log.info(
            "resuming from %s (step %d; saved at world size %s, now %d, grad accumulation %d)",
            ckpt.path,
            trainer.step,
            ckpt.manifest.world_size,
            ctx.world_size,
            trainer.accum,
        )
        if found.changes:
            log.info(
                "config changed since %s, applied from step %d on: %s",
                ckpt.path.name,
                trainer.step,
                ", ".join(c.describe() for c in found.changes),
            )
            metrics.write(
                "event",
                event="config_change",
                step=trainer.step,
                checkpoint=ckpt.path.name,
                changes=[{"key": c.key, "old": c.old, "new": c.new} for c in found.changes],
            )
        if cfg.model.init_from and cfg.model.peft is None:
            log.info("model.init_from ignored: the run folder has checkpoints and resume wins")
    elif cfg.model.init_from and cfg.model.peft is None:  # model.peft loaded it as the base (run.py)
        loaded = init_weights_from(trainer.model, cfg.model.init_from, cfg.model)
        log.info("initialised the model from %s (weights only: fresh optimizer, step 0)", loaded)
    n_params = parameter_count(sum(p.numel() for p in trainer.model.parameters()))
    log.info(
        f"training {cfg.run.name}: world size {ctx.world_size} ({ctx.backend or 'single process'}, {ctx.device}), "
        f"global batch {cfg.train.global_batch_size} = {cfg.data.micro_batch_size} x {ctx.world_size} x "
        f"{trainer.accum}, {n_params} parameters, run dir {cfg.run_dir}",
        extra=trainer.sync.console_extra(),
    )
    warn_if_all_warm_up(cfg, trainer.step)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if timeline is not None:
        timeline.mark("checkpoint_loaded")
    metrics.write(
        "event",
        event="resume" if found else "start",
        step=trainer.step,
        world_size=ctx.world_size,
        grad_accum=trainer.accum,
        restart_count=restarts,
        host=ctx.hostname,
        **trainer.sync.event_fields(),
    )


def parameter_count(n: int) -> str:
    """A parameter count as the start line says it: millions with two decimals (`0.84M`), billions from 1e9
    (`7.24B`), the exact count below 10,000 (`161`), where millions would read `0.00M`."""
    if n < 10_000:
        return f"{n:,}"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def warn_if_all_warm_up(cfg: Config, step: int) -> None:
    """A warm-up as long as the run (easy with the default 20 steps and a short fine-tune) is a warning,
    not an error: the run trains, but its learning rate never reaches train.lr."""
    t = cfg.train
    if t.warmup_steps >= t.max_steps > step:
        log.warning(
            "train.warmup_steps=%d covers the whole run (train.max_steps=%d): the learning rate never reaches "
            "train.lr=%g; set train.warmup_steps below train.max_steps (e.g. train.warmup_steps=%d)",
            t.warmup_steps,
            t.max_steps,
            t.lr,
            max(1, t.max_steps // 10),
        )
