"""`ddptrain generate RUN_DIR --prompt TEXT`: sample from the built-in GPT of a run's newest good checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ddptrain.checkpoint import load_file, newest_verified
from ddptrain.config import ModelConfig
from ddptrain.errors import ConfigError
from ddptrain.models.gpt import GPT


def load_gpt(run_dir: Path, device: torch.device) -> tuple[GPT, Path, int]:
    """The built-in GPT of the newest verified checkpoint: (model in eval mode, checkpoint, step)."""
    path, manifest = newest_verified(run_dir / "checkpoints", lambda text: print(text, file=sys.stderr))
    model_cfg = ModelConfig.model_validate(manifest["config"]["model"])
    if model_cfg.target is not None:
        raise ConfigError(f"{path.name} holds a user model ({model_cfg.target}); generate works with the built-in GPT only")
    if model_cfg.vocab_size != 256:
        raise ConfigError(f"generate decodes bytes, but this GPT has vocab_size={model_cfg.vocab_size}, not 256")
    model = GPT(model_cfg)
    model.load_state_dict(load_file(path, "model.pt"))
    return model.to(device).eval(), path, int(manifest["step"])


def generate(run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None,
             seed: int) -> tuple[str, Path]:
    """(prompt + max_new_tokens sampled bytes decoded as UTF-8 with invalid bytes replaced, checkpoint used)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, path, _ = load_gpt(run_dir, device)
    prompt_bytes = prompt.encode("utf-8")
    if not prompt_bytes:
        prompt_bytes = b"\n"  # the model needs at least one token to condition on
    torch.manual_seed(seed)
    idx = torch.tensor([list(prompt_bytes)], dtype=torch.long, device=device)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace"), path
