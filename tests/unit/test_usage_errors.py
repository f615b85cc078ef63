"""A command line argparse refuses is one line naming the subcommand and exit 2, never the usage block."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from ddptrain.cli import _parser, main
from ddptrain.cli_parsers import OneLineParser

CASES = [
    (["train", "--bogus"], "ddptrain train", "unrecognized arguments: --bogus"),
    (["prepare", "--val-fraction", "x"], "ddptrain prepare", "argument --val-fraction: invalid float value: 'x'"),
    (["prepare", "--workers", "1.5"], "ddptrain prepare", "argument --workers: invalid int value: '1.5'"),
    (["export", "r", "--step", "x"], "ddptrain export", "argument --step: invalid int value: 'x'"),
    (["export", "r"], "ddptrain export", "the following arguments are required: --out"),
    (["eval", "r", "--batches", "x"], "ddptrain eval", "argument --batches: invalid int value: 'x'"),
    (["launch", "--max-restarts", "abc", "--", "train"], "ddptrain launch", "argument --max-restarts: invalid int"),
    (["launch", "--nnodes"], "ddptrain launch", "argument --nnodes: expected one argument"),
    (["launch", "--worker-start", "nope"], "ddptrain launch", "argument --worker-start: invalid choice: 'nope'"),
    (["launch", "--rdzv-timeout", "1e9999"], "ddptrain launch", "argument --rdzv-timeout: invalid int value"),
    (["launch", "--fault-tolerance", "tf"], "ddptrain launch", "argument --fault-tolerance: invalid choice: 'tf'"),
    (["launch", "--replica-group", "a"], "ddptrain launch", "argument --replica-group: invalid int value: 'a'"),
    (["report"], "ddptrain report", "the following arguments are required: run_dir"),
    (["doctor", "--timeout", "x"], "ddptrain doctor", "argument --timeout: invalid float value: 'x'"),
    (["doctor", "--backend", "mpi"], "ddptrain doctor", "argument --backend: invalid choice: 'mpi'"),
    (["triage"], "ddptrain triage", "the following arguments are required: run_dir"),
    (["verify-resume", "r", "--steps", "x"], "ddptrain verify-resume", "argument --steps: invalid int value: 'x'"),
    (["generate", "r", "--top-k", "1.5"], "ddptrain generate", "argument --top-k: invalid int value: '1.5'"),
    (["slurm", "--nodes", "x"], "ddptrain slurm", "argument --nodes: invalid int value: 'x'"),
    (["slurm", "--step-seconds", "soon"], "ddptrain slurm", "argument --step-seconds: invalid float value"),
    (["k8s"], "ddptrain k8s", "the following arguments are required: --image"),
    (["lighthouse"], "ddptrain lighthouse", "the following arguments are required: --bind"),
    (
        ["lighthouse", "--bind", "h:1", "--min-replicas", "x"],
        "ddptrain lighthouse",
        "argument --min-replicas: invalid int",
    ),
    (["k8s", "--image", "i", "--gang", "slurm"], "ddptrain k8s", "argument --gang: invalid choice: 'slurm'"),
    ([], "ddptrain", "the following arguments are required: COMMAND"),
    (["nosuch"], "ddptrain", "argument COMMAND: invalid choice: 'nosuch'"),
]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_subcommand_parser_refuses_in_one_line() -> None:
    assert {name: type(p) for name, p in subcommands().items()} == {name: OneLineParser for name in subcommands()}
    assert {argv[0] for argv, prog, _ in CASES if prog != "ddptrain"} == set(subcommands())  # a case for each


@pytest.mark.parametrize(("argv", "prog", "message"), CASES)
def test_a_refused_command_line_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], prog: str, message: str
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: {message}") and err.endswith(f"(see {prog} --help)\n"), err
    assert "usage:" not in err


def test_help_still_shows_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["launch", "--help"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("usage: ddptrain launch")


def test_a_factory_of_ones_own_is_found_in_the_current_folder_or_named_how(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `ddptrain` console script puts no folder on sys.path: a Python-API run's factories (model.target,
    data.target recorded from a script) are looked up in the current folder too, after everything installed;
    not found there either, the one line says how to make them importable."""
    from ddptrain.errors import ConfigError
    from ddptrain.targets import import_target

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "api_factories_i38.py").write_text("def build(width=3):\n    return width * 2\n")
    assert import_target("api_factories_i38:build", "model.target")(width=4) == 8
    with pytest.raises(ConfigError) as refused:
        import_target("no_such_factories_i38:build", "data.target")
    line = str(refused.value)
    assert "cannot import 'no_such_factories_i38'" in line and "\n" not in line
    assert "run from the folder holding no_such_factories_i38.py" in line and "PYTHONPATH" in line
    sys.modules.pop("api_factories_i38", None)
