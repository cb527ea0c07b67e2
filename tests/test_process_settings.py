"""Importing hyserve changes nothing in the process; its commands set the process up at start, before torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
SETTINGS = ("THP_MEM_ALLOC_ENABLE", "HF_HUB_OFFLINE", "TRANSFORMERS_NO_ADVISORY_WARNINGS", "HYSERVE_HUGE_PAGES")


def _run(code: str, **env) -> dict:
    """Run `code` in a fresh interpreter without hyserve's settings in its environment (plus `env`); it prints
    one JSON value, returned."""
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    base["PYTHONPATH"] = os.pathsep.join([SRC, base.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


IMPORT_ALL = """
import importlib, json, os, pkgutil
for library in ("torch", "transformers", "ray.serve"):  # what they set on import is theirs (Ray: RAY_CLIENT_MODE)
    try:
        importlib.import_module(library)
    except ModuleNotFoundError:
        pass
before = dict(os.environ)
import hyserve
skipped = []
for info in pkgutil.walk_packages(hyserve.__path__, "hyserve."):
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:  # an optional extra that is not installed (ray, gguf, ...)
        if exc.name.split(".")[0] == "hyserve":
            raise
        skipped.append(info.name)
after = dict(os.environ)
print(json.dumps({"changed": {k: [before.get(k), after.get(k)] for k in set(before) | set(after)
                              if before.get(k) != after.get(k)},
                  "imported": sum(1 for _ in pkgutil.walk_packages(hyserve.__path__, "hyserve.")),
                  "skipped": skipped}))
"""


def test_importing_hyserve_and_every_submodule_leaves_the_environment_alone():
    out = _run(IMPORT_ALL)
    assert out["changed"] == {}
    assert out["imported"] > 50 and len(out["skipped"]) < out["imported"] // 4, out


CLI = """
import json, os, sys
from hyserve.cli import main
torch_first = "torch" in sys.modules
main([])  # bare `hyserve`: its help
print(json.dumps({"torch_before_settings": torch_first, **{k: os.environ.get(k) for k in %r}}))
""" % (SETTINGS,)  # noqa: UP031 (the script's own braces)


def test_the_cli_sets_the_process_up_before_torch():
    out = _run(CLI)
    assert out["torch_before_settings"] is False  # PyTorch reads THP_MEM_ALLOC_ENABLE at its first allocation
    assert out["THP_MEM_ALLOC_ENABLE"] == "1" and out["HF_HUB_OFFLINE"] == "1"
    assert out["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"


def test_the_cli_keeps_explicit_settings():
    out = _run(CLI, HYSERVE_HUGE_PAGES="0", THP_MEM_ALLOC_ENABLE="1", HF_HUB_OFFLINE="0")
    assert out["THP_MEM_ALLOC_ENABLE"] is None  # HYSERVE_HUGE_PAGES=0: PyTorch keeps 4 KiB pages
    assert out["HF_HUB_OFFLINE"] == "0"
