"""The house keeps its shape: import-linter's contracts hold on the tree (and fail on a planted upward
import or circle), no module or function outgrows its limit, and docs/architecture.md shows the layers
the contract declares.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "ddptrain"
MAX_MODULE_LINES = 800  # a module is one concept: split by meaning, never to meet a count
MAX_FUNCTION_LINES = 60
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
LAYERS_BLOCK_HEADER = "# layers, top first (pyproject.toml [tool.importlinter], checked by `make lint`)"


def contract_layers() -> list[str]:
    """The layers of pyproject.toml's layers contract, top first."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [str(layer) for layer in layers]


def lint_imports(source_root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter with the repository's contracts, on the ddptrain package found under `source_root`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source_root), str(ROOT)])}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def planted_copy(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package with `line` appended to `module` (a path under ddptrain/); its source root."""
    shutil.copytree(PACKAGE, tmp_path / "ddptrain", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "ddptrain" / module
    target.write_text(target.read_text() + f"\n{line}  # noqa: E402,F401\n")
    return tmp_path


def test_the_contracts_hold_on_the_tree() -> None:
    result = lint_imports(ROOT / "src")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


def test_a_planted_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    """Not vacuous: the data sampler (a low layer) importing the CLI (the top) fails the contract."""
    result = lint_imports(planted_copy(tmp_path, "data/sampler.py", "import ddptrain.cli"))
    assert result.returncode != 0
    assert "ddptrain.data.sampler -> ddptrain.cli" in result.stdout


def test_a_planted_circle_inside_a_layer_breaks_the_contract(tmp_path: Path) -> None:
    """Two checkpoint modules importing each other (the circle issue 28 removed) fail the circle contract."""
    result = lint_imports(planted_copy(tmp_path, "checkpoint/formats/base.py", "import ddptrain.checkpoint.verify"))
    assert result.returncode != 0
    assert "No cycles are allowed in ddptrain" in result.stdout


def test_no_module_or_function_outgrows_its_limit() -> None:
    too_big: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_big.append(f"{name}:{node.name}: {length} lines")
    assert not too_big, too_big


def test_the_architecture_doc_shows_the_contracts_layers() -> None:
    """docs/architecture.md's layer block lists exactly the contract's layers, in its order."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert LAYERS_BLOCK_HEADER in text, f"docs/architecture.md lacks the block headed {LAYERS_BLOCK_HEADER!r}"
    block = text.split(LAYERS_BLOCK_HEADER, 1)[1].split("```", 1)[0]
    shown = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]
    assert [line for line in shown if line] == contract_layers()
