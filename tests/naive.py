"""The old name of :mod:`reference` (tests/reference.py): every public name re-exported, so
``import naive`` keeps working."""
from __future__ import annotations

try:
    from reference import *  # noqa: F401,F403  (tests/ on sys.path: pytest's rootdir insertion)
except ImportError:
    from tests.reference import *  # noqa: F401,F403
