"""Documents to prepare, cut into small tasks that worker processes read and tokenize themselves.

A text file is one document. A `.jsonl` file holds one document per line, in a named string
field; a Parquet or Arrow file one per row, in a named string column (tables.py). The main process never reads document text: it only lists files and, for a large JSON
Lines file, finds line boundaries near fixed byte offsets. So its memory does not depend on the
corpus size, and the tasks (hence the shards) are the same on every run over the same files.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddptrain.data.tables import is_table, read_table_documents, table_pieces
from ddptrain.errors import DataError

JSONL_SUFFIXES = (".jsonl",)


@dataclass(frozen=True)
class Piece:
    """A whole text file (end = -1), the byte range [start, end) of whole lines of a JSON Lines file, or the
    row groups / record batches [start, end) of a table file (nbytes: their size; -1 for the other kinds)."""

    path: Path
    start: int = 0
    end: int = -1
    nbytes: int = -1

    def input_bytes(self, file_size: int) -> int:
        """The bytes of input this piece stands for (to size tasks)."""
        if self.nbytes >= 0:
            return self.nbytes
        return self.end - self.start if self.end >= 0 else file_size


@dataclass(frozen=True)
class Task:
    """Consecutive pieces, about task_bytes of input, tokenized together by one worker."""

    index: int
    pieces: tuple[Piece, ...]
    input_bytes: int = 0  # what its pieces stand for (Piece.input_bytes): a prepare's progress counts these


def is_jsonl(path: Path) -> bool:
    """True for files read as JSON Lines."""
    return path.suffix in JSONL_SUFFIXES


def _jsonl_pieces(path: Path, size: int, task_bytes: int) -> Iterator[Piece]:
    start = 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + task_bytes, size))
            if start + task_bytes < size:
                f.readline()  # to the end of the line the cut fell in
            end = min(f.tell(), size)
            yield Piece(path, start, end)
            start = end


def _pieces(path: Path, size: int, task_bytes: int) -> Iterator[Piece]:
    if is_table(path):
        return (Piece(path, start, end, nbytes) for start, end, nbytes in table_pieces(path, task_bytes))
    return _jsonl_pieces(path, size, task_bytes) if is_jsonl(path) else iter([Piece(path)])


def plan_tasks(files: list[Path], task_bytes: int) -> Iterator[Task]:
    """Tasks over the files in order: small files grouped, large JSON Lines files split at line ends."""
    group: list[Piece] = []
    group_bytes = 0
    index = 0
    for path in files:
        try:
            size = path.stat().st_size
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror}") from None
        for piece in _pieces(path, size, task_bytes):
            group.append(piece)
            group_bytes += piece.input_bytes(size)
            if group_bytes >= task_bytes:
                yield Task(index, tuple(group), group_bytes)
                index += 1
                group, group_bytes = [], 0
    if group:
        yield Task(index, tuple(group), group_bytes)


def read_documents(piece: Piece, text_field: str) -> Iterator[bytes]:
    """The documents of one piece, as UTF-8 bytes (text files exactly as stored)."""
    if is_table(piece.path):
        yield from read_table_documents(piece.path, piece.start, piece.end, text_field)
        return
    if not is_jsonl(piece.path):
        try:
            yield piece.path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {piece.path}: {e.strerror}") from None
        return
    for line, offset in jsonl_lines(piece):
        yield _jsonl_text(line, piece.path, offset, text_field)


def jsonl_lines(piece: Piece) -> Iterator[tuple[bytes, int]]:
    """The non-blank lines of a JSON Lines piece, each with the byte offset where it starts in its file."""
    try:
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            data = f.read(piece.end - piece.start)
    except OSError as e:
        raise DataError(f"cannot read {piece.path}: {e.strerror}") from None
    offset = piece.start
    for line in data.splitlines(keepends=True):
        if line.strip():
            yield line, offset
        offset += len(line)


def line_number(path: Path, offset: int) -> int:
    """The 1-based line number of the line starting at byte offset of path (for error messages only: it
    reads the file up to there)."""
    newlines = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 22))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            offset -= len(chunk)
    return newlines + 1


class BadJsonLine(ValueError):
    """A JSON Lines line that does not parse: what is wrong (`what`) and where in the line (`detail`)."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")
        self.what, self.detail = what, detail


def json_line(line: bytes) -> Any:
    """One JSON Lines line parsed; BadJsonLine when it is invalid JSON, holds bytes that are not UTF-8,
    or nests deeper than the interpreter's recursion limit lets json parse."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise BadJsonLine("invalid JSON", e.msg) from None
    except UnicodeDecodeError as e:
        detail = f"byte 0x{line[e.start]:02x} at column {e.start + 1}" if e.start < len(line) else e.reason
        raise BadJsonLine("bytes that are not UTF-8", detail) from None
    except RecursionError:
        raise BadJsonLine("JSON nested too deep", f"over about {sys.getrecursionlimit()} levels") from None


def utf8(text: str) -> bytes:
    """A parsed string as UTF-8; BadJsonLine for a lone surrogate (JSON's "\\ud800", or its bytes), which has none."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadJsonLine("a lone surrogate", f"\\u{ord(text[e.start]):04x} has no UTF-8 form") from None


def _jsonl_text(line: bytes, path: Path, offset: int, field: str) -> bytes:
    try:
        record = json_line(line)
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{path}: the line at byte {offset} has no string field {field!r} (set --text-field)")
        return utf8(text)
    except BadJsonLine as e:
        raise DataError(f"{path}: {e.what} in the line at byte {offset}: {e.detail}") from None


def iter_pieces(files: list[Path]) -> Iterator[Piece]:
    """The files as pieces of at most 16 MiB, in order (for reading every document one at a time)."""
    for path in files:
        yield from _pieces(path, path.stat().st_size, 1 << 24)


def iter_documents(files: list[Path], text_field: str) -> Iterator[bytes]:
    """Every document of the files, in order, one at a time (for training a tokenizer)."""
    for piece in iter_pieces(files):
        yield from read_documents(piece, text_field)
