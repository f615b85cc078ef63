"""Early stopping: judge each evaluation by one metric, stop after `patience` evaluations without improvement.

Every rank judges the same numbers: an evaluation's values are all-reduced (train/evaluation.py) and
read on every rank, so every rank reaches the same verdict at the same step without a collective of
its own. The state (best value and step, evaluations since) is part of the trainer's state_dict, so a
resumed run continues the count where its checkpoint left it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddptrain.config.train import EarlyStopConfig
from ddptrain.errors import ConfigError


@dataclass(frozen=True)
class Verdict:
    """What one evaluation meant: a new best (save and mark it), and whether the run stops now."""

    improved: bool
    stop: bool


class EarlyStop:
    """The patience count of train.early_stop; observe() once per evaluation, on every rank."""

    def __init__(self, cfg: EarlyStopConfig) -> None:
        self.cfg = cfg
        self.best: float | None = None
        self.best_step: int | None = None
        self.since_best = 0  # evaluations since the best one

    def improves(self, value: float) -> bool:
        """Whether value beats the best so far by more than min_delta (a NaN never does)."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.cfg.mode == "min":
            return value < self.best - self.cfg.min_delta
        return value > self.best + self.cfg.min_delta

    @property
    def stopped(self) -> bool:
        """True once patience evaluations in a row brought no improvement (a resumed run stops at once)."""
        return self.since_best >= self.cfg.patience

    def observe(self, record: Mapping[str, Any], step: int) -> Verdict:
        """Judge an evaluation's record (val_loss, val_<name>); ConfigError when it lacks the metric."""
        value = record.get(self.cfg.metric)
        if not isinstance(value, (int, float)):
            measured = sorted(k for k in record if k.startswith("val_"))
            raise ConfigError(
                f"train.early_stop.metric={self.cfg.metric!r} is not recorded at evaluations (they record {measured})"
            )
        if self.improves(float(value)):
            self.best, self.best_step, self.since_best = float(value), step, 0
            return Verdict(improved=True, stop=False)
        self.since_best += 1
        return Verdict(improved=False, stop=self.stopped)

    def reason(self) -> str:
        """Why the run stopped, for the log line and the end record."""
        best = (
            f"best {self.best:.6g} at step {self.best_step}"
            if self.best is not None
            else "no evaluation gave a number (all NaN)"
        )
        return (
            f"early stop: {self.cfg.metric} did not improve by more than {self.cfg.min_delta:g} ({self.cfg.mode}) "
            f"in {self.since_best} evaluations; {best}"
        )

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to continue the count, and what it counted (a changed metric starts afresh)."""
        cfg = self.cfg
        return {
            "metric": cfg.metric,
            "mode": cfg.mode,
            "best": self.best,
            "best_step": self.best_step,
            "since": self.since_best,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a saved count; a checkpoint that judged another metric or mode (or none) starts a fresh count."""
        if (state.get("metric"), state.get("mode")) != (self.cfg.metric, self.cfg.mode):
            return
        self.best, self.best_step, self.since_best = state["best"], state["best_step"], int(state["since"])


def build_early_stop(cfg: EarlyStopConfig | None, has_validation: bool) -> EarlyStop | None:
    """train.early_stop's count (None without one); ConfigError when the data has no validation set to judge."""
    if cfg is None:
        return None
    if not has_validation:
        raise ConfigError("train.early_stop judges evaluations, and the data has no validation set")
    return EarlyStop(cfg)
