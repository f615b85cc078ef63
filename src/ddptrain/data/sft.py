"""Instruction data for `ddptrain prepare --sft`: each JSON Lines record becomes tokens and a loss mask.

Two record shapes:
- `--sft PROMPT,COMPLETION` (two field names): a record's prompt text, then its completion text and the
  tokenizer's end-of-document token (none for raw bytes). The completion and that token are the answer.
- `--sft MESSAGES` (one field name): a list of `{"role": ..., "content": ...}` chat messages (roles
  system, user, assistant, tool), rendered with a chat template: the one of a transformers tokenizer
  folder given to `--tokenizer` (its `chat_template.jinja`, or `chat_template` in its
  `tokenizer_config.json`), else BUILTIN_TEMPLATE. The answer is what each assistant message adds to the
  conversation after the template's generation prompt (`add_generation_prompt=True`): the assistant's
  content and the template's end of turn, not the header announcing the assistant.

The mask holds one byte per token: bit LOSS for an answer token (a target of the loss), bit START on a
record's first token (samples respect record boundaries: data/sft_dataset.py finds them there).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ddptrain.data import chat_template
from ddptrain.data.chat_template import TemplateFailed, render_bounded
from ddptrain.data.sources import (
    BadJsonLine,
    Piece,
    Task,
    is_jsonl,
    iter_pieces,
    json_line,
    jsonl_lines,
    line_number,
    utf8,
)
from ddptrain.data.tokenizer import EOS_TOKEN, Tokenizer
from ddptrain.errors import ConfigError, DataError

LOSS = 1  # mask bit: an answer token, a target of the loss
START = 2  # mask bit: the first token of a record
ROLES = ("system", "user", "assistant", "tool")
# The template of the byte and trained-BPE tokenizers (and of a tokenizer.json without a chat template):
#   <|user|>\n{content}\n<|assistant|>\n{content}{eos}\n  (eos: <|endoftext|>, or nothing for raw bytes)
BUILTIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ '\\n' }}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class _BadRecord(Exception):
    """A record that is not what --sft asked for (its file and line are added where they are known)."""


@dataclass(frozen=True)
class SftSpec:
    """What `--sft` asked for: the record's fields, and for chat records the template and its special tokens."""

    fields: tuple[str, ...]
    template: str = BUILTIN_TEMPLATE
    template_source: str = "builtin"  # or "tokenizer": the --tokenizer folder's chat template
    special: tuple[tuple[str, str], ...] = ()  # bos_token, eos_token, ... as the template sees them

    @property
    def chat(self) -> bool:
        """True for chat records (one field of messages), False for prompt/completion pairs."""
        return len(self.fields) == 1

    def for_tokenizer(self, eos_text: str) -> SftSpec:
        """This spec with eos_token set to eos_text unless the tokenizer folder named its own."""
        if any(key == "eos_token" for key, _ in self.special):
            return self
        return replace(self, special=(*self.special, ("eos_token", eos_text)))

    def described(self) -> dict[str, Any]:
        """What the prepare recipe records of it."""
        if not self.chat:
            return {"fields": list(self.fields), "template": None, "template_sha256": None}
        digest = hashlib.sha256(self.template.encode()).hexdigest()
        return {"fields": list(self.fields), "template": self.template_source, "template_sha256": digest}

    def recorded(self) -> dict[str, Any]:
        """What meta.json records of it: described(), and for chat records the template's text and the special
        tokens it rendered with (an export's tokenizer carries both; the recipe stays described())."""
        if not self.chat:
            return self.described()
        return {**self.described(), "chat_template": self.template, "special_tokens": dict(self.special)}


def parse_sft(text: str, tokenizer_file: Path | None) -> SftSpec:
    """`--sft` read: PROMPT,COMPLETION or MESSAGES; tokenizer_file is --tokenizer's tokenizer.json (None for
    bytes and train:VOCAB), whose folder may hold a chat template. ConfigError for anything else."""
    names = tuple(text.split(","))
    if len(names) not in (1, 2) or not all(n and n.strip() == n for n in names) or len(set(names)) != len(names):
        raise ConfigError(
            f"--sft {text!r}: give two record fields PROMPT,COMPLETION (e.g. prompt,completion) "
            "or one field holding chat messages (e.g. messages)"
        )
    found = _folder_template(tokenizer_file.parent) if len(names) == 1 and tokenizer_file else None
    if found is None:
        return SftSpec(names)
    template, special = found
    return SftSpec(names, template, "tokenizer", special)


def _folder_template(folder: Path) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """A transformers tokenizer folder's chat template and special tokens; None when it has no template."""
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}
        jinja = folder / "chat_template.jinja"
        template = jinja.read_text("utf-8") if jinja.is_file() else config.get("chat_template")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"cannot read the chat template of {folder}: {e}") from None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        return None
    special = []
    for key in _SPECIAL_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special.append((key, value))
    return template, tuple(special)


def check_sft_sources(files: list[Path], spec: SftSpec) -> None:
    """DataError before anything is written when a source is not JSON Lines (records need fields)."""
    for path in files:
        if not is_jsonl(path):
            raise DataError(f"{path}: --sft {','.join(spec.fields)} reads records from .jsonl files only")


# ---- records to text spans -------------------------------------------------------------------------


def _render(spec: SftSpec, messages: list[dict[str, str]], generation_prompt: bool, deadline: float) -> str:
    variables = {"messages": messages, "add_generation_prompt": generation_prompt, **dict(spec.special)}
    try:
        return render_bounded(spec.template, deadline, variables)
    except TemplateFailed as e:
        raise _BadRecord(str(e)) from None


def _messages(value: Any, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _BadRecord(f"field {field!r} must be a non-empty list of {{role, content}} messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise _BadRecord(
                f"message {i} of {field!r} must be an object with a string 'content' and a 'role' of "
                f"{', '.join(ROLES)} (got {json.dumps(m)[:80]})"
            )
    if not any(m["role"] == "assistant" for m in value):
        raise _BadRecord(f"field {field!r} has no assistant message: nothing to train on")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def chat_spans(messages: list[dict[str, str]], spec: SftSpec) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_answer) spans: each assistant message's addition after the
    generation prompt is an answer. _BadRecord when the template does not render prefix by prefix."""
    spans: list[tuple[str, bool]] = []
    done = ""
    deadline = time.monotonic() + chat_template.RENDER_TIME_S
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _render(spec, messages[:i], True, deadline)
        whole = _render(spec, messages[: i + 1], False, deadline)
        if not head.startswith(done) or not whole.startswith(head):
            raise _BadRecord("the chat template does not render the conversation prefix by prefix")
        spans += [(head[len(done) :], False), (whole[len(head) :], True)]
        done = whole
    full = _render(spec, messages, False, deadline)
    if not full.startswith(done):
        raise _BadRecord("the chat template does not render the conversation prefix by prefix")
    spans.append((full[len(done) :], False))
    return [span for span in spans if span[0]]


def record_spans(line: bytes, spec: SftSpec) -> list[tuple[str, bool]]:
    """One JSON Lines record as (text, is_answer) spans; _BadRecord when it is not what spec asks for."""
    try:
        record = json_line(line)
    except BadJsonLine as e:
        raise _BadRecord(str(e)) from None
    if not isinstance(record, dict):
        raise _BadRecord(f"a record must be a JSON object, not {type(record).__name__}")
    if spec.chat:
        spans = chat_spans(_messages(record.get(spec.fields[0]), spec.fields[0]), spec)
    else:
        texts: list[str] = []
        for name in spec.fields:
            value = record.get(name)
            if not isinstance(value, str):
                raise _BadRecord(f"no string field {name!r} (--sft {','.join(spec.fields)})")
            texts.append(value)
        spans = [(texts[0], False), (texts[1], True)]
    for text, _ in spans:
        if not text.isascii():
            try:
                utf8(text)
            except BadJsonLine as e:
                raise _BadRecord(str(e)) from None
    return spans


def _piece_spans(piece: Piece, spec: SftSpec) -> Iterator[tuple[list[tuple[str, bool]], int]]:
    """Each record of a piece as spans, with its line's length in bytes; DataError naming file and line."""
    for line, offset in jsonl_lines(piece):
        try:
            yield record_spans(line, spec), len(line)
        except _BadRecord as e:
            raise DataError(f"{piece.path}, line {line_number(piece.path, offset)}: {e}") from None


def record_texts(files: list[Path], spec: SftSpec) -> Iterator[bytes]:
    """Every record's whole text, one at a time (what a BPE is trained on), rendered with eos <|endoftext|>."""
    spec = spec.for_tokenizer(EOS_TOKEN)
    for piece in iter_pieces(files):
        for spans, _ in _piece_spans(piece, spec):
            yield "".join(text for text, _ in spans).encode("utf-8")


# ---- spans to tokens and mask --------------------------------------------------------------------


def _encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    if tokenizer.hf is None:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    encode = getattr(tokenizer.hf, "encode_batch_fast", tokenizer.hf.encode_batch)
    return [np.asarray(e.ids, dtype=tokenizer.dtype) for e in encode(texts, add_special_tokens=False)]


def tokenize_records(task: Task, spec: SftSpec, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray, int, int]:
    """A task's records as (tokens, mask, records, input bytes). A prompt/completion answer ends with the
    end-of-document token when the tokenizer has one; a chat answer ends as its template says."""
    records: list[list[tuple[str, bool]]] = []
    input_bytes = 0
    for piece in task.pieces:
        for spans, nbytes in _piece_spans(piece, spec):
            records.append(spans)
            input_bytes += nbytes
    encoded = iter(_encode_texts(tokenizer, [text for spans in records for text, _ in spans]))
    eos = np.array([tokenizer.eos_id] if tokenizer.eos_id is not None and not spec.chat else [], tokenizer.dtype)
    tokens: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for spans in records:
        parts = [(next(encoded), answer) for _, answer in spans] + [(eos, True)]
        record_tokens = np.concatenate([ids for ids, _ in parts])
        record_mask = np.concatenate([np.full(len(ids), LOSS if answer else 0, np.uint8) for ids, answer in parts])
        if len(record_mask):
            record_mask[0] |= START
        tokens.append(record_tokens)
        masks.append(record_mask)
    if not tokens:
        return np.zeros(0, tokenizer.dtype), np.zeros(0, np.uint8), 0, input_bytes
    return np.concatenate(tokens), np.concatenate(masks), len(records), input_bytes


def validation_cut(mask: np.ndarray, val_fraction: float) -> int:
    """Where a task's tokens split into train and validation: the first record start at or after the last
    val_fraction of its tokens (a record is never split), or the end when there is none."""
    starts = np.flatnonzero(mask & START)
    at = int(np.searchsorted(starts, len(mask) - int(len(mask) * val_fraction)))
    return int(starts[at]) if at < len(starts) else len(mask)
