"""`ddptrain export --format hf`: a checkpoint as a folder `transformers.AutoModelForCausalLM` loads.

A `model.hf` model is written with its own `save_pretrained`. The built-in GPT maps exactly onto
transformers' GPT-2: learned position embeddings, pre-norm blocks, LayerNorm eps 1e-5, tanh-GELU
(GPT-2's `gelu_new`), fused q/k/v in that order, tied output embedding. Two differences are
bridged: GPT-2's Conv1D layers store weights as (in, out), the transpose of nn.Linear, and GPT-2
always has biases, so a bias-free GPT exports zero biases (the same function). The data's
tokenizer goes into the folder too, and its document separator becomes eos, bos and pad in
config.json, generation_config.json and the tokenizer files (SpecialTokens), so `generate` stops.
Chat data (`prepare --sft MESSAGES`) brings its chat template and the special tokens it rendered
with (meta.json records both): the tokenizer files carry them, so `apply_chat_template` on the
export renders what training saw, and the template's eos (its end of turn) is the export's eos.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ddptrain.config import ModelConfig
from ddptrain.data.corpus import read_meta
from ddptrain.data.tokenizer import TOKENIZER_FILE, byte_tokenizer_json, require_hf
from ddptrain.errors import ConfigError, DataError

# (ours, GPT-2's, transposed): transposed marks nn.Linear weights that GPT-2 keeps in Conv1D.
_BLOCK_MAP = (
    ("ln1", "ln_1", False),
    ("attn.qkv", "attn.c_attn", True),
    ("attn.proj", "attn.c_proj", True),
    ("ln2", "ln_2", False),
    ("mlp.0", "mlp.c_fc", True),
    ("mlp.2", "mlp.c_proj", True),
)


@dataclass(frozen=True)
class SpecialTokens:
    """The data's special tokens as the export carries them: eos, bos and pad are one token or absent.

    The corpus puts its separator (meta.json's eos_id: `<|endoftext|>` in a BPE trained here, the tokenizer's
    `<|endoftext|>` or last special token in a tokenizer.json) after every document, so it ends one document
    and begins the next (eos and bos, as in GPT-2), and it pads (transformers' usual choice for GPT-2). Raw
    bytes have no separator: eos, bos and pad stay unset, so generation stops only at max_new_tokens.
    Chat data names its own (`named`: the template's bos/eos/pad/unk that are tokens of the vocabulary): its
    eos is then text and id, and its bos and pad replace the separator there.
    """

    text: str | None = None
    id: int | None = None
    named: tuple[tuple[str, str, int], ...] = ()  # chat data's (key, token, id): bos_token, eos_token, ...

    def id_of(self, key: str) -> int | None:
        """The id of the token chat data names for key ('bos_token', 'pad_token'), else the eos/separator's."""
        return next((i for k, _, i in self.named if k == key), self.id)


def gpt2_config(cfg: ModelConfig, eos_id: int | None) -> Any:
    """The transformers GPT2Config computing the same function as the built-in GPT of cfg."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def gpt_to_gpt2(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The built-in GPT's state dict under GPT-2's names and layouts."""
    out = {
        "transformer.wte.weight": state["wte.weight"],
        "transformer.wpe.weight": state["wpe.weight"],
        "lm_head.weight": state["wte.weight"],
    }
    for i in range(cfg.n_layer):
        for ours, theirs, transposed in _BLOCK_MAP:
            w = state[f"blocks.{i}.{ours}.weight"]
            out[f"transformer.h.{i}.{theirs}.weight"] = w.t().contiguous() if transposed else w
            out[f"transformer.h.{i}.{theirs}.bias"] = state.get(f"blocks.{i}.{ours}.bias", torch.zeros(w.shape[0]))
    out["transformer.ln_f.weight"] = state["ln_f.weight"]
    out["transformer.ln_f.bias"] = state.get("ln_f.bias", torch.zeros_like(state["ln_f.weight"]))
    return out


def gpt2_to_gpt(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of gpt_to_gpt2 (for model.init_from a GPT-2 folder); biases are dropped when cfg.bias is off."""
    out = {"wte.weight": state["transformer.wte.weight"], "wpe.weight": state["transformer.wpe.weight"]}
    for i in range(cfg.n_layer):
        for ours, theirs, transposed in _BLOCK_MAP:
            w = state[f"transformer.h.{i}.{theirs}.weight"]
            out[f"blocks.{i}.{ours}.weight"] = w.t().contiguous() if transposed else w
            if cfg.bias:
                out[f"blocks.{i}.{ours}.bias"] = state[f"transformer.h.{i}.{theirs}.bias"]
    out["ln_f.weight"] = state["transformer.ln_f.weight"]
    if cfg.bias:
        out["ln_f.bias"] = state["transformer.ln_f.bias"]
    return out


def special_tokens(data_dir: Path | None) -> SpecialTokens:
    """The export's eos of data_dir's corpus: the chat template's eos token when chat data names one that is a
    token of the vocabulary, else the separator (SpecialTokens' docstring); empty for bytes, no corpus or no
    data_dir."""
    if data_dir is None or not (data_dir / "meta.json").is_file():
        return SpecialTokens()
    meta = read_meta(data_dir)
    eos_id = meta.get("eos_id")
    if eos_id is None or not meta["tokenizer"]["file"]:
        return SpecialTokens()
    from tokenizers import Tokenizer as HFTokenizer

    vocab = HFTokenizer.from_file(str(data_dir / meta["tokenizer"]["file"]))
    # Only tokens of the vocabulary: transformers would append any other as a new id the model has no row for.
    named = tuple(
        (key, text, int(i)) for key, text in _chat_tokens(meta).items() if (i := vocab.token_to_id(text)) is not None
    )
    turn_end = next(((text, i) for key, text, i in named if key == "eos_token"), None)
    if turn_end is not None:
        return SpecialTokens(*turn_end, named)
    text = vocab.id_to_token(eos_id)
    return SpecialTokens(text, eos_id, named) if text is not None else SpecialTokens()


def _chat_tokens(meta: dict[str, Any]) -> dict[str, str]:
    """The special tokens chat data's template rendered with (bos_token, eos_token, ...; empty ones left out)."""
    named = (meta.get("sft") or {}).get("special_tokens") or {}
    return {key: text for key, text in named.items() if text}


def _chat_template(meta: dict[str, Any]) -> tuple[str | None, str]:
    """Chat data's template (None for other data, and for chat data prepared before meta.json kept it) and the
    words naming it in the export's summary."""
    sft = meta.get("sft") or {}
    if sft.get("template") is None:
        return None, ""
    if sft.get("chat_template") is None:
        return None, ", no chat template: the corpus was prepared before exports carried it (prepare it again)"
    return str(sft["chat_template"]), f", the chat template ({sft['template']})"


def write_tokenizer(data_dir: Path, out: Path, special: SpecialTokens | None = None) -> str:
    """Write data_dir's tokenizer into out as transformers files, with the special tokens (default:
    special_tokens(data_dir)) and chat data's template and special tokens; a line saying what was written."""
    from transformers import PreTrainedTokenizerFast

    try:
        meta = read_meta(data_dir)
        special = special_tokens(data_dir) if special is None else special
    except DataError as e:
        return f"no tokenizer written ({e})"
    if meta["tokenizer"]["file"]:
        source = data_dir / meta["tokenizer"]["file"]
    else:
        source = byte_tokenizer_json(out / TOKENIZER_FILE)
    tok = special.text
    named: dict[str, str | None] = {"eos_token": tok, "bos_token": tok, "pad_token": tok}
    named |= {key: text for key, text, _ in special.named}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source), **named)
    template, about_template = _chat_template(meta)
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
    said = _described(special)
    return f"tokenizer of {data_dir} ({meta['tokenizer']['kind']}, {said}{about_template})"


def _described(special: SpecialTokens) -> str:
    """ "eos/bos/pad '<|endoftext|>' (id 0)", or each distinct token with its roles; "no special tokens"."""
    if special.text is None:
        return "no special tokens"
    roles: dict[tuple[str, int | None], list[str]] = {}
    for role in ("eos", "bos", "pad"):
        text = next((t for k, t, _ in special.named if k == f"{role}_token"), special.text)
        roles.setdefault((text, special.id_of(f"{role}_token")), []).append(role)
    return ", ".join(f"{'/'.join(names)} {text!r} (id {i})" for (text, i), names in roles.items())


def _set_special_ids(hf_model: Any, special: SpecialTokens) -> None:
    """The data's separator (or chat data's own tokens) as eos/bos/pad in a transformers model's config and
    generation config."""
    if special.id is None:
        return  # bytes: nothing to set, and a model.hf config keeps its own
    for config in (hf_model.config, hf_model.generation_config):
        config.eos_token_id = special.id
        config.bos_token_id, config.pad_token_id = special.id_of("bos_token"), special.id_of("pad_token")


def export_hf(model: nn.Module, model_cfg: ModelConfig, data_dir: Path | None, out: Path) -> str:
    """Write model (built from model_cfg, weights loaded) to out for transformers; a summary line."""
    require_hf("export --format hf")
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one summary line instead of tqdm bars on stderr

    from ddptrain.models.gpt import GPT
    from ddptrain.models.hf import HFCausalLM

    out.mkdir(parents=True, exist_ok=True)
    special = special_tokens(data_dir)
    if isinstance(model, HFCausalLM):
        hf_model = model.hf
        kind = f"transformers {type(model.hf).__name__}"
    elif isinstance(model, GPT):
        hf_model = GPT2LMHeadModel(gpt2_config(model_cfg, special.id))
        result = hf_model.load_state_dict(gpt_to_gpt2(model.state_dict(), model_cfg), strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ConfigError(
                f"GPT-2 mapping incomplete: missing {result.missing_keys[:4]}, unexpected {result.unexpected_keys[:4]}"
            )
        kind = "GPT-2 (GPT2LMHeadModel) mapped from the built-in GPT"
    else:
        raise ConfigError(f"--format hf exports the built-in GPT and model.hf models, not {type(model).__name__}")
    _set_special_ids(hf_model, special)
    hf_model.save_pretrained(str(out))
    tok = write_tokenizer(data_dir, out, special) if data_dir is not None else "no tokenizer (data.target run)"
    return f"{kind}; {tok}"
