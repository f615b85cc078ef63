"""Does the config of a run fit the checkpoint it resumes from? (docs/checkpoints.md, "Changing the config")

Refused (exit 2), because the saved state would not mean the same thing:
  model shape   the built-in GPT's shape keys, model.target, or any parameter's shape
  base weights  model.peft: the frozen base's SHA-256 (checkpoint/adapters.py)
  data identity the prepared corpus's SHA-256 (meta.json), or data.target and data.kwargs
  train.global_batch_size and run.seed   the saved data position is in units of both
Everything else that differs (train.max_steps, train.lr, ckpt.*, log.*, dist.timeout_s, ...)
is applied from the resume step on and listed as a change, which the run logs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ddptrain.checkpoint.adapters import base_change
from ddptrain.errors import CheckpointError

GPT_SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")
_STREAM_KEYS = (("train", "global_batch_size"), ("run", "seed"))


@dataclass(frozen=True)
class ConfigChange:
    """One config key whose value differs from the checkpoint's."""

    key: str
    old: Any
    new: Any

    def describe(self) -> str:
        """`key (old -> new)`, values shortened."""
        return f"{self.key} ({_short(self.old)} -> {_short(self.new)})"


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def run_identity(data: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """What the checkpoints of this run must agree with at resume: the data's identity (its source's
    resume_identity(), data/source.py: the corpus's SHA-256, the dataset factory and its kwargs, or 'live'
    for objects passed in) and the parameters' shapes."""
    return {"data": data, "model": {name: list(t.shape) for name, t in model.state_dict().items()}}


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, fields in config.items():
        if isinstance(fields, dict):
            out.update({f"{section}.{k}": v for k, v in fields.items()})
        else:
            out[section] = fields
    return out


def _model_conflicts(
    saved: dict[str, Any], now: dict[str, Any], saved_shapes: Any, shapes: dict[str, Any]
) -> list[str]:
    s, n = saved.get("model", {}), now.get("model", {})
    named = [ConfigChange(f"model.{k}", s.get(k), n.get(k)) for k in ("target",) if s.get(k) != n.get(k)]
    if n.get("target") is None:
        named += [ConfigChange(f"model.{k}", s.get(k), n.get(k)) for k in GPT_SHAPE_KEYS if s.get(k) != n.get(k)]
    out = [c.describe() for c in named]
    if not out and isinstance(saved_shapes, dict) and saved_shapes != shapes:
        differing = sorted(set(saved_shapes) ^ set(shapes)) or [
            k for k in sorted(shapes) if saved_shapes[k] != shapes[k]
        ]
        first = differing[0]
        cause = "model.kwargs" if s.get("kwargs") != n.get("kwargs") else "the model"
        out.append(f"{cause} (parameter {first}: {saved_shapes.get(first)} -> {shapes.get(first)})")
    return out


def _parts(mixture: dict[str, Any]) -> str:
    parts = mixture.get("parts")
    described = (
        [f"{p.get('name')} {p.get('weight')}" for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []
    )
    return ", ".join(described) or "?"


def _data_conflicts(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    if saved == now or "live" in (saved.get("source"), now.get("source")):
        return []  # live dataset objects have no identity ddptrain can check
    if saved.get("source") != now.get("source") or saved.get("target") != now.get("target"):
        return [f"data.target ({_short(saved.get('target'))} -> {_short(now.get('target'))})"]
    if saved.get("source") == "target":
        return [ConfigChange("data.kwargs", saved.get("kwargs"), now.get("kwargs")).describe()]
    if saved.get("source") == "mixture":  # the saved position names other samples under other parts or weights
        return _mixture_conflicts(saved, now)
    return [f"data.dir (corpus SHA-256 {str(saved.get('sha256'))[:12]} -> {str(now.get('sha256'))[:12]})"]


def _mixture_conflicts(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The same names and weights: each part whose content changed (`data.sources b.dir (corpus SHA-256 ...)`);
    else the names and weights, before and after."""
    old_parts, new_parts = saved.get("parts"), now.get("parts")
    if _parts(saved) != _parts(now) or not isinstance(old_parts, list) or not isinstance(new_parts, list):
        return [f"data.sources ({_parts(saved)} -> {_parts(now)})"]
    changed = []
    for old, new in zip(old_parts, new_parts):
        for conflict in _data_conflicts(old, new) if isinstance(old, dict) and isinstance(new, dict) else []:
            changed.append(f"data.sources {old.get('name')}.{conflict.removeprefix('data.')}")
    return changed or [f"data.sources ({_parts(saved)} -> {_parts(now)})"]


def check_resume(
    checkpoint: str,
    saved_config: dict[str, Any],
    saved_identity: dict[str, Any],
    config: dict[str, Any],
    identity: dict[str, Any],
) -> list[ConfigChange]:
    """The applied changes; CheckpointError naming every refused change and the ways forward."""
    conflicts: list[str] = []
    if "model" in identity:  # identity is empty for a Checkpointer used on its own (benchmarks, tests)
        conflicts += _model_conflicts(saved_config, config, saved_identity.get("model"), identity["model"])
        conflicts += [change for change in [base_change(saved_identity, identity)] if change]
    saved_data = saved_identity.get("data")
    if "data" in identity:
        conflicts += _data_conflicts(saved_data if isinstance(saved_data, dict) else {}, identity["data"])
    old, new = _flatten(saved_config), _flatten(config)
    conflicts += [
        ConfigChange(f"{s}.{k}", old.get(f"{s}.{k}"), new.get(f"{s}.{k}")).describe()
        for s, k in _STREAM_KEYS
        if old.get(f"{s}.{k}") != new.get(f"{s}.{k}")
    ]
    if conflicts:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: changed {', '.join(conflicts)} would not fit the saved state. "
            "Ways forward: restore those values; or train into a new folder (run.name=NEW_NAME); "
            "or start fresh here with ckpt.resume=never ckpt.existing=archive "
            "(the checkpoints move to checkpoints/archive/)"
        )
    refused = {f"model.{k}" for k in ("target", *GPT_SHAPE_KEYS)} | {f"{s}.{k}" for s, k in _STREAM_KEYS}
    return [
        ConfigChange(k, old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if k not in refused and old.get(k) != new.get(k)
    ]
