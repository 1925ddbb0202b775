"""tests/install_vllm_cpu.sh leaves nothing half-built: a version the package index does
not have stops it before anything is built, and a build that fails is removed.

Both ask the package index (the script looks every version up there first); where it
cannot be reached, they skip. Each runs a copy of the script in a temporary checkout, so
that this checkout's .vllm-envs/ is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "install_vllm_cpu.sh"


def _run(tmp_path, *versions, **env):
    (tmp_path / "tests").mkdir(exist_ok=True)
    shutil.copy(SCRIPT, tmp_path / "tests" / SCRIPT.name)
    r = subprocess.run(
        ["bash", str(tmp_path / "tests" / SCRIPT.name), *versions],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "curl: (" in r.stderr and "package index" not in r.stderr:
        pytest.skip(f"the package index is not reachable here: {r.stderr.strip()}")
    return r


def test_an_unknown_version_stops_it_in_one_line_with_nothing_built(tmp_path):
    r = _run(tmp_path, "9.9.9")
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr == (
        "install_vllm_cpu.sh: no vLLM 9.9.9 on the package index (no source "
        "distribution of that version); nothing built\n"
    )
    assert not (tmp_path / ".vllm-envs").exists()


def test_a_failed_build_is_removed(tmp_path):
    """A real release whose build fails (here: a torch that does not exist) leaves no
    environment behind, so neither the next run nor the test suite takes it for one."""
    r = _run(tmp_path, "0.34.0", TQ_TORCH_SPEC="torch==0.0.0")
    assert r.returncode != 0, r.stdout
    assert "torch==0.0.0" in r.stderr or "GB of disk" in r.stderr, r.stderr[-2000:]
    assert list((tmp_path / ".vllm-envs").iterdir()) == []
