"""Progress bars (tqdm) for long work: conversion, eval, bench.

Bars go to stderr and are shown only when stderr is a terminal (``enabled=None``: tqdm's
``disable=None``), so piped or captured output stays quiet.
"""
from __future__ import annotations

import re
import sys


def bar(total: int | None, desc: str, unit: str = "it", enabled: bool | None = None):
    """A tqdm bar on stderr (``enabled``: True / False / None = only on a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=None if enabled is None else not enabled, leave=True)


class ConversionProgress:
    """A ``progress(msg)`` callback for :func:`olv_runtime.convert` drawing one bar.

    Counts the converter's steps: the embedding, each ``layer i/L``, the head and the write
    (total ``L + 3`` once the first layer message names ``L``); the message is the bar's
    description. Use as a context manager (closes the bar).
    """

    _LAYER = re.compile(r"layer (\d+)/(\d+)")

    def __init__(self, enabled: bool | None = None):
        self.bar = bar(None, "convert", "step", enabled)

    def __call__(self, msg: str) -> None:
        m = self._LAYER.search(msg)
        if m and self.bar.total is None:
            self.bar.total = int(m.group(2)) + 3
        self.bar.set_description_str(msg if len(msg) <= 48 else msg[:45] + "...", refresh=False)
        self.bar.update(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()
        return False
