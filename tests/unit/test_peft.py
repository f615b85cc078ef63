"""model.peft: the config section, the adapter-only state dict, the base digest, and the inputs refused in one line."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import one_line_exit_2
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.config import AdapterConfig, ModelConfig, load_config
from ddptrain.errors import ConfigError
from ddptrain.models.gpt import GPT
from ddptrain.models.peft import add_adapters, merge_adapters, state_digest

# find_spec, not importorskip: importing peft (transformers, torch._dynamo, scipy) takes seconds, which every
# pytest worker would spend while collecting; the tests that adapt a model import it when they need it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs the peft extra")

SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8}


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(**SHAPE))


def test_config_section_defaults_and_refusals() -> None:
    cfg = load_config(None, ["model.peft={r: 4, target_modules: [qkv]}"])
    assert cfg.model.peft == AdapterConfig(r=4, target_modules=["qkv"])
    assert (cfg.model.peft.type, cfg.model.peft.alpha, cfg.model.peft.dropout) == ("lora", 16, 0.0)
    assert load_config(None, []).model.peft is None
    for bad, named in [
        ("model.peft={type: ia3}", "model.peft.type"),
        ("model.peft={r: 0}", "model.peft.r"),
        ("model.peft={dropout: 1.0}", "model.peft.dropout"),
        ("model.peft={target_modules: []}", "target_modules"),
        ("model.peft={target_modules: ['  ']}", "target_modules"),
        ("model.peft={rank: 8}", "model.peft.rank"),
    ]:
        with pytest.raises(ConfigError, match=named):
            load_config(None, [bad])


class Parent(nn.Module):
    """Holds the adapted model under a prefix, as DDP holds its module under `module.`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


def test_state_dict_is_the_adapters_and_loads_alone_under_any_prefix() -> None:
    model = add_adapters(gpt(), AdapterConfig(r=2, dropout=0.1, target_modules=["qkv", "proj"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    state = model.state_dict()
    assert set(state) == trainable and len(trainable) == 2 * 2 * 2  # 2 blocks x (qkv, proj) x (A, B)
    assert all(".lora_A." in n or ".lora_B." in n for n in state)
    fresh = add_adapters(gpt(), AdapterConfig(r=2, dropout=0.1, target_modules=["qkv", "proj"]))
    changed = {k: v + 1 for k, v in state.items()}
    assert not fresh.load_state_dict(changed).missing_keys  # strict: the frozen base may be absent
    assert all(torch.equal(fresh.state_dict()[k], changed[k]) for k in changed)
    parent = Parent(fresh)
    prefixed = parent.state_dict()
    assert set(prefixed) == {f"module.{k}" for k in state}
    parent.load_state_dict(prefixed)
    with pytest.raises(RuntimeError, match="Missing key"):  # an adapter itself may not be missing
        fresh.load_state_dict(dict(list(changed.items())[1:]))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), flip=st.integers(0, 10_000))
def test_base_digest_tells_any_changed_weight(seed: int, flip: int) -> None:
    state = gpt(seed).state_dict()
    digest = state_digest(state)
    assert state_digest({k: v.clone() for k, v in reversed(list(state.items()))}) == digest  # order-free
    name = sorted(state)[flip % len(state)]
    changed = dict(state)
    changed[name] = (
        state[name]
        .clone()
        .view(-1)
        .index_add_(0, torch.tensor([flip % state[name].numel()]), torch.tensor([1e-3]))
        .view(state[name].shape)
    )
    assert state_digest(changed) != digest


def test_merged_model_computes_what_the_adapted_one_does() -> None:
    model = add_adapters(gpt(), AdapterConfig(r=2, target_modules=["qkv", "proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # lora_B starts at zero: make the adapters change the output
        idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        adapted = model.eval().base_model.model.logits(idx)
        assert not torch.allclose(adapted, gpt().eval().logits(idx))
        merged = merge_adapters(model)
        assert type(merged) is GPT
        torch.testing.assert_close(merged.logits(idx), adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["qkv", "q_proj"], "model.peft.target_modules: 'q_proj' matches no layer of GPT"),
        (["ln1"], "model.peft: peft cannot add LoRA adapters to GPT: Target module LayerNorm"),
        (None, "model.peft: peft cannot add LoRA adapters to GPT: Please specify `target_modules`"),
    ],
)
def test_targets_peft_cannot_adapt_are_one_line_errors(targets: list[str] | None, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as e:
        add_adapters(gpt(), AdapterConfig(target_modules=targets))
    assert "\n" not in str(e.value)


def test_already_adapted_model_and_missing_package_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    adapted = add_adapters(gpt(), AdapterConfig(target_modules=["qkv"]))
    with pytest.raises(ConfigError, match="already holds peft adapters"):
        add_adapters(adapted, AdapterConfig(target_modules=["qkv"]))
    monkeypatch.setitem(sys.modules, "peft", None)  # what `import peft` meets where the package is not installed
    with pytest.raises(ConfigError, match=r"model.peft needs the peft package; install .*ddptrain\[peft\]"):
        add_adapters(gpt(), AdapterConfig(target_modules=["qkv"]))


def test_train_refuses_bad_adapters_in_one_line(
    tiny_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    base = tmp_path / "base.safetensors"  # a base of TINY's shape, as `ddptrain export` writes one
    save_file(
        {k: v.clone() for k, v in GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)).state_dict().items()},
        str(base),
    )
    line = one_line_exit_2(["train", *tiny_args, "model.peft={target_modules: [qkv]}"], capsys)
    assert "model.peft trains adapters on a frozen base: set model.init_from" in line
    line = one_line_exit_2(
        ["train", *tiny_args, f"model.init_from={base}", "model.peft={target_modules: [qkv, nope]}"], capsys
    )
    assert "model.peft.target_modules: 'nope' matches no layer of GPT; its layer names end in" in line
    line = one_line_exit_2(
        ["train", *tiny_args, f"model.init_from={base}", "model.peft={target_modules: [ln1]}"], capsys
    )
    assert "peft cannot add LoRA adapters to GPT: Target module LayerNorm" in line


def test_transformers_loading_bar_shows_on_the_first_process_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 38, item 14: a pretrained model's "Loading weights" bar once per job (rank 0), not once per rank."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from ddptrain.config import HFModelConfig
    from ddptrain.models.hf import build_hf_model

    tiny = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    LlamaForCausalLM(tiny).save_pretrained(str(tmp_path))
    monkeypatch.delenv("DDPTRAIN_REPLICA_GROUP", raising=False)
    hf_logging.enable_progress_bar()  # as a fresh process has it (another test in this worker may have turned it off)
    try:
        for rank, shown in (("0", True), ("1", False)):
            monkeypatch.setenv("RANK", rank)
            capfd.readouterr()
            build_hf_model(HFModelConfig(pretrained=str(tmp_path)), 32)
            assert ("Loading weights" in capfd.readouterr().err) == shown, rank
    finally:
        hf_logging.enable_progress_bar()
