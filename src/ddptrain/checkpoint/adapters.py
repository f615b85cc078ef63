"""The frozen base of a model.peft run: its weights, their digest, and the adapters added on top.

A LoRA checkpoint holds the adapters and their optimizer state only (models/peft.py makes the
model's state dict the adapters'); the base comes back from the config at every start: the
model it builds, with model.init_from's weights (a transformers folder, a run or checkpoint
folder, an exported .safetensors). Its SHA-256 (`state_digest`, over the base state dict before
the adapters are added) goes into every checkpoint's identity, and a resume (compat.py), an eval
or an export against a base with other weights is refused: adapters trained on one base mean
nothing on another.
"""

from __future__ import annotations

import logging

import torch.nn as nn

from ddptrain.checkpoint.weights import init_weights_from
from ddptrain.config import ModelConfig
from ddptrain.errors import CheckpointError, ConfigError
from ddptrain.models.peft import add_adapters, require_peft, state_digest

log = logging.getLogger(__name__)
BASE_DIGEST = "base_sha256"  # the identity key (checkpoint manifests) of the base weights' digest


def with_adapters(
    module: nn.Module, model_cfg: ModelConfig, expected_base: str | None = None, live: bool = False
) -> tuple[nn.Module, dict[str, str]]:
    """(the module to train, its identity entries): module itself and {} without model.peft; else module's base
    weights loaded from model.init_from, digested, and the adapters added. expected_base: the digest a
    checkpoint recorded, which the base must have (CheckpointError otherwise). live: module came from the
    Python API with weights of its own (a base without model.init_from)."""
    if model_cfg.peft is None:
        return module, {}
    require_peft()
    given = live or model_cfg.target is not None or (model_cfg.hf is not None and model_cfg.hf.pretrained)
    if not model_cfg.init_from and not given:
        raise ConfigError(
            "model.peft trains adapters on a frozen base: set model.init_from to its weights (a transformers folder, "
            "a run or checkpoint folder, an exported .safetensors) or use model.hf.pretrained; a fresh random base "
            "would not be the same one at a resume"
        )
    if model_cfg.init_from:
        loaded = init_weights_from(module, model_cfg.init_from, model_cfg)
        log.info("model.peft: the frozen base comes from %s", loaded)
    digest = state_digest(module.state_dict())
    if expected_base is not None and digest != expected_base:
        raise CheckpointError(
            f"the adapters were trained on a base with SHA-256 {expected_base[:12]}, but model.init_from and the "
            f"model config now give {digest[:12]}: point model.init_from at the base the run trained on"
        )
    return add_adapters(module, model_cfg.peft), {BASE_DIGEST: digest}


def base_change(saved_identity: dict[str, object], identity: dict[str, object]) -> str | None:
    """The refused change of base weights between a checkpoint and this run, described; None when they agree."""
    old, new = saved_identity.get(BASE_DIGEST), identity.get(BASE_DIGEST)
    if old == new:
        return None
    return f"the base weights (SHA-256 {str(old)[:12]} -> {str(new)[:12]}: model.init_from or the model config)"
