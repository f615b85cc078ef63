"""The configuration reference documents every key."""

from __future__ import annotations

from pathlib import Path

from ddptrain.config import Config

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_config_key_is_documented() -> None:
    text = DOC.read_text()
    for section_name, field in Config.model_fields.items():
        assert f"\n{section_name}:\n" in text, section_name
        for name, f in field.annotation.model_fields.items():  # type: ignore[union-attr]
            assert f"  {f.alias or name} = " in text, f"{section_name}.{f.alias or name} missing from {DOC.name}"
