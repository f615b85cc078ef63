"""Model weights out of verified checkpoints, exports and transformers folders (`model.init_from`).

Every source ends in a flat {name: tensor} state that must match the model exactly: missing,
unexpected and mis-shaped tensors are a user error naming the first few. A checkpoint is verified
file by file before anything in it is read.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ddptrain.checkpoint.manifest import MANIFEST
from ddptrain.checkpoint.store import select_checkpoint
from ddptrain.checkpoint.verify import verify_checkpoint
from ddptrain.errors import CheckpointError
from ddptrain.run_folder import checkpoints_dir

_SHOWN = 4


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file as load_safetensors

    try:
        return load_safetensors(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def read_weights(source: str) -> tuple[dict[str, torch.Tensor], str, bool]:
    """(state, description, is_transformers_folder) of a run folder, checkpoint folder, .safetensors or HF folder."""
    path = Path(source)
    if path.is_file() and path.suffix == ".safetensors":
        return _read_safetensors(path), f"exported weights {path}", False
    if (path / MANIFEST).is_file():
        return verify_checkpoint(path).state("model"), f"checkpoint {path}", False
    if checkpoints_dir(path).is_dir():
        ckpt = select_checkpoint(path, None, lambda text: print(text, file=sys.stderr))
        return ckpt.state("model"), f"checkpoint {ckpt.path}", False
    if (path / "config.json").is_file():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"model.init_from={source!r}: a transformers folder without .safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(_read_safetensors(f))
        return state, f"transformers folder {path}", True
    raise CheckpointError(
        f"model.init_from={source!r} is not a run folder, a checkpoint folder, "
        "a .safetensors file or a transformers folder with config.json"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's own data_ptr does not tell tied tensors apart; its local shard's does.
    return t.to_local() if isinstance(t, DTensor) else t


def load_matching(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy state into model, which must match it exactly (tensors tied in the model may come once)."""
    expected = model.state_dict()
    by_storage: dict[int, list[str]] = {}
    for name, t in expected.items():
        by_storage.setdefault(_local(t).data_ptr(), []).append(name)
    missing = [n for n in expected if not any(alias in state for alias in by_storage[_local(expected[n]).data_ptr()])]
    unexpected = [n for n in state if n not in expected]
    shapes = [
        f"{n} {tuple(state[n].shape)} vs {tuple(t.shape)}"
        for n, t in expected.items()
        if n in state and state[n].shape != t.shape
    ]
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes)):
        if names:
            more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
            problems.append(f"{len(names)} {label}: {', '.join(names[:_SHOWN])}{more}")
    if problems:
        raise CheckpointError(f"model.init_from={source!r} does not match the model: {'; '.join(problems)}")
    with torch.no_grad():
        for name, t in expected.items():
            source_name = name if name in state else next(a for a in by_storage[_local(t).data_ptr()] if a in state)
            value = state[source_name].to(t.device, t.dtype)
            if isinstance(t, DTensor):  # FSDP: every rank holds the full value and keeps its own shard of it
                value = distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None)
            t.copy_(value)


def init_weights_from(model: nn.Module, source: str, model_cfg: Any) -> str:
    """Load model.init_from's weights into model (weights only); what was loaded, for the log."""
    from ddptrain.checkpoint.export_hf import gpt2_to_gpt
    from ddptrain.models.gpt import GPT
    from ddptrain.models.hf import HFCausalLM

    state, description, transformers_folder = read_weights(source)
    if transformers_folder and isinstance(model, HFCausalLM):
        state = {f"hf.{k}": v for k, v in state.items()}
    elif transformers_folder and isinstance(model, GPT):
        try:
            state = gpt2_to_gpt(state, model_cfg)
        except KeyError as e:
            raise CheckpointError(
                f"model.init_from={source!r} is not a GPT-2 folder matching the model: no tensor {e}"
            ) from None
    load_matching(model, state, source)
    return description
