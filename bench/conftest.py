"""The benchmarks run in this one pytest process: under pytest-xdist workers (``pytest -n 2``)
pytest-benchmark turns itself off. Loaded for ``pytest bench/...`` (an initial conftest), before
pytest-xdist reads the option."""
from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if getattr(config.option, "numprocesses", None) is not None:
        config.option.numprocesses = 0
