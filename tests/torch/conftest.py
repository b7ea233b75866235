"""tests/torch: skipped, with the reason printed, when torch is not installed (the ``torch`` extra)."""

import importlib.util

import pytest

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]

    def pytest_report_header(config):  # noqa: ANN001, ANN201
        return "tests/torch skipped: torch is not installed (pip install 'twisternet[torch]')"

    @pytest.hookimpl
    def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201
        return None
