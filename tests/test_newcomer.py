"""The newcomer check of issue 19 (``make newcomer``, ``scripts/newcomer_check.py``) passes:
each of its checks runs the installed command against real mounts and servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "newcomer_check.py"


def test_the_newcomer_check_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, check=False
    )
    passed = [line for line in result.stdout.splitlines() if line.startswith("PASS")]
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(passed) == 9, result.stdout
    assert "9 of 9 passed" in result.stdout
