"""Metrics of your own: the extra scalars of a model's output dict and those train.metrics computes.

A model whose forward returns a plain dict, `{"loss": ..., "accuracy": ...}`, has every 0-dim tensor
beside "loss" recorded as a metric; its other entries (logits, hidden states) are outputs, not metrics,
and a Python number there is refused. A transformers ModelOutput (a dict subclass) is read for its loss
only: name its metrics with train.metrics. `train.metrics = "pkg.module:fn"` is called as fn(outputs,
batch) on every micro-batch and returns a dict of 0-dim tensors, each a metric (anything else is refused).

Training adds each micro-batch's values into device tensors (no host read: the step stays free of
syncs); a logged step divides the window's sums, all-reduces them stacked in one tensor and reads them
once. Evaluation weighs each batch's values as it weighs the loss (train/evaluation.py). Every rank
must measure the same names (they are stacked in name order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddptrain.config.train import METRIC_NAME
from ddptrain.dist import DistContext, all_reduce_mean
from ddptrain.errors import ConfigError
from ddptrain.targets import import_target


def check_metric_name(name: object, origin: str) -> str:
    """name when it is a valid metric name (a letter, then up to 63 letters, digits or _; not val_...),
    else ConfigError naming origin (who returned it)."""
    if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
        raise ConfigError(
            f"{origin} returned the metric name {name!r}: a metric name is a letter then up to 63 letters, digits or _"
        )
    if name.startswith("val_"):
        raise ConfigError(f"{origin} returned the metric name {name!r}: names starting with val_ are evaluation's")
    return name


def merge_metrics(record: dict[str, Any], metrics: Mapping[str, Any], origin: str) -> None:
    """Add metrics to a metrics.jsonl record; ConfigError when a name is already one of the record's keys."""
    clash = sorted(record.keys() & metrics.keys())
    if clash:
        raise ConfigError(f"{origin}: the metric name(s) {clash} clash with ddptrain's own keys; rename them")
    record.update(metrics)


def _is_scalar(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex()


def _scalars_of(output: Any, origin: str) -> dict[str, torch.Tensor]:
    """The metrics in a forward's output: the 0-dim tensors of a plain dict beside "loss" (logits, hidden states
    and other entries are outputs, not metrics); a Python number there is refused (it was read from the device)."""
    if type(output) is not dict:
        return {}
    for name, value in output.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ConfigError(
                f"{origin} returned metric {name!r} as a Python {type(value).__name__}; return a 0-dim tensor "
                "(a number was read from the device at every step)"
            )
    return {k: v for k, v in output.items() if k != "loss" and _is_scalar(v)}


class CustomMetrics:
    """The metrics of one run's forwards: `measure` for one micro-batch, `add`/`take` for a log window."""

    def __init__(self, target: str | None, model_name: str) -> None:
        self.target = target
        self.fn: Callable[..., Any] | None = import_target(target, "train.metrics") if target else None
        self.origin = f"model {model_name}" + (f" or train.metrics={target!r}" if target else "")
        self._sums: dict[str, torch.Tensor] = {}
        self._checked: frozenset[str] = frozenset()  # the names last validated: checked again when they change

    def measure(self, output: Any, batch: Any) -> dict[str, torch.Tensor]:
        """The scalars one forward measured, as device tensors; ConfigError for a bad name or value."""
        found = _scalars_of(output, self.origin)
        if self.fn is not None:
            extra = self.fn(output, batch)
            if not isinstance(extra, Mapping):
                raise ConfigError(f"train.metrics={self.target!r} returned {type(extra).__name__}, not a dict")
            both = sorted(found.keys() & extra.keys())
            if both:
                raise ConfigError(f"train.metrics={self.target!r} returned {both}, which the model's output has too")
            for name, value in extra.items():  # shape and dtype are metadata: no device read
                if not _is_scalar(value):
                    shape = (
                        f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
                    )
                    raise ConfigError(
                        f"train.metrics={self.target!r} returned {name!r} as {shape}; a metric is a 0-dim tensor"
                    )
            found.update(extra)
        if found.keys() != self._checked:
            for name in found:
                check_metric_name(name, self.origin)
            self._checked = frozenset(found)
        return found

    def add(self, output: Any, batch: Any, scale: float) -> None:
        """Training: add one micro-batch's metrics, times scale (1 / accumulation), to the window's device sums."""
        for name, value in self.measure(output, batch).items():
            scaled = value.detach().float() * scale
            if name in self._sums:
                self._sums[name] += scaled
            else:
                self._sums[name] = scaled

    def take(self, ctx: DistContext, steps: int) -> dict[str, float]:
        """A logged step, every rank: the window's means over its steps and the ranks (one all-reduce, one read)."""
        if not self._sums:
            return {}
        names = sorted(self._sums)
        stacked = torch.stack([self._sums[n] for n in names]) / steps
        self._sums = {}
        return dict(zip(names, all_reduce_mean(ctx, stacked).tolist()))
