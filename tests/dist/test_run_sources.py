"""Python-API runs stay usable: config.yaml says where the model and data came from, or that they were live.

A run given live objects is refused by eval/export/generate with exit 2 and one line naming the key to
set or the option to pass (never a load_state_dict traceback), and works once it is given; one given importable factories records them as targets, and a
live built-in GPT as the built-in GPT, so `ddptrain eval` rebuilds both and repeats the trainer's val_loss.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TESTS_DIR, env_for_subprocess

from ddptrain.cli import main

pytestmark = pytest.mark.dist
REGRESSION = TESTS_DIR.parent / "examples" / "regression"
LOSS = re.compile(
    r"samples, loss (\d+\.\d+)(?:, perplexity [\d.]+)?$", re.MULTILINE
)  # perplexity for language models only
MODEL = ["model.target=regression:build_model", "model.kwargs={dim: 4, hidden: 16, depth: 1}"]
DATA = ["data.target=regression:build_datasets", "data.kwargs={n_train: 256, n_val: 40, dim: 4}"]


@pytest.fixture(autouse=True)
def regression_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REGRESSION))  # the in-process commands import the factories too


def api_output(mode: str, run_dir: Path, *args: str) -> list[str]:
    """Run tests/api_sources_worker.py in a process of its own; the lines it printed."""
    env = env_for_subprocess({"PYTHONPATH": f"{REGRESSION}:{TESTS_DIR}:{env_for_subprocess()['PYTHONPATH']}"})
    cmd = [sys.executable, str(TESTS_DIR / "api_sources_worker.py"), mode, str(run_dir), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def train_through_api(mode: str, run_dir: Path, *args: str) -> float:
    """The val_loss the worker's RunResult reports."""
    return float(api_output(mode, run_dir, *args)[-1].removeprefix("val_loss "))


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def evaluated(argv: list[str], capsys: pytest.CaptureFixture[str]) -> float:
    assert main(argv) == 0
    found = LOSS.search(capsys.readouterr().out)
    assert found
    return float(found[1])


@pytest.mark.timeout(180)
def test_live_objects_are_recorded_and_every_command_names_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "live"
    val_loss = train_through_api("live", run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["target"] is None and saved["model"]["live"] == "regression:MLP"
    assert saved["data"]["live"] == "regression:WavesDataset, regression:WavesDataset"
    before = folder_bytes(run)

    assert "add model.target=pkg.module:factory" in refused(["eval", str(run)], capsys)
    assert "add data.target=pkg.module:factory" in refused(["eval", str(run), *MODEL], capsys)
    assert "export without --format hf" in refused(
        ["export", str(run), "--format", "hf", "--out", str(tmp_path / "x")], capsys
    )
    assert not (tmp_path / "x").exists()
    assert "generate samples from the built-in GPT and model.hf models" in refused(["generate", str(run)], capsys)
    weights = tmp_path / "weights.safetensors"
    assert main(["export", str(run), "--out", str(weights)]) == 0 and weights.is_file()  # the weights need nothing
    assert "ddptrain train: error: model.live=" in refused(["train", "-c", str(run / "config.yaml")], capsys)
    assert folder_bytes(run) == before  # a refused or exporting command leaves the run folder as it was
    # Named on the command line, the same model and data give the trainer's number.
    assert evaluated(["eval", str(run), *MODEL, *DATA, "--batches", "2"], capsys) == pytest.approx(val_loss, abs=2e-6)


@pytest.mark.timeout(180)
def test_importable_factories_become_targets_and_eval_repeats_the_val_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "factory"
    val_loss = train_through_api("factory", run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["model"]["target"], saved["model"]["live"]) == ("regression:build_model", None)
    assert (saved["data"]["target"], saved["data"]["live"]) == ("regression:build_datasets", None)
    assert evaluated(["eval", str(run), "--batches", "2"], capsys) == pytest.approx(val_loss, abs=2e-6)


@pytest.mark.timeout(180)
def test_a_live_built_in_gpt_is_recorded_as_the_built_in_gpt(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "gpt"
    val_loss = train_through_api("gpt", run, str(corpus_dir))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["live"] is None and saved["model"]["n_embd"] == 32 and saved["model"]["n_layer"] == 1
    assert evaluated(["eval", str(run), "--batches", "2"], capsys) == pytest.approx(val_loss, abs=2e-6)
    assert main(["generate", str(run), "--max-new-tokens", "4"]) == 0


@pytest.mark.timeout(180)
def test_live_datasets_for_the_built_in_gpt_ask_for_the_corpus_or_work(
    corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "live-data"
    lines = api_output("live-data", run, str(corpus_dir))
    assert "config unchanged True" in lines  # the caller's Config: data.live went into a copy
    val_loss = float(lines[-1].removeprefix("val_loss "))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["live"] == "ddptrain.data.dataset:TokenDataset, ddptrain.data.dataset:TokenDataset"
    before = folder_bytes(run)

    assert "add data.target=pkg.module:factory" in refused(["eval", str(run)], capsys)
    assert "pass --data-dir DIR" in refused(["generate", str(run)], capsys)
    hf_out = tmp_path / "hf"
    assert "pass --data-dir DIR" in refused(["export", str(run), "--format", "hf", "--out", str(hf_out)], capsys)
    assert not hf_out.exists() and folder_bytes(run) == before
    # What each asked for makes it work: the corpus the live datasets were cut from.
    corpus = ["data.live=null", f"data.dir={corpus_dir}"]
    assert evaluated(["eval", str(run), *corpus, "--batches", "2"], capsys) == pytest.approx(val_loss, abs=2e-6)
    assert main(["generate", str(run), "--data-dir", str(corpus_dir), "--max-new-tokens", "4"]) == 0
    assert main(["export", str(run), "--format", "hf", "--data-dir", str(corpus_dir), "--out", str(hf_out)]) == 0
    assert (hf_out / "tokenizer.json").is_file()
    assert main(["export", str(run), "--out", str(tmp_path / "w.safetensors")]) == 0
