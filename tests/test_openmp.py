"""torch's OpenMP workers spin between parallel regions when hyserve is imported first (hyserve.openmp)."""

import os
import subprocess
import sys

import pytest

SCRIPT = "import os, hyserve, torch; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"


def run(script: str, **env: str) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter whose libgomp prints the settings it loaded with (OMP_DISPLAY_ENV)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "HYSERVE_OMP_ACTIVE")}
    return subprocess.run([sys.executable, "-c", script], env={**base, "OMP_DISPLAY_ENV": "TRUE", **env},
                          capture_output=True, text=True, check=True)


def loaded_policy(out: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in out.stderr.splitlines() if "OMP_WAIT_POLICY" in ln]
    if not lines:
        pytest.skip("this OpenMP runtime does not display its settings")
    return lines[0].split("=")[1].strip().strip("'")


def test_workers_spin_and_later_processes_get_their_own_defaults():
    out = run(SCRIPT)
    assert loaded_policy(out) == "ACTIVE"
    assert out.stdout.split() == ["None", "None"]  # taken out of the environment again


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"HYSERVE_OMP_ACTIVE": "0"}])
def test_a_users_setting_is_left_alone(env):
    assert loaded_policy(run(SCRIPT, **env)) != "ACTIVE"


def test_no_effect_once_torch_is_loaded():
    out = run("import torch, hyserve.openmp as o; print(o.wait_actively())")
    assert out.stdout.strip() == "False" and loaded_policy(out) != "ACTIVE"
