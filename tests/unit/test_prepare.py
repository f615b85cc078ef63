"""Prepare: tokenizers, shards, JSON Lines, the legacy format, and samples independent of the shard size."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import load_token_datasets, one_line_exit_2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddptrain.data.corpus import PrepareOptions, prepare_corpus, read_meta
from ddptrain.data.shards import ShardWriter, TokenSequence
from ddptrain.data.tokenizer import load_tokenizer_file, sha256_file, smallest_dtype
from ddptrain.data.verify import verify_corpus
from ddptrain.errors import ConfigError, DataError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = [STDLIB / n for n in ("argparse.py", "typing.py", "inspect.py", "textwrap.py", "json/decoder.py")]


@pytest.mark.parametrize(
    "vocab, dtype", [(2, "uint8"), (256, "uint8"), (257, "uint16"), (65536, "uint16"), (65537, "uint32")]
)
def test_smallest_dtype(vocab: int, dtype: str) -> None:
    assert smallest_dtype(vocab).name == dtype


@given(sizes=st.lists(st.integers(0, 300), max_size=6), shard=st.integers(31, 97))
@settings(max_examples=25, deadline=None)  # every shard is fsynced: keep their number small
def test_shards_are_one_sequence_whatever_the_cut(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], shard: int
) -> None:
    out = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(len(sizes) * 1000 + shard)
    chunks = [rng.integers(0, 60000, n).astype(np.uint16) for n in sizes]
    writer = ShardWriter(out, "train", shard, np.dtype(np.uint16))
    for c in chunks:
        writer.append(c)
    shards = writer.finish()
    whole = np.concatenate(chunks) if chunks else np.zeros(0, np.uint16)
    assert all(s["tokens"] == shard for s in shards[:-1]) and sum(s["tokens"] for s in shards) == len(whole)
    assert not list(out.glob(".*.tmp"))
    if len(whole):
        seq = TokenSequence([out / s["file"] for s in shards], np.dtype(np.uint16))
        lo, hi = sorted(rng.integers(0, len(whole) + 1, 2))
        assert np.array_equal(seq.slice(int(lo), int(hi)), whole[lo:hi])


def test_samples_do_not_depend_on_the_shard_size(tmp_path: Path) -> None:
    said: list[str] = []  # a line per task (each file is one) at progress_every_s=0: a long prepare is never silent
    a = prepare_corpus(
        FILES, tmp_path / "a", 0.1, PrepareOptions(task_bytes=1 << 14, progress_every_s=0), say=said.append
    ).out_dir
    total = sum(p.stat().st_size for p in FILES) / 1e6
    assert len(said) == len(FILES) and all(line.startswith("prepare: tokenized ") and "\n" not in line for line in said)
    assert said[-1].startswith(f"prepare: tokenized {total:.1f} of {total:.1f} MB of input (100%), ")
    b = prepare_corpus(FILES, tmp_path / "b", 0.1, PrepareOptions(task_bytes=1 << 14, shard_tokens=5000)).out_dir
    assert len(read_meta(b)["shards"]["train"]) > 5
    for (ta, va), (tb, vb) in [(load_token_datasets(a, 64), load_token_datasets(b, 64))]:
        assert len(ta) == len(tb) and len(va) == len(vb)
        for i in [0, 1, len(ta) // 2, len(ta) - 1]:
            assert all(torch.equal(x, y) for x, y in zip(ta[i], tb[i]))


def test_bytes_is_the_historic_corpus(tmp_path: Path) -> None:
    """One task: the last val_fraction of all bytes is validation, exactly as before shards existed."""
    info = prepare_corpus(FILES[:3], tmp_path, 0.1)
    raw = b"".join(p.read_bytes() for p in FILES[:3])
    meta = read_meta(tmp_path)
    assert (meta["dtype"], meta["vocab_size"], meta["eos_id"], meta["tokenizer"]["file"]) == ("uint8", 256, None, None)
    n_val = int(len(raw) * 0.1)
    train = np.fromfile(tmp_path / meta["shards"]["train"][0]["file"], np.uint8)
    assert info.val_tokens == n_val and train.tobytes() == raw[: len(raw) - n_val]


def legacy_meta(train: int, val: int, sha256: str) -> dict[str, object]:
    """A meta.json as the prepare from before shards wrote it (one SHA-256 of train.bin + val.bin)."""
    return {"vocab_size": 256, "dtype": "uint8", "files": 2, "train_tokens": train, "val_tokens": val, "sha256": sha256}


def test_legacy_single_file_corpus_still_loads(tmp_path: Path) -> None:
    raw = b"".join(p.read_bytes() for p in FILES[:2])
    data = np.frombuffer(raw, np.uint8)
    data[:-5000].tofile(tmp_path / "train.bin")
    data[-5000:].tofile(tmp_path / "val.bin")
    meta = legacy_meta(len(data) - 5000, 5000, hashlib.sha256(raw).hexdigest())
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    verify_corpus(tmp_path, read_meta(tmp_path))  # its one SHA-256 covers both files
    train, val = load_token_datasets(tmp_path, 32)
    assert len(val) == 4999 // 32
    assert bytes(train[0][0].tolist()) == data[:32].tobytes()


def test_trained_bpe_round_trips_and_separates_documents(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    said: list[str] = []
    options = PrepareOptions(tokenizer="train:2048", workers=2, task_bytes=1 << 15, progress_every_s=0.01)
    info = prepare_corpus(FILES, tmp_path, 0.1, options, say=said.append)
    assert any(line.startswith("prepare: training a BPE of 2048 tokens: ") for line in said), said[:3]
    meta = read_meta(tmp_path)
    tok = load_tokenizer_file(tmp_path / "tokenizer.json")
    assert (meta["vocab_size"], meta["dtype"], meta["eos_id"]) == (2048, "uint16", tok.eos_id)
    assert meta["tokenizer"]["sha256"] == sha256_file(tmp_path / "tokenizer.json")
    for path in FILES:
        text = path.read_text()
        assert tok.decode(tok.encode(text)) == text
    tokens = np.concatenate(
        [np.fromfile(tmp_path / s["file"], np.uint16) for split in ("train", "val") for s in meta["shards"][split]]
    )
    assert int((tokens == tok.eos_id).sum()) == info.documents == len(FILES)
    assert info.train_tokens + info.val_tokens < sum(p.stat().st_size for p in FILES) / 2  # BPE compresses


def test_jsonl_documents_and_bad_lines(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    lines = [json.dumps({"text": p.read_text(), "id": i}) for i, p in enumerate(FILES)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    info = prepare_corpus(
        [tmp_path / "docs.jsonl"], tmp_path / "out", 0.1, PrepareOptions(tokenizer="train:512", task_bytes=1 << 14)
    )
    assert info.documents == len(FILES)
    with pytest.raises(DataError, match="no string field 'body'"):
        prepare_corpus([tmp_path / "docs.jsonl"], tmp_path / "out2", 0.1, PrepareOptions(text_field="body"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match="invalid JSON in the line at byte 17"):
        prepare_corpus([tmp_path / "bad.jsonl"], tmp_path / "out3", 0.1)


NOT_UTF8 = [b"\xe9", b"\xff", b"\xc3(", b"\xf0\x90\x80"]
SURROGATES = [b"\\ud800", b"\\udfff", b"\xed\xa0\x80"]  # JSON's escape, or UTF-8's form of it: no UTF-8 text
DEEP = st.tuples(st.sampled_from([("[", "]"), ('{"a":', "}")]), st.integers(2_000, 100_000))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bad=st.one_of(st.tuples(st.sampled_from(NOT_UTF8 + SURROGATES), st.integers(0, 40)), DEEP),
    sft=st.booleans(),
    good=st.integers(0, 3),
)
def test_a_jsonl_line_not_utf8_or_nested_too_deep_exits_2_in_one_line(
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    bad: tuple[Any, int],
    sft: bool,
    good: int,
) -> None:
    """Bytes that are not UTF-8 or a lone surrogate inside a record, or a record nested deeper than json can
    parse (up to 100,000 deep: a RecursionError inside json): exit 2, one line naming the file and the line,
    no --out left behind."""
    tmp = tmp_path_factory.mktemp("jsonl")
    record = {"text": "fine " * 10, "prompt": "p", "completion": "c"}
    lines = [json.dumps(record).encode()] * good
    if isinstance(bad[0], bytes):
        text, at = b"x" * 40, bad[1]
        value = text[:at] + bad[0] + text[at:]
        lines.append(b'{"text": "' + value + b'", "prompt": "p", "completion": "' + value + b'"}')
        what = "a lone surrogate" if bad[0] in SURROGATES else "bytes that are not UTF-8"
    else:
        (opening, closing), depth = bad
        lines.append((opening * depth + "1" + closing * depth).encode())
        what = "JSON nested too deep"
    source = tmp / "records.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp / "out"
    argv = ["prepare", str(source), "--out", str(out), *(["--sft", "prompt,completion"] if sft else [])]
    line = one_line_exit_2(argv, capsys)
    at_byte = good * (len(lines[0]) + 1)
    assert (f"{source}, line {good + 1}: {what}" if sft else f"{source}: {what} in the line at byte {at_byte}") in line
    assert not out.exists()


@pytest.mark.parametrize("spec", ["train:100", "train:x", "no/such/tokenizer.json"])
def test_bad_tokenizer_spec(tmp_path: Path, spec: str) -> None:
    with pytest.raises(ConfigError, match="--tokenizer"):
        prepare_corpus(FILES, tmp_path, 0.1, PrepareOptions(tokenizer=spec))
