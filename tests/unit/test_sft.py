"""Instruction data (`prepare --sft`): records to tokens and loss masks, samples, the masked loss, bad records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import call_model, folder_bytes, load_token_datasets, one_line_exit_2
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

from ddptrain.config import ModelConfig
from ddptrain.data.collate import IGNORE_INDEX
from ddptrain.data.corpus import read_meta
from ddptrain.data.meta import parse_meta
from ddptrain.data.sft import LOSS, SftSpec, parse_sft, tokenize_records
from ddptrain.data.sft_dataset import SftDataset
from ddptrain.data.sources import plan_tasks
from ddptrain.data.tokenizer import Tokenizer, byte_tokenizer_json
from ddptrain.data.verify import verify_corpus
from ddptrain.dist import DistContext
from ddptrain.errors import DataError
from ddptrain.models.gpt import GPT
from ddptrain.train.data_input import micro_batch_weights

BYTES = Tokenizer(None, 256, None)
TEXT = st.text(alphabet="abcdefgh xyz", max_size=40)


def _samples(tmp: Path, records: list[dict[str, Any]], spec: SftSpec, block_size: int) -> SftDataset:
    """The records through prepare's tokenizing (raw bytes) and the dataset, without prepare's size minimum."""
    source = tmp / "records.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokens, mask, count, _ = tokenize_records(next(plan_tasks([source], 1 << 20)), spec, BYTES)
    assert count == len(records)
    tokens.tofile(tmp / "train-00000.bin")
    mask.tofile(tmp / "train-00000.mask")
    return SftDataset([tmp / "train-00000.bin"], [tmp / "train-00000.mask"], block_size)


def _check_samples(dataset: SftDataset, texts: list[tuple[bytes, bytes]], block_size: int) -> None:
    """texts: each record's (whole text, answer text, the answer at its end); the samples are the records
    with an answer byte at positions 1..block_size, truncated to block_size + 1 and padded."""
    usable = [(t, a) for t, a in texts if len(a) and len(t) - len(a) < block_size + 1 and len(t) > 1]
    assert len(dataset) == len(usable)
    for i, (text, answer) in enumerate(usable):
        sample = dataset[i]
        n = min(len(text), block_size + 1)
        assert bytes(sample["input_ids"][:n].tolist()) == text[:n]
        assert sample["attention_mask"].tolist() == [1] * n + [0] * (block_size + 1 - n)
        prompt = len(text) - len(answer)
        expected = [IGNORE_INDEX] * prompt + list(answer)
        assert sample["labels"].tolist() == (expected[:n] + [IGNORE_INDEX] * (block_size + 1 - n))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=12), st.integers(1, 48))
def test_prompt_completion_records_become_one_masked_sample_each(
    tmp_path_factory: pytest.TempPathFactory, pairs: list[tuple[str, str]], block_size: int
) -> None:
    tmp = tmp_path_factory.mktemp("pc")
    records = [{"prompt": p, "completion": c, "other": 1} for p, c in pairs]
    pairs = [(p, c) for p, c in pairs if p + c]  # a record of no bytes has no tokens: no sample
    if not any(len(c) and len(p) < block_size + 1 and len(p + c) > 1 for p, c in pairs):
        with pytest.raises(DataError, match="no record of this split has an answer token"):
            _samples(tmp, records, parse_sft("prompt,completion", None), block_size)
        return
    dataset = _samples(tmp, records, parse_sft("prompt,completion", None), block_size)
    _check_samples(dataset, [((p + c).encode(), c.encode()) for p, c in pairs], block_size)


ROLE = st.sampled_from(["system", "user", "tool"])


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.tuples(ROLE, TEXT), max_size=2), TEXT), min_size=1, max_size=3),
    st.integers(1, 160),
)
def test_chat_records_train_on_the_assistant_turns_only(
    tmp_path_factory: pytest.TempPathFactory, turns: list[tuple[list[tuple[str, str]], str]], block_size: int
) -> None:
    """The built-in template on raw bytes: <|role|>\\n{content}\\n per message; an assistant turn's answer is
    its content and newline (no end-of-document byte), after the <|assistant|>\\n header."""
    messages = []
    text, answers = b"", []
    for prompts, reply in turns:
        for role, content in prompts:
            messages.append({"role": role, "content": content})
            text += f"<|{role}|>\n{content}\n".encode()
        messages.append({"role": "assistant", "content": reply})
        text += b"<|assistant|>\n"
        answers.append((len(text), f"{reply}\n".encode()))
        text += f"{reply}\n".encode()
    tmp = tmp_path_factory.mktemp("chat")
    spec = parse_sft("messages", None).for_tokenizer("")
    if answers[0][0] > block_size:  # the prompt fills the block: the record's sample would train nothing
        with pytest.raises(DataError, match="no record of this split has an answer token"):
            _samples(tmp, [{"messages": messages}], spec, block_size)
        return
    sample = _samples(tmp, [{"messages": messages}], spec, block_size)[0]
    n = min(len(text), block_size + 1)
    labels = [IGNORE_INDEX] * len(text)
    for at, answer in answers:
        labels[at : at + len(answer)] = list(answer)
    assert bytes(sample["input_ids"][:n].tolist()) == text[:n]
    assert sample["labels"][:n].tolist() == labels[:n]


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer_folder(folder: Path, template: str = CHATML) -> Path:
    """A transformers tokenizer folder: byte-level tokenizer.json with ChatML's special tokens, and a chat template."""
    from tokenizers import Tokenizer as HFTokenizer

    folder.mkdir()
    byte_tokenizer_json(folder / "tokenizer.json")
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    hf.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_prepare_sft_with_a_tokenizer_folders_chat_template_verifies_its_masks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddptrain.cli import main
    from ddptrain.data.tokenizer import load_tokenizer_file

    source = tmp_path / "chat.jsonl"
    conversation = [{"role": "user", "content": "What is 2+2? " * 3}, {"role": "assistant", "content": "4, sure."}]
    source.write_text("".join(json.dumps({"messages": conversation, "id": i}) + "\n" for i in range(60)))
    folder, out = _tokenizer_folder(tmp_path / "tok"), tmp_path / "corpus"
    argv = ["prepare", str(source), "--out", str(out), "--sft", "messages", "--tokenizer", str(folder)]
    assert main([*argv, "--workers", "2", "--val-fraction", "0.2"]) == 0
    assert "(60 documents)" in capsys.readouterr().out
    meta = read_meta(out)
    assert meta["sft"]["fields"] == ["messages"] and meta["sft"]["template"] == "tokenizer"
    verify_corpus(out, meta)
    train, val = load_token_datasets(out, 96)
    assert len(train) + len(val) == 60 and len(val) >= 1  # records are whole: none split between the splits
    tokenizer = load_tokenizer_file(out / "tokenizer.json")
    sample = train[0]
    shown = tokenizer.decode([t for t in sample["input_ids"].tolist()[: int(sample["attention_mask"].sum())]])
    assert shown == f"<|im_start|>user\n{'What is 2+2? ' * 3}<|im_end|>\n<|im_start|>assistant\n4, sure.<|im_end|>\n"
    answer = [t for t in sample["labels"].tolist() if t != IGNORE_INDEX]
    assert tokenizer.decode(answer) == "4, sure.<|im_end|>\n"

    # meta.json must list a mask for every shard of instruction data, and only there.
    raw = json.loads((out / "meta.json").read_text())
    del raw["shards"]["val"][0]["mask"]
    with pytest.raises(DataError, match=r"shards.val.0.mask: required with sft"):
        parse_meta(json.dumps(raw).encode(), out / "meta.json")

    # A mask changed after prepare is refused like a changed token shard.
    mask = out / "train-00000.mask"
    data = bytearray(mask.read_bytes())
    data[3] ^= LOSS
    mask.write_bytes(bytes(data))
    with pytest.raises(DataError, match="train-00000.mask: its bytes do not match meta.json"):
        verify_corpus(out, read_meta(out))


@pytest.mark.parametrize(
    ("sft", "bad", "message"),
    [
        ("prompt,completion", {"prompt": "p"}, "no string field 'completion' (--sft prompt,completion)"),
        ("messages", {"messages": [{"role": "robot", "content": "hi"}]}, "message 0 of 'messages' must be"),
        ("messages", {"messages": "hello"}, "field 'messages' must be a non-empty list"),
        ("messages", {"messages": [{"role": "user", "content": "hi"}]}, "field 'messages' has no assistant message"),
        ("messages", ["not", "an", "object"], "a record must be a JSON object, not list"),
    ],
)
def test_a_bad_record_exits_2_naming_file_and_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sft: str, bad: Any, message: str
) -> None:
    good = {"prompt": "p", "completion": "c", "messages": [{"role": "assistant", "content": "c"}]}
    source = tmp_path / "records.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [good, good, bad, good]))
    out = tmp_path / "out"
    out.mkdir()
    before = folder_bytes(out)
    line = one_line_exit_2(["prepare", str(source), "--out", str(out), "--sft", sft], capsys)
    assert f"{source}, line 3: {message}" in line
    assert folder_bytes(out) == before


CONTENT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.timeout(120, method="thread")  # a rendering that never ends fails the run instead of hanging it
@pytest.mark.parametrize(
    ("template", "message", "workers"),
    [
        (  # nested loops over large ranges: 10^10 iterations
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CONTENT,
            "the chat template was stopped: it ran past its limit of 0.5 s per record",
            "2",
        ),
        ("{{ 'x' * 1000000000 }}", "a repetition would be larger than 16,777,216 items", "1"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "namespace attribute 's' would be larger than 16,777,216 items",
            "1",
        ),
        ("{% for i in range(2000) %}{{ 'y' * 10000 }}{% endfor %}", "its output would be larger than 16,777,216", "1"),
        ("{{ 10 ** 1000000000 }}", "a power would be larger than 16,777,216 bits", "1"),
        ("{% for i in range(10000000) %}{% endfor %}", "OverflowError: Range too big", "1"),
        ("{{ ''.__class__.__mro__ }}", "access to attribute '__class__' of 'str' object is unsafe", "1"),
        ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "RecursionError: maximum recursion depth", "1"),
        ("{{ raise_exception('no tools here') }}", "the chat template refused the record: no tools here", "1"),
        ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero", "1"),
        ("{% for %}", "the chat template failed on it: Expected an expression", "1"),
    ],
    ids=["loops", "repeat", "namespace", "output", "power", "range", "unsafe", "recursion", "raise", "zero", "syntax"],
)
def test_a_chat_template_that_never_ends_or_fails_exits_2_in_one_line_and_leaves_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    template: str,
    message: str,
    workers: str,
) -> None:
    """Rendering is bounded in time (RENDER_TIME_S per record, 0.5 s here to keep the test short; forked workers
    inherit it) and size; whatever the template does, prepare exits 2 with the record's line, and the --out it
    would have made (its private folder and lock within) is gone."""
    from ddptrain.data import chat_template

    monkeypatch.setattr(chat_template, "RENDER_TIME_S", 0.5)
    source = tmp_path / "chat.jsonl"
    conversation = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    source.write_text("".join(json.dumps({"messages": conversation}) + "\n" for _ in range(40)))
    folder, out = _tokenizer_folder(tmp_path / "tok", template), tmp_path / "new" / "corpus"
    argv = ["prepare", str(source), "--out", str(out), "--sft", "messages", "--tokenizer", str(folder)]
    line = one_line_exit_2([*argv, "--workers", workers], capsys)
    assert f"{source}, line 1: " in line and message in line, line
    assert not (tmp_path / "new").exists()


def test_masked_loss_is_the_mean_over_answer_tokens_of_all_micro_batches(tmp_path: Path) -> None:
    """The trainer's weighting (train/data_input.py) of each micro-batch's mean loss sums to the mean of every
    answer token's loss, computed here by hand; the mean of the micro-batches' means does not."""
    torch.manual_seed(0)
    records = [{"prompt": "q" * (i % 5), "completion": "ab" * (1 + 3 * i)} for i in range(5)]
    dataset = _samples(tmp_path, records, parse_sft("prompt,completion", None), 12)
    model = GPT(ModelConfig(vocab_size=256, block_size=12, n_layer=1, n_head=2, n_embd=16)).double()
    batches = [default_collate([dataset[i] for i in ids]) for ids in ([0, 1], [2, 3, 4])]
    weights = micro_batch_weights(batches, DistContext())
    assert weights is not None
    losses = [call_model(model, batch, "gpt") for batch in batches]
    weighted = sum(loss * weight for loss, weight in zip(losses, weights))

    token_losses = []
    for batch in batches:
        log_probs = F.log_softmax(model.logits(batch["input_ids"][:, :-1]), dim=-1)
        for row, labels in zip(log_probs, batch["labels"][:, 1:]):
            token_losses += [-row[t, label] for t, label in enumerate(labels.tolist()) if label != IGNORE_INDEX]
    by_hand = torch.stack(token_losses).mean()
    # record i: prompt p = i % 5 bytes, answer 2 + 6i bytes; targets at positions 1..12 of its answer's
    assert len(token_losses) == sum(min(i % 5 + 1 + 6 * i, 12) - max(i % 5, 1) + 1 for i in range(5))
    assert abs(weighted.item() - by_hand.item()) < 1e-6
    assert abs((sum(losses) / 2).item() - by_hand.item()) > 1e-3  # the mean of means weights tokens unequally
    grads = torch.autograd.grad(weighted, list(model.parameters()))
    hand_grads = torch.autograd.grad(by_hand, list(model.parameters()))
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(grads, hand_grads))
    windows = (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    assert micro_batch_weights([windows], DistContext()) is None  # corpus windows: 1/accum, as before
