"""The API reference (docs/api, Sphinx autodoc over the docstrings) builds with warnings as errors.

So a docstring that breaks reStructuredText, or a page that names an object that no longer exists, fails
the default test run instead of rotting unnoticed. Skipped only where Sphinx is not installed (it is in
the ``dev`` extra, which CI installs).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import ROOT

pytestmark = pytest.mark.timeout(300)


def test_api_reference_builds_without_warnings(tmp_path: Path) -> None:
    pytest.importorskip("sphinx", reason="sphinx is in the dev extra (pip install '.[dev]')")
    out = tmp_path / "html"
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(ROOT / "docs" / "api"), str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"sphinx failed ({' '.join(cmd)}):\n{res.stdout[-6000:]}\n{res.stderr[-10000:]}"
    # every page of the reference documents something: an automodule that silently found nothing would not
    for page in ("twisternet", "collectives", "channel", "innet", "coflow"):
        html = (out / f"{page}.html").read_text()
        assert html.count('class="sig-name descname"') >= 5, f"{page}.html documents (almost) nothing"
    page = (out / "collectives.html").read_text()
    for name in ("KeyedReduce", "AllReduce", "Gather", "PartialBarrier", "Join"):
        assert re.search(rf'id="collectives\.[\w.]*\b{name}"', page), f"collectives.html lacks {name}"
