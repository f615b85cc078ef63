"""Columnar documents to prepare: Parquet files, Arrow files and folders saved by Hugging Face `datasets`.

One row is one document, its text in a named string column. A piece of such a file is a range of
its row groups (Parquet) or record batches (Arrow), so a large file is split into tasks as a large
JSON Lines file is, and a worker reads only the text column of its own range: Parquet row groups
are read on their own, and an Arrow file is memory-mapped (its batches are views of the mapping,
not copies). The main process reads only file metadata, so its memory does not depend on the corpus.

A folder saved by `datasets.Dataset.save_to_disk` is its Arrow files in the order its `state.json`
lists them (they are Arrow IPC streams, as `datasets` writes them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddptrain.errors import DataError

PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
SAVED_DATASET_STATE = "state.json"  # what `save_to_disk` writes beside a dataset's Arrow files


def is_table(path: Path) -> bool:
    """True for files read as tables of documents (Parquet or Arrow)."""
    return path.suffix in PARQUET_SUFFIXES + ARROW_SUFFIXES


def saved_dataset_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a folder saved by `datasets` (None when folder is not one). A DatasetDict's
    folder (several splits) is refused: the split to prepare must be named."""
    if (folder / "dataset_dict.json").is_file():
        raise DataError(f"{folder} holds several splits of a saved dataset: name one (e.g. {folder / 'train'})")
    state_file = folder / SAVED_DATASET_STATE
    if not state_file.is_file():
        return None
    try:
        state = json.loads(state_file.read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state_file} is not the state.json of a saved dataset ({type(e).__name__})") from None
    files = [folder / name for name in names if isinstance(name, str) and "/" not in name and name.endswith(".arrow")]
    if len(files) != len(names) or not files:
        raise DataError(f"{state_file} lists no Arrow files of its own folder")
    return files


def _pyarrow(path: Path) -> Any:
    """pyarrow (installed with the `datasets` extra), or a DataError saying how to get it."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (pyarrow.parquet is a submodule: imported for its attribute)
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install 'ddptrain[datasets]'") from None
    return pyarrow


def unit_sizes(path: Path) -> list[int]:
    """The bytes of each row group (Parquet) or record batch (Arrow) of a table file, in order."""
    pa = _pyarrow(path)
    pq = pa.parquet

    try:
        if path.suffix in PARQUET_SUFFIXES:
            meta = pq.ParquetFile(path).metadata
            return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
        with pa.memory_map(str(path)) as source:
            return [batch.nbytes for batch in _open_arrow(source, path)]
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    except pa.ArrowException as e:
        raise DataError(f"{path} is not a readable {path.suffix[1:]} file: {_first_line(e)}") from None


def table_pieces(path: Path, task_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(start, end, bytes) of consecutive unit ranges of a table file, each about task_bytes (at least one unit)."""
    start, held = 0, 0
    sizes = unit_sizes(path)
    for i, size in enumerate(sizes):
        held += size
        if held >= task_bytes:
            yield start, i + 1, held
            start, held = i + 1, 0
    if start < len(sizes):
        yield start, len(sizes), held


def read_table_documents(path: Path, start: int, end: int, field: str) -> Iterator[bytes]:
    """The documents (UTF-8) in the text column `field` of units [start, end) of a table file; empty
    and null cells are skipped (as blank JSON Lines lines are)."""
    pa = _pyarrow(path)
    pq = pa.parquet

    try:
        if path.suffix in PARQUET_SUFFIXES:
            table = pq.ParquetFile(path).read_row_groups(range(start, end), columns=[_checked(path, field)])
            yield from _texts(table.column(0).to_pylist())
            return
        with pa.memory_map(str(path)) as source:
            for i, batch in enumerate(_open_arrow(source, path)):
                if start <= i < end:
                    yield from _texts(batch.column(_arrow_field(batch.schema, path, field)).to_pylist())
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    except pa.ArrowException as e:
        raise DataError(f"{path} is not a readable {path.suffix[1:]} file: {_first_line(e)}") from None


def _checked(path: Path, field: str) -> str:
    """field, when the Parquet file has it as a string column; else a DataError naming the columns."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    _arrow_field(schema, path, field)
    return field


def _arrow_field(schema: Any, path: Path, field: str) -> int:
    import pyarrow as pa

    index = schema.get_field_index(field)
    if index < 0:
        columns = ", ".join(schema.names[:8])
        raise DataError(f"{path} has no column {field!r} (its columns: {columns}; set --text-field)")
    kind = schema.field(index).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {field!r} holds {kind}, not text (set --text-field)")
    return int(index)


def _open_arrow(source: Any, path: Path) -> Any:
    """The record batches of an Arrow file: the IPC stream format `datasets` writes, or the file format."""
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        reader = pa.ipc.open_file(source)
        return (reader.get_batch(i) for i in range(reader.num_record_batches))


def _texts(values: list[Any]) -> Iterator[bytes]:
    for value in values:
        if value:  # None (a null cell) or ""
            yield str(value).encode("utf-8")


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
