"""Test markers follow the folders: `-m "not dist and not cluster"` selects exactly tests/unit."""

from __future__ import annotations

import re

import pytest
from helpers import TESTS_DIR


@pytest.mark.parametrize("folder", ["dist", "cluster"])
def test_every_test_file_in_a_marked_folder_declares_its_marker(folder: str) -> None:
    files = sorted((TESTS_DIR / folder).glob("test_*.py"))
    assert files
    missing = [f.name for f in files if f"\npytestmark = pytest.mark.{folder}\n" not in f.read_text()]
    assert not missing, f"tests/{folder} files without `pytestmark = pytest.mark.{folder}`: {missing}"


def test_unit_tests_carry_no_folder_marker() -> None:
    declaration = re.compile(r"^(pytestmark = |\s*@)pytest\.mark\.(dist|cluster)\b", re.MULTILINE)
    marked = [f.name for f in sorted((TESTS_DIR / "unit").glob("test_*.py")) if declaration.search(f.read_text())]
    assert not marked, f"tests/unit files marked dist or cluster: {marked}"


def test_the_folder_hook_marks_what_was_collected(request: pytest.FixtureRequest) -> None:
    """This very test sits in tests/unit: the conftest hook gave it neither marker."""
    assert request.node.get_closest_marker("dist") is None and request.node.get_closest_marker("cluster") is None


def test_test_file_names_are_unique_across_folders() -> None:
    """pytest imports test files by their base name (no packages): two of the same name break collection."""
    names = [f.name for f in TESTS_DIR.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
