"""Sphinx configuration of the API reference, built from the docstrings.

Build: ``python -m sphinx -W --keep-going -b html docs/api build/api`` (tests/test_docs_build.py does it
in the default test run, with warnings as errors, so a broken docstring fails CI).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # document this checkout, not an installed copy

project = "twisternet"
author = "the twisternet authors"
copyright = "the twisternet authors"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

# Optional dependencies (pyarrow, torch, mpi4py, grpc) are imported lazily by the documented modules; mock
# them anyway so the reference builds in an environment without the extras.
autodoc_mock_imports = ["torch", "mpi4py", "grpc", "p4", "google.protobuf", "pyarrow", "pandas", "scipy"]
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Docstrings are reStructuredText with plain prose sections; napoleon reads the few Google-style ones.
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = "twisternet API reference"
html_static_path: list[str] = []
templates_path: list[str] = []
exclude_patterns = ["_build"]
