"""The repository passes its static checks: ruff (pyflakes, pycodestyle, bugbear, pyupgrade, simplify,
complexity; configured in pyproject.toml). Part of the default test run, so CI and the README's test
command check it too; `pre-commit install` runs the same check before each commit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the dev extra: pip install '.[dev]')")
    p = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
