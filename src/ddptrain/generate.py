"""`ddptrain generate RUN_DIR --prompt TEXT`: sample from the built-in GPT of a run's newest good checkpoint.

The prompt is encoded and the output decoded with the tokenizer of the data the run trained on
(raw bytes, or the `tokenizer.json` recorded in its meta.json).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ddptrain.checkpoint import newest_verified
from ddptrain.config import Config, ModelConfig
from ddptrain.data.corpus import read_meta
from ddptrain.data.tokenizer import Tokenizer, load_tokenizer_file
from ddptrain.errors import ConfigError, DataError
from ddptrain.models.gpt import GPT


def load_gpt(run_dir: Path, device: torch.device) -> tuple[GPT, Path, int]:
    """The built-in GPT of the newest verified checkpoint: (model in eval mode, checkpoint, step)."""
    ckpt = newest_verified(run_dir / "checkpoints", lambda text: print(text, file=sys.stderr))
    path = ckpt.path
    model_cfg = ModelConfig.model_validate(ckpt.manifest.config["model"])
    if model_cfg.target is not None or model_cfg.hf is not None or model_cfg.live is not None:
        raise ConfigError(f"{path.name} holds a user or transformers model; generate works with the built-in GPT only")
    model = GPT(model_cfg)
    model.load_state_dict(ckpt.state("model"))
    return model.to(device).eval(), path, ckpt.step


def data_tokenizer(run_dir: Path, data_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of data_dir's corpus, else of the data the run trained on (bytes when its corpus is gone
    or was byte-level); ConfigError for live datasets without data_dir."""
    if data_dir is None:
        cfg = Config.model_validate(__import__("yaml").safe_load((run_dir / "config.yaml").read_text()))
        if cfg.data.live is not None and cfg.data.target is None:
            raise ConfigError(
                f"data.live={cfg.data.live!r}: the run trained on live datasets passed to ddptrain.train(), whose "
                "tokenizer ddptrain does not know; pass --data-dir DIR (the prepared corpus its tokens come from)"
            )
        data_dir = Path(cfg.data.dir)
    try:
        meta = read_meta(data_dir)
    except DataError:
        return Tokenizer(None, 256, None)
    if not meta["tokenizer"]["file"]:
        return Tokenizer(None, 256, None)
    return load_tokenizer_file(data_dir / meta["tokenizer"]["file"])


def generate(
    run_dir: Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    data_dir: Path | None = None,
) -> tuple[str, Path]:
    """(prompt + max_new_tokens sampled tokens decoded with the data's tokenizer, checkpoint used).

    data_dir: the prepared corpus whose tokenizer to use (default: the run's data.dir)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, path, _ = load_gpt(run_dir, device)
    tokenizer = data_tokenizer(run_dir, data_dir)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ConfigError(f"the data's tokenizer has {tokenizer.vocab_size} tokens, the model {model.cfg.vocab_size}")
    ids = tokenizer.encode(prompt) or tokenizer.encode("\n")  # the model needs one token to condition on
    torch.manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
    return tokenizer.decode(out[0].tolist()), path
