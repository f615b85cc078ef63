"""Learning-rate schedules: warm-up, then a registered shape (config/kinds.py's SCHEDULES: cosine, wsd,
linear, constant); and how each continues when a resumed run is given a different train.max_steps.

Every built-in schedule is a `Plan`: linear warm-up over `warmup` steps, a stable phase at the
peak, then a decay in `shape` (the schedule's name) from `start_factor` at `decay_start` to `floor`
at `max_steps` (factors multiply train.lr). A schedule is a `Shape` here plus its line in
SCHEDULES: its decay (the share of the drop still ahead at each point of the decay) and whether it
stays at the peak until the last `schedule.decay_fraction` of the run (wsd,
warmup-stable-decay) instead of decaying right after the warm-up.

Changing the plan of a running schedule (a resume with a larger train.max_steps, or any other
schedule setting) never makes the LR jump (`continued`): when the new plan gives the LR the old one
gives at the current step (still warming up, or in wsd's stable phase) the new plan is taken as
it is, so wsd simply stretches its stable phase; otherwise the decay restarts from the current
step at the current LR and reaches the new floor at the new max_steps, in the new shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ddptrain.config import Config
from ddptrain.config.kinds import SCHEDULES
from ddptrain.errors import ConfigError
from ddptrain.targets import import_target


@dataclass(frozen=True)
class Shape:
    """A schedule: `decay(progress)` is the share of the drop (start to floor) still ahead, 1 at progress 0
    and 0 at 1 for a schedule that reaches the floor; `late`: stable at the peak until the last
    schedule.decay_fraction of the run."""

    decay: Callable[[float], float]
    late: bool = False


COSINE = Shape(lambda progress: 0.5 * (1 + math.cos(math.pi * progress)))
LINEAR = Shape(lambda progress: 1 - progress)
WSD = Shape(LINEAR.decay, late=True)
CONSTANT = Shape(lambda progress: 1.0)


def schedule_shape(name: str) -> Shape:
    """The schedule registered as `name` (a plan saved with an older version names its decay: linear for wsd)."""
    found: Shape = SCHEDULES.load(name)
    return found


@dataclass(frozen=True)
class Plan:
    """The LR factor of every step: warm-up, stable at 1, decay in `shape` from start_factor to floor."""

    shape: str
    warmup: int
    decay_start: int
    start_factor: float
    floor: float
    max_steps: int

    def factor(self, step: int) -> float:
        """The factor of train.lr for the optimizer step that follows `step` completed steps."""
        if step >= self.decay_start:
            progress = min(1.0, (step - self.decay_start) / max(1, self.max_steps - self.decay_start))
            ahead = schedule_shape(self.shape).decay(progress) if step > self.decay_start else 1.0
            if ahead == 1.0:
                return self.start_factor  # exactly: a continued plan starts at the LR it continues
            return self.floor + (self.start_factor - self.floor) * ahead
        if step < self.warmup:
            return (step + 1) / self.warmup
        return 1.0


def config_plan(cfg: Config) -> Plan:
    """The plan schedule.name and train.* describe for a run of train.max_steps from step 0."""
    t, name = cfg.train, cfg.schedule.name
    decay_start = t.warmup_steps
    if schedule_shape(name).late:
        decay_steps = max(1, round(cfg.schedule.decay_fraction * t.max_steps))  # a run always ends at the floor
        decay_start = max(t.warmup_steps, t.max_steps - decay_steps)
    return Plan(name, t.warmup_steps, decay_start, 1.0, t.min_lr_ratio, t.max_steps)


def continued(old: Plan, new: Plan, step: int) -> Plan:
    """`new` from `step` on, without a jump in the LR (see the module docstring)."""
    if new.factor(step) == old.factor(step):
        return new
    return replace(new, decay_start=step, start_factor=old.factor(step))


class PlannedSchedule(LRScheduler):
    """A torch LRScheduler following a Plan; `follow` switches plans without an LR jump.

    `source` is the config plan the current one was derived from: resuming with an unchanged
    config keeps the saved plan exactly (bit-exact resume), a changed one continues from it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, plan: Plan) -> None:
        self.plan = self.source = plan
        super().__init__(optimizer)

    def get_lr(self) -> list[float | torch.Tensor]:
        """Every group's initial lr times the plan's factor at the current step."""
        return [base * self.plan.factor(self.last_epoch) for base in self.base_lrs]

    def follow(self, plan: Plan) -> str | None:
        """Continue with `plan` (the config's) from the current step, if it differs from the source. Returns a
        line to log when every step left then trains at the floor (the LR had reached it: a finished run given
        a larger train.max_steps), None otherwise."""
        if plan == self.source:
            return None
        self.plan, self.source = continued(self.plan, plan, self.last_epoch), plan
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        step, now = self.last_epoch, self.plan
        if not now.decay_start <= step < now.max_steps or abs(now.start_factor - now.floor) > 1e-12:
            return None
        return (
            f"the learning rate had reached its floor by step {step}: steps {step + 1} to {now.max_steps} train at "
            f"that floor, lr {self._last_lr[0]:.2e} (train.min_lr_ratio={now.floor:g} of train.lr; "
            "docs/checkpoints.md); for a decay of their own, start a new run from its weights (model.init_from)"
        )

    def state_dict(self) -> dict[str, Any]:
        """Step, base lrs and both plans (plain types: checkpoints load with weights_only=True)."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "plan", "source")}
        return {**state, "plan": asdict(self.plan), "source": asdict(self.source)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore state_dict(); a checkpoint written before plans existed keeps the config's plan."""
        state = {k: v for k, v in state_dict.items() if k not in ("plan", "source", "lr_lambdas")}
        self.__dict__.update(state)
        if "plan" in state_dict:
            self.plan, self.source = Plan(**state_dict["plan"]), Plan(**state_dict["source"])


def build_schedule(optimizer: torch.optim.Optimizer, cfg: Config) -> LRScheduler:
    """The built-in schedule of schedule.name, or the LRScheduler schedule.target's factory returns."""
    target = cfg.schedule.target
    if target is None:
        return PlannedSchedule(optimizer, config_plan(cfg))
    factory = import_target(target, "schedule.target")
    scheduler = factory(optimizer, max_steps=cfg.train.max_steps, **cfg.schedule.kwargs)
    if not isinstance(scheduler, LRScheduler):
        raise ConfigError(f"schedule.target={target!r} returned {type(scheduler).__name__}, not a torch LRScheduler")
    return scheduler


def apply_lr(scheduler: Any, optimizer: torch.optim.Optimizer, lr: float) -> None:
    """At a resume: train.lr of this run, not the checkpoint's: a changed lr scales the schedule from the resume
    step on.

    Untouched when train.lr is the saved one, so an unchanged config resumes bit-exactly.
    """
    base_lrs = getattr(scheduler, "base_lrs", None)
    if not base_lrs or all(base == lr for base in base_lrs):
        return
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = group["lr"] * (lr / base) if base else lr
        group["initial_lr"] = lr
    scheduler.base_lrs = [lr for _ in base_lrs]
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # what get_last_lr() reports
