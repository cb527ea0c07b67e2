"""No import cycle anywhere in `hyserve`: a module never needs, however indirectly, a module that needs it.

Cycles hide in imports made inside a function or under `TYPE_CHECKING`, and in a package that re-exports
what its own modules import back; grimp reads every import statement in a module's source, wherever it
stands, so all of those count here."""

from __future__ import annotations

import graphlib
import sys
import textwrap

import grimp
import pytest


def import_cycle(package: str) -> list[str] | None:
    """One cycle of modules of `package` that import one another (the first module repeated at the end), or
    None when there is none."""
    graph = grimp.build_graph(package, cache_dir=None, exclude_type_checking_imports=False)
    sorter = graphlib.TopologicalSorter({m: graph.find_modules_directly_imported_by(m) for m in graph.modules})
    try:
        sorter.prepare()
    except graphlib.CycleError as e:
        return list(reversed(e.args[1]))
    return None


def package_cycle(package: str) -> list[str] | None:
    """One cycle among `package`'s subpackages and top-level modules, each taken whole (`server`, `engine`,
    `cache`, `models`, `model_thread`, ...), or None: the layers import in one direction."""
    graph = grimp.build_graph(package, cache_dir=None, exclude_type_checking_imports=False)

    def part(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    needs: dict[str, set[str]] = {}
    for module in graph.modules:
        needs.setdefault(part(module), set()).update(
            part(m) for m in graph.find_modules_directly_imported_by(module) if part(m) != part(module)
        )
    try:
        graphlib.TopologicalSorter(needs).prepare()
    except graphlib.CycleError as e:
        return list(reversed(e.args[1]))
    return None


def test_hyserve_has_no_import_cycle():
    cycle = import_cycle("hyserve")
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_hyserve_packages_import_in_one_direction():
    cycle = package_cycle("hyserve")
    assert cycle is None, "packages that import each other: " + " -> ".join(cycle)


@pytest.mark.parametrize("how", ["top", "function", "type_checking", "package"])
def test_a_cycle_is_found_however_it_hides(tmp_path, monkeypatch, how):
    """The check above can fail: a cycle made each way hyserve's state layer once made one is found."""
    name = f"cyclic_{how}"
    pkg = tmp_path / name
    pkg.mkdir()
    back = {
        "top": "from . import a\n",
        "function": "def f():\n    from . import a\n    return a\n",
        "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
        "package": f"from {name} import A\n",  # a module importing its package, which re-exports from it
    }[how]
    init = "from .a import A\n" if how == "package" else ""
    (pkg / "__init__.py").write_text(init)
    (pkg / "a.py").write_text("from .b import B\n\nclass A:\n    pass\n")
    (pkg / "b.py").write_text(textwrap.dedent(back) + "\nclass B:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cycle = import_cycle(name)
    assert cycle is not None and f"{name}.b" in cycle and cycle[0] == cycle[-1]
    sys.modules.pop(name, None)


def test_no_cycle_when_there_is_none(tmp_path, monkeypatch):
    pkg = tmp_path / "acyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("class B:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycle("acyclic") is None
