"""Hostile corpus folders: prepare never deletes what it did not write; a meta.json is validated before anything
is allocated; shards are verified against meta.json (SHA-256 and token range) before training or evaluating.

Each case runs the real command function (`cli.main`) in this process and asserts the exit code, the one
stderr line and that nothing of the user's changed on disk.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import TINY, folder_bytes, one_line_exit_2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ddptrain.cli import main
from ddptrain.data.corpus import read_meta
from ddptrain.data.identity import check_same_data, corpus_identity
from ddptrain.data.shards import ShardWriter
from ddptrain.data.tokenizer import sha256_file
from ddptrain.data.verify import verify_corpus
from ddptrain.errors import DataError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCE = STDLIB / "argparse.py"


def handmade_corpus(folder: Path, vocab: int, train: np.ndarray, val: np.ndarray, fmt: int = 3) -> dict[str, Any]:
    """A uint16 corpus written with prepare's own ShardWriter (its SHA-256 and largest ids), and its meta.json."""
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text('{"stands in for": "a BPE tokenizer"}')
    shards = {}
    for split, ids in (("train", train), ("val", val)):
        writer = ShardWriter(folder, split, 1 << 20, np.dtype(np.uint16))
        writer.append(ids.astype(np.uint16))
        shards[split] = writer.finish()
        for shard in shards[split] if fmt == 2 else ():
            del shard["max_token_id"]  # format 2 (before this version) did not record it
    meta = {
        "format": fmt,
        "tokenizer": {"kind": "train", "file": "tokenizer.json", "sha256": sha256_file(folder / "tokenizer.json")},
        "vocab_size": vocab,
        "dtype": "uint16",
        "eos_id": 0,
        "files": 1,
        "documents": 1,
        "input_bytes": 2 * (len(train) + len(val)),
        "shard_tokens": 1 << 20,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "shards": shards,
        "recipe": None,
    }
    write_meta(folder, meta)
    return meta


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    (folder / "meta.json").write_text(json.dumps(meta))


def ids(n: int, top: int, seed: int = 0) -> np.ndarray:
    """n token ids below top, top - 1 among them."""
    out = np.random.default_rng(seed).integers(0, top, n)
    out[n // 2] = top - 1
    return out


@pytest.fixture
def corpus_copy(corpus_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the session's tiny byte corpus, to damage."""
    return Path(shutil.copytree(corpus_dir, tmp_path / "corpus"))


# ---- prepare --out: what it did not write, it refuses to touch ------------------------------------

NANOGPT = {"train.bin": b"\x01\x02" * 64, "val.bin": b"\x03\x04" * 8, "meta.pkl": b"\x80\x04pickled"}
FOREIGN_FOLDERS = [
    # the folder: a nanoGPT data folder and drafts
    (
        {"train.bin": b"t", "val.bin": b"v", "draft.tmp": b"d", "val-final.bin": b"f", "tokenizer.json": b"{}"},
        "('draft.tmp', 'tokenizer.json', 'train.bin' and 2 more)",
    ),
    (NANOGPT, "('meta.pkl', 'train.bin', 'val.bin')"),
    # another tool's meta.json: once read as a legacy corpus, so its train.bin and val.bin were deleted
    ({**NANOGPT, "meta.json": b'{"vocab_size": 50257}'}, "('meta.json', 'meta.pkl', 'train.bin' and 1 more)"),
    ({"notes.md": b"mine", "sub/deeper.txt": b"mine too"}, "('notes.md', 'sub')"),
    ({f"part-{i:02d}.txt": b"x" for i in range(12)}, "('part-00.txt', 'part-01.txt', 'part-02.txt' and 9 more)"),
    ({"train-00000.bin": b"looks like a shard, listed by no meta.json"}, "('train-00000.bin')"),
]


@pytest.mark.parametrize(("files", "named"), FOREIGN_FOLDERS)
def test_prepare_refuses_a_folder_of_files_it_did_not_write_and_force_keeps_them(
    files: dict[str, bytes], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    before = folder_bytes(out)
    line = one_line_exit_2(["prepare", str(SOURCE), "--out", str(out)], capsys)
    assert f"holds files prepare did not write {named}, left untouched" in line and "--force" in line, line
    assert folder_bytes(out) == before  # not a byte, not even the lock
    assert main(["prepare", str(SOURCE), "--out", str(out), "--force"]) == 0
    kept = {n: d for n, d in files.items() if n not in ("meta.json", "train-00000.bin")}  # prepare's own names
    assert all((out / n).read_bytes() == d for n, d in kept.items())
    assert read_meta(out)["format"] == 3 and not [p for p in out.iterdir() if p.name.startswith(".")]


def test_prepare_replaces_its_own_corpora_without_force(tmp_path: Path) -> None:
    """Its own output, a legacy corpus included (train.bin and val.bin under a valid legacy meta.json)."""
    out = tmp_path / "out"
    assert main(["prepare", str(SOURCE), "--out", str(out)]) == 0
    assert main(["prepare", str(SOURCE), str(STDLIB / "typing.py"), "--out", str(out)]) == 0
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    raw = SOURCE.read_bytes()
    (legacy / "train.bin").write_bytes(raw[:-4000])
    (legacy / "val.bin").write_bytes(raw[-4000:])
    meta = {"vocab_size": 256, "dtype": "uint8", "files": 1, "train_tokens": len(raw) - 4000, "val_tokens": 4000}
    (legacy / "meta.json").write_text(json.dumps({**meta, "sha256": hashlib.sha256(raw).hexdigest()}))
    assert main(["prepare", str(SOURCE), "--out", str(legacy)]) == 0
    assert sorted(p.name for p in legacy.iterdir()) == ["meta.json", "train-00000.bin", "val-00000.bin"]


# ---- meta.json: a strict schema, checked before anything is allocated -----------------------------


def train_argv(data_dir: Path, tmp_path: Path, *more: str) -> list[str]:
    return ["train", *TINY, f"data.dir={data_dir}", f"run.dir={tmp_path / 'run'}", "train.max_steps=1", *more]


def mutated(meta: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """meta with the value at path replaced (DROP: the key removed)."""
    out = copy.deepcopy(meta)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


DROP = object()
META_CASES = [  # the seven, then more of the same kind
    (("vocab_size",), DROP, "meta.json: vocab_size: Field required"),
    (("vocab_size",), "256", "vocab_size: Input should be a valid integer (got '256')"),
    (("vocab_size",), True, "vocab_size: Input should be a valid integer (got True)"),
    (("vocab_size",), 10**12, "vocab_size: Input should be less than or equal to 16777216 (got 1000000000000)"),
    (("dtype",), ["uint8"], "dtype: Input should be 'uint8', 'uint16' or 'uint32' (got ['uint8'])"),
    (("train_tokens",), DROP, "train_tokens: Field required"),
    (("tokenizer",), "bytes", "tokenizer: Input should be"),
    (("shards", "train"), [], "shards.train: List should have at least 1 item"),
    (("vocab_size",), 0, "vocab_size: Input should be greater than or equal to 1"),
    (("vocab_size",), 2**24 + 1, "vocab_size: Input should be less than or equal to 16777216"),
    (("vocab_size",), 255.0, "vocab_size: Input should be a valid integer (got 255.0)"),
    (("vocab_size",), 300, "dtype 'uint8' cannot hold the ids of vocab_size 300"),
    (("vocab_size",), 100, "tokenizer kind 'bytes' means vocab_size 256"),
    (("train_tokens",), 5, "train_tokens 5 is not the sum of shards.train"),
    (("shards", "train", 0, "file"), "../../etc/passwd", "shards.train.0.file: String should match pattern"),
    (("shards", "train", 0, "file"), "val-00000.bin", "shards: a file is listed twice"),
    (("shards", "train", 0, "sha256"), None, "shards.train.0.sha256: Input should be a valid string (got None)"),
    (("shards", "train", 0, "max_token_id"), DROP, "shards.train.0.max_token_id: Field required (format 3)"),
    (("shards", "train", 0, "max_token_id"), 256, "shards.train.0.max_token_id 256 is not below vocab_size 256"),
    (("shards", "test"), [], "unknown key 'shards.test'"),
    (("format",), 4, "format: Input should be 2 or 3 (got 4)"),
    (("tokenizer", "file"), "../tokenizer.json", "tokenizer.file: Input should be 'tokenizer.json'"),
    (("eos_id",), 7, "tokenizer kind 'bytes' means vocab_size 256, dtype 'uint8' and eos_id null"),
]


@pytest.mark.parametrize(("path", "value", "named"), META_CASES)
def test_train_refuses_a_bad_meta_json_naming_the_field(
    path: tuple[str | int, ...],
    value: Any,
    named: str,
    corpus_copy: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    write_meta(corpus_copy, mutated(json.loads((corpus_copy / "meta.json").read_text()), path, value))
    before = folder_bytes(corpus_copy)
    line = one_line_exit_2(train_argv(corpus_copy, tmp_path), capsys)
    assert named in line and "prepare the corpus again" in line, line
    assert folder_bytes(corpus_copy) == before
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "config.yaml").exists()


RAW_META = [
    (b"{not json", "meta.json is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "meta.json is not valid JSON"),  # deeper than the parser's stack
    (b'{"vocab_size": 1' + b"0" * 5000 + b"}", "meta.json is not valid JSON"),  # past int's digit limit
    (b'["a list"]', "meta.json must hold a JSON object, not list"),
    (b"\xff\xfe", "meta.json is not valid JSON"),
    (json.dumps({"vocab_size": 256, "train_tokens": 0, "val_tokens": 0}).encode(), "sha256: Field required"),
]


@pytest.mark.parametrize(("raw", "named"), RAW_META)
def test_train_refuses_a_meta_json_that_is_no_description(
    raw: bytes, named: str, corpus_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (corpus_copy / "meta.json").write_bytes(raw)
    assert named in one_line_exit_2(train_argv(corpus_copy, tmp_path), capsys)


@pytest.mark.timeout(30)
def test_a_fifo_for_meta_json_is_refused_not_waited_on(
    corpus_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (corpus_copy / "meta.json").unlink()
    os.mkfifo(corpus_copy / "meta.json")
    assert "meta.json is not a regular file" in one_line_exit_2(train_argv(corpus_copy, tmp_path), capsys)


def _paths(node: Any, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every key path in a JSON value (inner ones too: a whole section can be dropped or retyped)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out = []
    for key, child in items:
        out.append((*prefix, key))
        out += _paths(child, (*prefix, key))
    return out


VALUES = [DROP, None, True, False, 0, 1, -1, 255, 256, 257, 299, 300, 2**16, 2**24, 2**24 + 1, 10**12, 2**63, 1.5]
VALUES += ["", "x", "256", "uint16", "tokenizer.json", "train-00000.bin", "0" * 64, [], [1], {}, {"file": "x"}]


@pytest.fixture(scope="module")
def base_corpora(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A byte corpus and a uint16 one (vocab 300, a tokenizer file, format 3), both valid."""
    byte_corpus = tmp_path_factory.mktemp("bytes") / "c"
    assert main(["prepare", str(SOURCE), "--out", str(byte_corpus)]) == 0
    wide = tmp_path_factory.mktemp("wide") / "c"
    handmade_corpus(wide, 300, ids(6000, 300), ids(1000, 300, seed=1))
    return [byte_corpus, wide]


@given(data=st.data())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_meta_json_mutation_is_one_line_or_a_consistent_corpus(
    data: st.DataObject,
    base_corpora: list[Path],
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Drop, retype or push to an extreme any field (or two) of a valid meta.json: `ddptrain train` exits 2
    with one line, or it trains on a corpus whose meta.json still describes its files (sizes, SHA-256, ids)."""
    base = data.draw(st.sampled_from(base_corpora))
    folder = Path(shutil.copytree(base, tmp_path_factory.mktemp("mutant") / "c"))
    meta = json.loads((base / "meta.json").read_text())
    for _ in range(data.draw(st.integers(1, 2))):
        paths = _paths(meta)
        meta = mutated(meta, data.draw(st.sampled_from(paths)), data.draw(st.sampled_from(VALUES)))
    write_meta(folder, meta)
    capsys.readouterr()
    rc = main(train_argv(folder, folder.parent, "ckpt.every_steps=0", "train.warmup_steps=0"))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and rc in (0, 2), (meta, rc, err)
    event(f"exit {rc}")
    if rc == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ddptrain train: error: ") and str(folder) in lines[0], err
        return
    assert "done: 1 steps" in out, out
    accepted = read_meta(folder)  # what was trained on: every shard's size, bytes and ids as meta.json says
    verify_corpus(folder, accepted)
    assert {k: accepted[k] for k in meta} == meta  # nothing coerced: the file says what the corpus is


# ---- shards: verified against meta.json (SHA-256, token range) before the first step --------------


def flip_a_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x20
    path.write_bytes(bytes(data))


def test_a_shard_changed_after_prepare_is_refused_by_train(
    corpus_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same size, one byte different (before: trained on it, and ranks given different bytes under one
    meta.json passed the identity check)."""
    verify_corpus(corpus_copy, read_meta(corpus_copy))  # remembered for this process...
    flip_a_byte(corpus_copy / "train-00000.bin")
    before = folder_bytes(corpus_copy)
    line = one_line_exit_2(train_argv(corpus_copy, tmp_path), capsys)  # ...but a changed file is read again
    assert f"{corpus_copy / 'train-00000.bin'}: its bytes do not match meta.json (SHA-256" in line, line
    assert folder_bytes(corpus_copy) == before and not (tmp_path / "run" / "config.yaml").exists()


def token_range_cases(tmp: Path) -> list[tuple[Path, str]]:
    """(corpus, the line's words): shards holding ids at or above the vocabulary, however meta.json tells it."""
    high = ids(6000, 310)  # ids up to 309 in a corpus whose vocabulary is 300
    honest = tmp / "honest"  # prepare recorded the largest id: refused from meta.json alone
    meta = handmade_corpus(honest, 310, high, ids(1000, 300, 1))
    write_meta(honest, {**meta, "vocab_size": 300})
    lying = tmp / "lying"  # a meta.json whose recorded largest id is not the shard's
    meta = handmade_corpus(lying, 300, ids(6000, 300), ids(1000, 300, 1))
    (lying / "train-00000.bin").write_bytes(high.astype(np.uint16).tobytes())
    meta["shards"]["train"][0]["sha256"] = sha256_file(lying / "train-00000.bin")
    write_meta(lying, meta)
    older = tmp / "format-2"  # no recorded largest id: the verifying pass finds it
    handmade_corpus(older, 310, high, ids(1000, 300, 1), fmt=2)
    meta = json.loads((older / "meta.json").read_text())
    write_meta(older, {**meta, "vocab_size": 300})
    return [
        (honest, "shards.train.0.max_token_id 309 is not below vocab_size 300"),
        (lying, "train-00000.bin: its largest token id is 309, meta.json records 299"),
        (older, "train-00000.bin: token id 309 is not below vocab_size 300"),
    ]


def test_token_ids_outside_the_vocabulary_are_refused_before_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: an IndexError in the embedding at step 1, exit 1 (restarted by launchers)."""
    for corpus, named in token_range_cases(tmp_path):
        line = one_line_exit_2(train_argv(corpus, tmp_path), capsys)
        assert named in line and "prepare" in line, line


def test_older_corpora_are_verified_with_what_they_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A format-2 corpus (no largest ids) trains: its ids are found by the verifying pass."""
    older = tmp_path / "format-2"
    handmade_corpus(older, 300, ids(6000, 300), ids(1000, 300, 1), fmt=2)
    assert main(train_argv(older, tmp_path)) == 0
    assert corpus_identity(older)["bad_data"] is None


def test_a_rank_whose_shards_fail_stops_every_rank_naming_it() -> None:
    """The comparison every rank runs on the gathered identities (the collective: tests/dist/test_exit_codes.py)."""
    good = {"sha256": "aaa", "bad_data": None}
    bad = {"sha256": "aaa", "bad_data": "/d/train-00000.bin: its bytes do not match meta.json"}
    with pytest.raises(DataError, match=r"^rank 1 \(node-b\): /d/train-00000.bin: its bytes do not match"):
        check_same_data([good, bad, good], ("node-a", "node-b", "node-c"))
    with pytest.raises(DataError, match=r"^every rank: /d/train-00000.bin"):
        check_same_data([bad, bad], ("node-a", "node-b"))
    with pytest.raises(DataError, match=r"^/d/train-00000.bin"):
        check_same_data([bad], ("node-a",))


# ---- eval: refuses what train refuses ------------------------------------------------------------


@pytest.mark.timeout(120)
def test_eval_refuses_data_the_model_cannot_use(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corpus whose vocabulary exceeds the model's (before: IndexError, exit 1), or whose shard changed."""
    run = tmp_path / "run"
    assert main(["train", *TINY, f"data.dir={corpus_dir}", f"run.dir={run}", "train.max_steps=3"]) == 0
    wide = tmp_path / "wide"
    handmade_corpus(wide, 300, ids(6000, 300), ids(1000, 300, 1))
    line = one_line_exit_2(["eval", str(run), f"data.dir={wide}"], capsys)
    assert "model.vocab_size=256 is smaller than the data's vocabulary (300)" in line, line
    assert "model.vocab_size=256 is smaller than the data's vocabulary (300)" in one_line_exit_2(
        train_argv(wide, tmp_path, "model.vocab_size=256"), capsys
    )  # the same refusal as train's
    damaged = Path(shutil.copytree(corpus_dir, tmp_path / "damaged"))
    flip_a_byte(damaged / "val-00000.bin")
    line = one_line_exit_2(["eval", str(run), f"data.dir={damaged}"], capsys)
    assert "val-00000.bin: its bytes do not match meta.json" in line, line
