"""Prepare from tables: Parquet and Arrow files and folders saved by `datasets` give the tokens JSON Lines gives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.cli import main
from ddptrain.config import config_from_mapping
from ddptrain.data.corpus import PrepareOptions, expand_sources, prepare_corpus, read_meta
from ddptrain.data.kinds import data_source
from ddptrain.data.source import Sampling
from ddptrain.data.sources import plan_tasks
from ddptrain.dist import DistContext
from ddptrain.errors import ConfigError, DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ONE_TASK = PrepareOptions(task_bytes=1 << 30, workers=1)
texts = st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=40), min_size=1, max_size=12)


def write_tables(folder: Path, docs: list[str | None], rows_per_unit: int) -> dict[str, Path]:
    """The same documents as .jsonl (nulls left out), .parquet and .arrow (an IPC stream, as `datasets` writes)."""
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), "body": pa.array(docs, pa.string())})
    paths = {kind: folder / f"docs.{kind}" for kind in ("jsonl", "parquet", "arrow")}
    paths["jsonl"].write_text("".join(json.dumps({"body": d}) + "\n" for d in docs if d))
    pq.write_table(table, paths["parquet"], row_group_size=rows_per_unit)
    with pa.OSFile(str(paths["arrow"]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=rows_per_unit):
            writer.write_batch(batch)
    return paths


def shard_hashes(out: Path) -> list[str]:
    meta = read_meta(out)
    return [s["sha256"] for split in ("train", "val") for s in meta["shards"][split]]


@given(docs=texts, rows=st.integers(1, 5))
@settings(max_examples=15, deadline=None)  # each example prepares three corpora
def test_a_table_prepares_the_tokens_json_lines_give(
    tmp_path_factory: pytest.TempPathFactory, docs: list[str], rows: int
) -> None:
    folder = tmp_path_factory.mktemp("tables")
    docs = [d * (1 + 2000 // sum(len(x.encode()) for x in docs)) for d in docs]  # past prepare's minimum corpus
    paths = write_tables(folder, [*docs, None, ""], rows)  # null and empty cells are skipped, as blank lines are
    how = PrepareOptions(text_field="body", task_bytes=ONE_TASK.task_bytes, workers=1)
    made = {kind: prepare_corpus([path], folder / f"out-{kind}", 0.25, how) for kind, path in paths.items()}
    assert {info.documents for info in made.values()} == {len(docs)}
    reference = shard_hashes(folder / "out-jsonl")
    assert shard_hashes(folder / "out-parquet") == reference and shard_hashes(folder / "out-arrow") == reference


def test_a_large_table_is_cut_at_row_groups_and_loses_nothing(tmp_path: Path) -> None:
    docs = [f"document {i} " * (1 + i % 7) for i in range(200)]
    paths = write_tables(tmp_path, list(docs), rows_per_unit=10)
    for kind in ("parquet", "arrow"):
        tasks = list(plan_tasks([paths[kind]], task_bytes=256))
        assert len(tasks) > 5  # the file is split, not one task
        units = [(p.start, p.end) for t in tasks for p in t.pieces]
        assert [a for a, _ in units] == [0, *(b for _, b in units[:-1])] and units[-1][1] == 20  # contiguous, all
        info = prepare_corpus(
            [paths[kind]], tmp_path / f"out-{kind}", 0.1, PrepareOptions(text_field="body", task_bytes=256)
        )
        assert info.documents == len(docs)
        assert info.train_tokens + info.val_tokens == sum(len(d.encode()) for d in docs)


def test_a_folder_saved_by_datasets_is_its_arrow_files(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    docs = [f"row {i}: " + "abc" * i for i in range(50)]
    saved = datasets.Dataset.from_dict({"body": docs, "n": list(range(50))})
    saved.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    files = expand_sources([str(tmp_path / "saved")])
    assert [f.suffix for f in files] == [".arrow", ".arrow"]  # not state.json or dataset_info.json
    info = prepare_corpus(files, tmp_path / "out", 0.1, PrepareOptions(text_field="body"))
    assert info.documents == 50 and info.train_tokens + info.val_tokens == sum(len(d.encode()) for d in docs)
    datasets.DatasetDict({"train": saved}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match="several splits of a saved dataset: name one"):
        expand_sources([str(tmp_path / "dict")])


def test_tables_that_cannot_be_read_are_refused_with_one_line(tmp_path: Path) -> None:
    paths = write_tables(tmp_path, ["a", "b"], 1)
    for kind in ("parquet", "arrow"):
        with pytest.raises(DataError, match=r"has no column 'text' \(its columns: id, body; set --text-field\)"):
            prepare_corpus([paths[kind]], tmp_path / f"out-{kind}", 0.1)
        with pytest.raises(DataError, match="column 'id' holds int64, not text"):
            prepare_corpus([paths[kind]], tmp_path / f"out2-{kind}", 0.1, PrepareOptions(text_field="id"))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(paths["parquet"].read_bytes()[:-20])
    with pytest.raises(DataError, match="broken.parquet is not a readable parquet file"):
        prepare_corpus([broken], tmp_path / "out3", 0.1, PrepareOptions(text_field="body"))


def test_the_command_exits_2_naming_the_missing_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = write_tables(tmp_path, ["some text " * 1000], 1)
    assert main(["prepare", str(paths["parquet"]), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no column 'text'" in err[0], err
    assert not (tmp_path / "out" / "meta.json").exists()
    assert main(["prepare", str(paths["parquet"]), "--text-field", "body", "--out", str(tmp_path / "out")]) == 0
    assert "prepared 1 files (1 documents)" in capsys.readouterr().out


def test_data_hf_prepares_on_first_use_and_again_when_its_files_change(tmp_path: Path) -> None:
    paths = write_tables(tmp_path / "in", [f"row {i} " * 60 for i in range(40)], 8)
    corpus = tmp_path / "corpus"
    hf = {"files": [str(paths["parquet"])], "text_field": "body"}
    source = data_source(config_from_mapping({"data": {"dir": str(corpus), "hf": hf}}).data)
    assert source.kind == "hf"
    source.prepare(DistContext(), wait_s=10)
    first = shard_hashes(corpus)
    published = (corpus / "meta.json").stat().st_mtime_ns
    source.prepare(DistContext(), wait_s=10)  # the same files: nothing prepared again
    assert (corpus / "meta.json").stat().st_mtime_ns == published
    write_tables(tmp_path / "in", [f"other {i} " * 60 for i in range(40)], 8)
    again = data_source(config_from_mapping({"data": {"dir": str(corpus), "hf": hf}}).data)
    again.prepare(DistContext(), wait_s=10)
    assert shard_hashes(corpus) != first
    train, val = again.datasets(Sampling(block_size=32, global_batch=8, seed=0))
    assert len(train) > 0 and val is not None and again.vocab_size() == 256  # type: ignore[arg-type]


def test_data_hf_reads_a_split_of_a_saved_dataset_dict(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"text": [f"line {i} " * 50 for i in range(60)]})
    datasets.DatasetDict({"train": rows, "test": rows.select(range(5))}).save_to_disk(str(tmp_path / "saved"))
    cfg = {"dir": str(tmp_path / "corpus"), "hf": {"files": [str(tmp_path / "saved")]}}
    with pytest.raises(DataError, match=r"holds several splits: set data.hf.split \(e.g. train\)"):
        data_source(config_from_mapping({"data": cfg}).data).prepare(DistContext(), wait_s=10)
    cfg["hf"]["split"] = "train"  # type: ignore[index]
    data_source(config_from_mapping({"data": cfg}).data).prepare(DistContext(), wait_s=10)
    assert read_meta(tmp_path / "corpus")["files"] == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"hf": {"files": ["x.parquet"]}}, "data.hf prepares its shards into data.dir: set data.dir"),
        ({"dir": "d", "hf": {"files": ["x.parquet"]}, "target": "m:f"}, "data.target and data.hf all name the data"),
        ({"dir": "d", "hf": {"files": []}}, "data.hf.files: List should have at least 1 item"),
    ],
)
def test_data_hf_settings_that_cannot_work_are_refused(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_mapping({"data": data})
