"""An in-process ``olv serve`` for the server tests: the real application under uvicorn in a
thread, bound to 127.0.0.1 on a free port, stopped by the fixture."""
from __future__ import annotations

import pytest

uvicorn = pytest.importorskip("uvicorn")  # the serve extra (in the test extra too: runs in CI)
httpx = pytest.importorskip("httpx")

from live_server import LiveServer

from olv_runtime.server import ServeOptions, load_served


@pytest.fixture(scope="module")
def served_model(tiny_chat_models):
    return tiny_chat_models["float32"]


@pytest.fixture(scope="module")
def live(served_model):
    srv = LiveServer(lambda: load_served(served_model, model_name="tiny", max_batch=8,
                                         kv_cache_tokens=4096),
                     ServeOptions(max_waiting=64, max_body_bytes=1 << 20, shutdown_timeout=5))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def pytest_collection_modifyitems(config, items):
    """An exception in a server or engine thread fails the server test it happens in (the
    engine's loop dying would otherwise show as a client timeout, or not at all)."""
    mark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
    for item in items:
        if "tests/server/" in str(item.path).replace("\\", "/"):
            item.add_marker(mark)
