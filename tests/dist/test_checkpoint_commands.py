"""Commands that read a run's checkpoints: `export` on a full or read-only disk (one line, exit 2, nothing
left behind, nothing of the user's lost), `generate` from the verified manifest's config (never the
unverified config.yaml) with the tokenizer its meta.json records.

The runs are trained once per module (a tiny GPT, seconds); each command runs in this process.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TINY, folder_bytes, mounted_tmpfs, one_line_exit_2, run_ddptrain

from ddptrain.cli import main
from ddptrain.data.prepare import PrepareOptions, prepare_corpus

pytestmark = pytest.mark.dist

GENERATE = ["--prompt", "def ", "--max-new-tokens", "8", "--seed", "3"]


@pytest.fixture(scope="module")
def trained(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("export") / "run"
    proc = run_ddptrain(["train", *TINY, f"data.dir={corpus_dir}", f"run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (the model's weights do not fit)."""
    with mounted_tmpfs(tmp_path / "small", "64k") as mnt:
        yield mnt


def test_export_to_a_full_disk_is_one_line_and_leaves_nothing(
    trained: Path, tmpfs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmpfs / "new" / "deeper" / "model.safetensors"
    line = one_line_exit_2(["export", str(trained), "--out", str(out)], capsys)
    assert "No space left on device" in line and str(tmpfs / "new" / "deeper") in line, line
    assert list(tmpfs.iterdir()) == []  # no partial file, no folder it created, no temp folder
    (tmpfs / "notes.txt").write_text("the user's\n")
    (tmpfs / "model.json").write_text("an older export's config\n")
    before = folder_bytes(tmpfs)
    line = one_line_exit_2(["export", str(trained), "--out", str(tmpfs / "model.safetensors")], capsys)
    assert "No space left on device" in line and str(tmpfs) in line, line
    assert folder_bytes(tmpfs) == before  # what was there is untouched
    if importlib.util.find_spec("transformers") is not None:  # --format hf: a folder, written the same way
        line = one_line_exit_2(["export", str(trained), "--format", "hf", "--out", str(tmpfs / "hf")], capsys)
        assert "No space left on device" in line and str(tmpfs / "hf") in line, line
        assert folder_bytes(tmpfs) == before


def test_export_to_a_read_only_disk_is_one_line_and_changes_nothing(
    trained: Path, tmpfs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmpfs / "keep.txt").write_text("kept\n")
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    for out in (tmpfs / "model.safetensors", tmpfs / "sub" / "model.safetensors"):
        line = one_line_exit_2(["export", str(trained), "--out", str(out)], capsys)
        assert "Read-only file system" in line and str(tmpfs) in line, line
    assert sorted(p.name for p in tmpfs.iterdir()) == ["keep.txt"]


def test_export_lands_whole_and_replaces_a_planted_link_instead_of_following_it(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a" / "b" / "model.safetensors"
    assert main(["export", str(trained), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp folder left beside it
    victim = tmp_path / "victim"
    victim.write_text("not an export\n")
    inside = trained / "export"
    inside.mkdir(exist_ok=True)
    (inside / "model.safetensors").symlink_to(victim)
    assert main(["export", str(trained), "--out", str(inside / "model.safetensors")]) == 0
    assert victim.read_text() == "not an export\n" and not (inside / "model.safetensors").is_symlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (trained / "exports").symlink_to(elsewhere)
    try:
        line = one_line_exit_2(["export", str(trained), "--out", str(trained / "exports" / "m.safetensors")], capsys)
    finally:
        (trained / "exports").unlink()
    assert "refusing to follow a symbolic link" in line and list(elsewhere.iterdir()) == [], line


def sample(run_dir: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    rc = main(["generate", str(run_dir), *GENERATE, *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_generate_reads_the_verified_manifest_not_config_yaml(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = trained / "config.yaml"
    original = config.read_bytes()
    expected = sample(trained, capsys)
    try:
        for broken in (original[: len(original) // 2], original + b"bogus: 1\n", b"model: {n_layer: 7}\n"):
            config.write_bytes(broken)
            assert sample(trained, capsys) == expected
        config.unlink()
        assert sample(trained, capsys) == expected
    finally:
        config.write_bytes(original)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained on a corpus with its own BPE tokenizer.json (needs the tokenizers package)."""
    pytest.importorskip("tokenizers")
    base = tmp_path_factory.mktemp("bpe")
    docs = base / "docs.txt"
    docs.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(400)))
    prepare_corpus([docs], base / "corpus", 0.1, PrepareOptions("train:300", workers=1))
    run_dir = base / "run"
    proc = run_ddptrain(["train", *TINY, f"data.dir={base / 'corpus'}", f"run.dir={run_dir}", "train.max_steps=3"])
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_generate_refuses_a_tokenizer_swapped_after_training(bpe_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = bpe_run.parent / "corpus"
    tokenizer = corpus / "tokenizer.json"
    original = tokenizer.read_bytes()
    sample(bpe_run, capsys)  # the recorded one works
    try:
        # Same vocabulary size, one token's text changed: every sample would silently decode differently.
        tokenizer.write_bytes(re.sub(rb'"def"', b'"fed"', original, count=1))
        line = one_line_exit_2(["generate", str(bpe_run), *GENERATE], capsys)
        assert f"tokenizer {tokenizer} does not match the SHA-256 its meta.json records" in line, line
        os.remove(tokenizer)
        os.mkfifo(tokenizer)  # never opened for a read that waits on a writer
        line = one_line_exit_2(["generate", str(bpe_run), *GENERATE], capsys)
        assert f"cannot read tokenizer {tokenizer}" in line, line
    finally:
        os.remove(tokenizer)
        tokenizer.write_bytes(original)
