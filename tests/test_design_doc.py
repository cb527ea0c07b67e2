"""docs/design.md's Layout is the map a newcomer reads first: it names every package under src/hyserve/ and
every top-level module, and no module or package that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "hyserve"


def layout() -> str:
    """The Layout section's text."""
    text = (ROOT / "docs" / "design.md").read_text()
    assert "\n## Layout\n" in text, "docs/design.md has no Layout section"
    return text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def packages() -> set[str]:
    return {p.parent.name for p in SRC.rglob("__init__.py") if p.parent != SRC}


def test_layout_names_every_package_and_no_other():
    named = set(re.findall(r"`([A-Za-z0-9_]+)/`", layout()))
    assert not packages() - named, f"packages missing from docs/design.md's Layout: {sorted(packages() - named)}"
    assert not named - packages(), f"docs/design.md's Layout names packages that are gone: {sorted(named - packages())}"


def test_layout_names_every_top_level_module_and_only_modules_that_exist():
    named = set(re.findall(r"`([A-Za-z0-9_]+\.(?:py|c))`", layout()))
    top = {p.name for p in SRC.glob("*.py") if p.name != "__init__.py"}
    assert not top - named, f"top-level modules missing from docs/design.md's Layout: {sorted(top - named)}"
    existing = {p.name for p in SRC.rglob("*") if p.suffix in (".py", ".c")}
    assert not named - existing, f"docs/design.md's Layout names modules that are gone: {sorted(named - existing)}"
