"""`export --format hf` carries the data's separator as eos/bos/pad, and transformers' `generate` stops there."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from ddptrain.checkpoint.export_hf import export_hf
from ddptrain.config import ModelConfig
from ddptrain.data.corpus import prepare_corpus
from ddptrain.data.prepare import PrepareOptions
from ddptrain.models import build_model
from ddptrain.models.gpt import GPT

pytestmark = pytest.mark.dist
pytest.importorskip("transformers", reason="needs the hf extra (transformers, tokenizers)")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 300,
    "max_position_embeddings": 32,
}


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    prepare_corpus([STDLIB / "textwrap.py"], out, 0.1, PrepareOptions(tokenizer="train:300", workers=1))
    return out


def gpt_that_always_says_eos(eos: int) -> tuple[GPT, ModelConfig]:
    """A GPT whose last hidden state is constant (ln_f weight 0, bias e0) and whose only e0 component is eos's."""
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=300, bias=True)
    model = GPT(cfg)
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.zero_()
        model.ln_f.bias[0] = 1.0
        model.wte.weight[:, 0] = 0.0  # tied: the output layer's logits are wte @ e0 = column 0
        model.wte.weight[eos, 0] = 10.0
    return model.eval(), cfg


def special_ids(folder: Path) -> list[tuple[object, object, object]]:
    out = []
    for name in ("config.json", "generation_config.json"):
        c = json.loads((folder / name).read_text())
        out.append((c.get("eos_token_id"), c.get("bos_token_id"), c.get("pad_token_id")))
    return out


@pytest.mark.timeout(180)
def test_bpe_export_names_eos_bos_pad_and_generate_stops_at_eos(
    bpe_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    eos = json.loads((bpe_corpus / "meta.json").read_text())["eos_id"]
    model, cfg = gpt_that_always_says_eos(eos)
    summary = export_hf(model, cfg, bpe_corpus, tmp_path / "gpt2")
    assert f"eos/bos/pad '<|endoftext|>' (id {eos})" in summary
    assert special_ids(tmp_path / "gpt2") == [(eos, eos, eos)] * 2

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "gpt2"), local_files_only=True)
    assert (tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token) == ("<|endoftext|>",) * 3
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.pad_token_id == eos
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gpt2"), local_files_only=True).eval()
    prompt = tokenizer("def wrap(text):", return_tensors="pt")
    out = hf.generate(**prompt, max_new_tokens=12, do_sample=False)
    # The generation config's eos ends it after one token; without it generate runs all 12.
    assert out.shape[1] == prompt.input_ids.shape[1] + 1 and out[0, -1].item() == eos

    llama = build_model(ModelConfig(hf={"config": LLAMA}, block_size=32))  # LlamaConfig's own ids: bos 1, eos 2
    export_hf(llama, ModelConfig(hf={"config": LLAMA}, block_size=32), bpe_corpus, tmp_path / "llama")
    assert special_ids(tmp_path / "llama") == [(eos, eos, eos)] * 2


@pytest.mark.timeout(120)
def test_byte_export_has_no_special_tokens(corpus_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)
    summary = export_hf(GPT(cfg).eval(), cfg, corpus_dir, tmp_path / "bytes")
    assert "(bytes, no special tokens)" in summary
    assert special_ids(tmp_path / "bytes") == [(None, None, None)] * 2
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "bytes"), local_files_only=True)
    assert tokenizer.eos_token is None and tokenizer.pad_token is None


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = [{"role": "user", "content": "What is 2+2? " * 3}, {"role": "assistant", "content": "4, sure."}]


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Chat records prepared with a tokenizer folder's ChatML template (its eos: <|im_end|>)."""
    from tokenizers import Tokenizer as HFTokenizer

    from ddptrain.data.tokenizer import byte_tokenizer_json

    tmp = tmp_path_factory.mktemp("chat")
    folder = tmp / "tok"
    folder.mkdir()
    hf = HFTokenizer.from_file(str(byte_tokenizer_json(folder / "tokenizer.json")))
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    hf.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))  # <unk> is no token: left out of the export
    source = tmp / "chat.jsonl"
    source.write_text("".join(json.dumps({"messages": CHAT, "id": i}) + "\n" for i in range(60)))
    options = PrepareOptions(tokenizer=str(folder), sft="messages", workers=1)
    return prepare_corpus([source], tmp / "corpus", 0.2, options).out_dir


@pytest.mark.timeout(120)
def test_chat_data_export_carries_its_template_and_end_of_turn(chat_corpus: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from ddptrain.checkpoint.export_hf import write_tokenizer

    cfg = ModelConfig(hf={"config": {**LLAMA, "vocab_size": 259}}, block_size=32)
    summary = export_hf(build_model(cfg), cfg, chat_corpus, tmp_path / "hf")
    assert "eos/pad '<|im_end|>' (id 257), bos '<|im_start|>' (id 256), the chat template (tokenizer)" in summary
    assert special_ids(tmp_path / "hf") == [(257, 256, 257)] * 2  # generation stops at the end of the turn
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert (tokenizer.bos_token_id, tokenizer.unk_token, len(tokenizer)) == (256, None, 259)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert rendered == f"<|im_start|>user\n{'What is 2+2? ' * 3}<|im_end|>\n<|im_start|>assistant\n4, sure.<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and tokenizer.eos_token == "<|im_end|>"

    # --format peft writes the same tokenizer beside the adapters; a corpus prepared before meta.json kept the
    # template says so instead of exporting a tokenizer that silently has none.
    (tmp_path / "peft").mkdir()
    assert "the chat template (tokenizer)" in write_tokenizer(chat_corpus, tmp_path / "peft")
    assert AutoTokenizer.from_pretrained(str(tmp_path / "peft")).apply_chat_template(CHAT, tokenize=False) == rendered
    meta = json.loads((chat_corpus / "meta.json").read_text())
    del meta["sft"]["chat_template"]
    older = Path(shutil.copytree(chat_corpus, tmp_path / "older"))
    (older / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "old").mkdir()
    assert "no chat template: the corpus was prepared before" in write_tokenizer(older, tmp_path / "old")
