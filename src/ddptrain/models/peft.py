"""LoRA adapters through Hugging Face `peft` (model.peft): the model is frozen and only the adapters train.

A transformers model (model.hf) gets its adapters inside `HFCausalLM.hf`, which becomes a
`PeftModelForCausalLM`: its `save_pretrained` writes the adapter folder `PeftModel.from_pretrained`
loads onto the same transformers base, and `merge_and_unload` gives back a plain transformers model.
The built-in GPT and a user's module are wrapped whole in a `PeftModel` (peft's LoRA adapts any
nn.Linear, nn.Embedding or convolution a name in target_modules reaches).

The model's state is its adapters: the trained module gets state-dict hooks that leave the frozen
parameters and buffers out of `state_dict()` and accept their absence in `load_state_dict()`, so
that every checkpoint format, the resume check of parameter shapes and eval's reload see the
adapters only, with no change of theirs. The frozen base is rebuilt from the config (and
model.init_from) at every start and recognised by `state_digest` (checkpoint/adapters.py).
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ddptrain.config import AdapterConfig
from ddptrain.errors import ConfigError
from ddptrain.models.hf import HFCausalLM

log = logging.getLogger(__name__)
PEFT_HINT = "install the optional extra: pip install 'ddptrain[peft]'"


def require_peft(what: str = "model.peft") -> None:
    """ConfigError naming the `peft` extra when the peft package is not installed."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs the peft package; {PEFT_HINT}") from None


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor of a state dict, in name order: name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def is_adapted(model: nn.Module) -> bool:
    """Whether model already holds peft adapters (a PeftModel, or one inside an HFCausalLM)."""
    from peft import PeftModel

    return any(isinstance(m, PeftModel) for m in model.modules())


def _check_targets(host: nn.Module, targets: list[str] | None) -> None:
    """ConfigError for a target_modules entry that names no layer (peft itself only fails when none matches)."""
    if targets is None:
        return
    names = [n for n, _ in host.named_modules() if n]
    for target in targets:
        if not any(n == target or n.endswith("." + target) for n in names):
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in host.named_modules() if not list(m.children())} - {""})
            leaves = [leaf for leaf in leaves if not leaf.isdigit()]
            raise ConfigError(
                f"model.peft.target_modules: {target!r} matches no layer of {type(host).__name__}; "
                f"its layer names end in {', '.join(leaves[:24])}"
            )


def add_adapters(model: nn.Module, cfg: AdapterConfig) -> nn.Module:
    """model with LoRA adapters on the layers cfg.target_modules names, everything else frozen; the module to train.

    An HFCausalLM keeps its class (its `.hf` gets the adapters); any other module comes back inside a PeftModel.
    """
    require_peft()
    from peft import LoraConfig, get_peft_model

    if is_adapted(model):
        raise ConfigError("model.peft: the model already holds peft adapters; pass its base model, or drop model.peft")
    hf = isinstance(model, HFCausalLM)
    host: nn.Module = model.hf if isinstance(model, HFCausalLM) else model
    _check_targets(host, cfg.target_modules)
    lora = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM" if hf else None,
    )
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question: not the user's concern
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            adapted = get_peft_model(host, lora)
    except (ValueError, TypeError, NotImplementedError) as e:
        reason = " ".join(str(e).split())[:300]
        raise ConfigError(f"model.peft: peft cannot add LoRA adapters to {type(host).__name__}: {reason}") from None
    root: nn.Module = model if hf else adapted
    if hf:
        model.hf = adapted
    trainable, total = adapted.get_nb_trainable_parameters()
    log.info(
        "LoRA r=%d alpha=%g on %s: %d trainable parameters of %d (%.2f%%)",
        cfg.r,
        cfg.alpha,
        ", ".join(cfg.target_modules or ["peft's default layers"]),
        trainable,
        total,
        100 * trainable / max(total, 1),
    )
    keep_adapters_only(root)
    return root


def _unprefixed(key: str, names: set[str]) -> str | None:
    """The name in `names` that key is, under any module prefix ("module." of DDP, a parent's); None if none."""
    if key in names:
        return key
    parts = key.split(".")
    return next((".".join(parts[i:]) for i in range(1, len(parts)) if ".".join(parts[i:]) in names), None)


def keep_adapters_only(root: nn.Module) -> None:
    """Hooks on root: its state dict holds the parameters that train (the adapters), and loading needs only those."""
    kept = {n for n, p in root.named_parameters() if p.requires_grad}
    frozen = set(root.state_dict()) - kept

    def drop_frozen(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        for key in [k for k in state if k.startswith(prefix) and k[len(prefix) :] in frozen]:
            del state[key]

    def frozen_may_be_missing(module: nn.Module, incompatible: Any) -> None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if _unprefixed(k, frozen) is None]

    root.register_state_dict_post_hook(drop_frozen)
    root.register_load_state_dict_post_hook(frozen_may_be_missing)


def merge_adapters(model: nn.Module) -> nn.Module:
    """The model with its adapters merged into the base weights and peft removed (the model itself without them)."""
    if isinstance(model, HFCausalLM) and is_adapted(model):
        return HFCausalLM(model.hf.merge_and_unload(), model.block_size)
    from peft import PeftModel

    if isinstance(model, PeftModel):
        merged: nn.Module = model.merge_and_unload()
        return merged
    return model


def save_adapters(model: nn.Module, out: Path) -> str:
    """Write model's adapters as a peft adapter folder (adapter_config.json, adapter_model.safetensors); a summary."""
    host = model.hf if isinstance(model, HFCausalLM) else model
    from peft import PeftModel

    if not isinstance(host, PeftModel):
        raise ConfigError(f"--format peft: {type(host).__name__} holds no peft adapters (the run had no model.peft)")
    host.save_pretrained(str(out))
    base = type(host.get_base_model()).__name__
    return f"LoRA adapters for {base} (load with peft.PeftModel.from_pretrained(base_model, folder))"
