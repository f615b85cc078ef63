"""meta.json's schema: a prepared corpus's description, checked before anything is read or allocated.

Everything the data layer takes from meta.json is validated here first (pydantic, strict: no
coercion of "256" or `true` to a number, no unknown keys), with bounds and cross-field checks, so
that a hand-edited, truncated or hostile meta.json is one line and exit 2 naming the field, never a
traceback, an embedding of 10**12 rows, or a restart under `ddptrain launch`.

Three shapes are read:
- format 3 (this version's prepare): every shard with its token count, SHA-256 and largest token id;
  instruction data (`prepare --sft`) adds `sft` (the record fields and chat template) and each shard's
  loss `mask` (its file and SHA-256);
- format 2 (before that): the same without the largest id (data/verify.py computes it while hashing);
- the legacy corpus from before shards (no `format`): `train.bin`, `val.bin` of uint8 bytes and one
  SHA-256 of their concatenation. A legacy meta.json without that `sha256` was never written by a
  prepare (every one recorded it) and cannot be verified: it is refused with "prepare again".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ddptrain.errors import DataError
from ddptrain.safe_files import read_regular_file

META = "meta.json"
FORMAT = 3
# The largest vocabulary a corpus may declare. The largest tokenizers in use have about 2**18 entries
# (Gemma's 262,144); 2**24 leaves 64 times that, while the embedding such a meta.json asks for stays a
# size a GPU can at least be asked for (2**24 x 768 floats is 48 GiB), not the 10**12 rows (128 TB at
# n_embd 32) that an unbounded vocab_size made the model try to allocate.
MAX_VOCAB = 2**24
MAX_TOKENS = 2**48  # tokens per split or shard: far beyond any corpus, and sums stay exact in int64
MAX_SHARDS = 2**20  # per split: 64 Ti tokens at the default 64 Mi tokens per shard
MAX_META_BYTES = 64 << 20  # a million shards' entries fit; json.loads is never handed more
_COUNT = 2**62
ITEMSIZE = {"uint8": 1, "uint16": 2, "uint32": 4}
SHARD_PATTERN = r"^(train|val)-[0-9]{5,}\.bin$"  # shards.shard_name: nothing outside data.dir, nothing else's
Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
MASK_PATTERN = r"^(train|val)-[0-9]{5,}\.mask$"  # shards.shard_name with MASK_SUFFIX
Count = Annotated[int, Field(ge=0, le=_COUNT)]
MAX_TEMPLATE_CHARS = 1 << 20  # a chat template's text (the largest in use are ~20 KB)
SpecialKey = Literal["bos_token", "eos_token", "pad_token", "unk_token"]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class MaskMeta(_Strict):
    """A token shard's loss mask (instruction data): its file (one byte per token) and SHA-256."""

    file: Annotated[str, Field(pattern=MASK_PATTERN)]
    sha256: Hex64


class ShardMeta(_Strict):
    """One shard: its file, token count, SHA-256 of its bytes, (format 3) its largest token id, and (instruction
    data) its loss mask."""

    file: Annotated[str, Field(pattern=SHARD_PATTERN)]
    tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)]
    sha256: Hex64
    max_token_id: Annotated[int, Field(ge=0, lt=MAX_VOCAB)] | None = None
    mask: MaskMeta | None = None


class SftMeta(_Strict):
    """How instruction records became tokens (data/sft.py): their fields, and for chat records the template."""

    fields: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(min_length=1, max_length=2)]
    template: Literal["builtin", "tokenizer"] | None
    template_sha256: Hex64 | None
    # The template's text and the special tokens it rendered with (chat data prepared since exports carry them:
    # `ddptrain export --format hf/peft` writes both into the exported tokenizer).
    chat_template: Annotated[str, Field(min_length=1, max_length=MAX_TEMPLATE_CHARS)] | None = None
    special_tokens: dict[SpecialKey, Annotated[str, Field(max_length=4096)]] | None = None


class TokenizerMeta(_Strict):
    """How the tokens were made: raw bytes (no file), or a tokenizer.json beside meta.json and its SHA-256."""

    kind: Literal["bytes", "file", "train"]
    file: Literal["tokenizer.json"] | None
    sha256: Hex64 | None

    @model_validator(mode="after")
    def _file_unless_bytes(self) -> TokenizerMeta:
        if (self.kind == "bytes") != (self.file is None) or (self.file is None) != (self.sha256 is None):
            raise ValueError("kind 'bytes' has no file and sha256, 'file' and 'train' have both")
        return self


class SplitsMeta(_Strict):
    """The shards of each split, in order."""

    train: Annotated[list[ShardMeta], Field(min_length=1, max_length=MAX_SHARDS)]
    val: Annotated[list[ShardMeta], Field(min_length=1, max_length=MAX_SHARDS)]


class CorpusMeta(_Strict):
    """meta.json of format 2 or 3 (what data/prepare.py writes)."""

    format: Literal[2, 3]
    tokenizer: TokenizerMeta
    vocab_size: Annotated[int, Field(ge=1, le=MAX_VOCAB)]
    dtype: Literal["uint8", "uint16", "uint32"]
    eos_id: Annotated[int, Field(ge=0, lt=MAX_VOCAB)] | None
    files: Count
    documents: Count
    input_bytes: Count
    shard_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)]
    train_tokens: Tokens
    val_tokens: Tokens
    shards: SplitsMeta
    recipe: Hex64 | None = None  # prepares before the prepare lock did not record it
    sft: SftMeta | None = None  # instruction data: every shard has a loss mask

    @model_validator(mode="after")
    def _consistent(self) -> CorpusMeta:
        for problem in _problems(self):
            raise ValueError(problem)
        return self


def _problems(m: CorpusMeta) -> list[str]:
    """What contradicts itself in an otherwise well-typed meta.json (the first is reported)."""
    out = []
    if m.vocab_size - 1 > np.iinfo(m.dtype).max:
        out.append(f"dtype {m.dtype!r} cannot hold the ids of vocab_size {m.vocab_size}")
    if m.tokenizer.kind == "bytes" and (m.vocab_size, m.dtype, m.eos_id) != (256, "uint8", None):
        out.append("tokenizer kind 'bytes' means vocab_size 256, dtype 'uint8' and eos_id null")
    if m.eos_id is not None and m.eos_id >= m.vocab_size:
        out.append(f"eos_id {m.eos_id} is not below vocab_size {m.vocab_size}")
    if m.sft is not None and m.sft.chat_template is not None:
        if hashlib.sha256(m.sft.chat_template.encode()).hexdigest() != m.sft.template_sha256:
            out.append("sft.chat_template does not match sft.template_sha256")
    names = [s.file for split in ("train", "val") for s in getattr(m.shards, split)]
    if len(set(names)) != len(names):
        out.append("shards: a file is listed twice")
    for split in ("train", "val"):
        shards: list[ShardMeta] = getattr(m.shards, split)
        total = sum(s.tokens for s in shards)
        if total != getattr(m, f"{split}_tokens"):
            out.append(f"{split}_tokens {getattr(m, f'{split}_tokens')} is not the sum of shards.{split} ({total})")
        for i, s in enumerate(shards):
            where = f"shards.{split}.{i}"
            if not s.file.startswith(f"{split}-"):
                out.append(f"{where}.file {s.file!r} is not a {split} shard")
            if s.tokens > m.shard_tokens:
                out.append(f"{where}.tokens {s.tokens} exceeds shard_tokens {m.shard_tokens}")
            if m.format >= 3 and s.max_token_id is None:
                out.append(f"{where}.max_token_id: Field required (format {m.format})")
            if s.max_token_id is not None and s.max_token_id >= m.vocab_size:
                out.append(f"{where}.max_token_id {s.max_token_id} is not below vocab_size {m.vocab_size}")
            if (s.mask is None) != (m.sft is None):
                out.append(f"{where}.mask: {'required with sft' if m.sft else 'only instruction data (sft) has masks'}")
            if s.mask is not None and s.mask.file != s.file.removesuffix(".bin") + ".mask":
                out.append(f"{where}.mask.file {s.mask.file!r} is not the mask of {s.file!r}")
    return out


class LegacyMeta(_Strict):
    """meta.json of a corpus from before shards: train.bin and val.bin of bytes, one SHA-256 of both."""

    vocab_size: Annotated[int, Field(ge=1, le=256)]
    dtype: Literal["uint8"] = "uint8"
    files: Count = 0
    train_tokens: Tokens
    val_tokens: Tokens
    sha256: Hex64

    def current(self) -> dict[str, Any]:
        """This corpus in today's form (format 1: two shards without their own hashes)."""
        shards = {s: [{"file": f"{s}.bin", "tokens": getattr(self, f"{s}_tokens")}] for s in ("train", "val")}
        tokenizer = {"kind": "bytes", "file": None, "sha256": None}
        return {**self.model_dump(), "format": 1, "tokenizer": tokenizer, "eos_id": None, "shards": shards}


def parse_meta(raw: bytes, where: Path) -> dict[str, Any]:
    """The validated meta.json (a legacy one in today's form); DataError naming the first bad field."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, a 5000-digit int, nesting past the stack
        raise DataError(f"{where} is not valid JSON ({_short(str(e), 80)}); prepare the corpus again") from None
    if not isinstance(data, dict):
        raise DataError(f"{where} must hold a JSON object, not {type(data).__name__}; prepare the corpus again")
    legacy = "format" not in data and "shards" not in data
    try:
        if legacy:
            return LegacyMeta.model_validate(data).current()
        return _without_absent(CorpusMeta.model_validate(data).model_dump())
    except ValidationError as e:
        raise DataError(f"{where}: {_first_error(e)}; prepare the corpus again") from None


def _without_absent(meta: dict[str, Any]) -> dict[str, Any]:
    """The dump without the instruction-data keys a corpus does not have: the meta.json as written."""
    if meta["sft"] is None:
        del meta["sft"]
    else:
        for key in ("chat_template", "special_tokens"):
            if meta["sft"][key] is None:
                del meta["sft"][key]
    for split in meta["shards"].values():
        for shard in split:
            if shard["mask"] is None:
                del shard["mask"]
    return meta


def read_meta_file(data_dir: Path, name: str = META) -> dict[str, Any]:
    """data_dir/meta.json (or another name) read (a regular file, at most MAX_META_BYTES, no wait on a FIFO)
    and validated."""
    path = data_dir / name
    try:
        raw = read_regular_file(path, MAX_META_BYTES, follow=True)
    except FileNotFoundError:
        raise DataError(
            f"no prepared corpus in {data_dir} (meta.json is missing); run `ddptrain prepare --out {data_dir} FILES...`"
        ) from None
    except OSError as e:
        if e.errno != 21:
            raise
        raise DataError(f"{path} is not a regular file; prepare the corpus again") from None
    if len(raw) > MAX_META_BYTES:
        raise DataError(f"{path} is larger than {MAX_META_BYTES} bytes; prepare the corpus again")
    return parse_meta(raw, path)


def listed_files(meta: dict[str, Any]) -> set[str]:
    """The files a validated meta.json says its prepare wrote: shards and tokenizer (plain names)."""
    names = {s["file"] for split in meta["shards"].values() for s in split}
    names |= {s["mask"]["file"] for split in meta["shards"].values() for s in split if s.get("mask")}
    return names | ({meta["tokenizer"]["file"]} if meta["tokenizer"]["file"] else set())


def _first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"])
    msg = str(e["msg"]).removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        return f"unknown key {where!r}"
    if e["type"] in ("missing", "value_error"):
        return f"{where}: {msg}" if where else msg
    return f"{where}: {msg} (got {_short(repr(e.get('input')), 60)})"


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
