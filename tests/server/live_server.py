"""The in-process ``olv serve`` of the server tests (:class:`LiveServer`): the real application
under uvicorn in a thread, bound to 127.0.0.1 on a free port. A module of its own, not conftest.py:
``from conftest import ...`` would resolve to whichever conftest.py pytest imported last."""
from __future__ import annotations

import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")  # the serve extra (in the test extra too: runs in CI)
httpx = pytest.importorskip("httpx")

from olv_runtime.server import ServeOptions, create_app, load_served  # noqa: F401

START_SECONDS = 120


class LiveServer:
    """A running server: ``url``, ``state`` (the app's ServerState), ``stop()``."""

    def __init__(self, loader, options: ServeOptions):
        self.app = create_app(loader, options)
        self.state = self.app.state.olv
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=options.shutdown_timeout)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = START_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server not ready in {timeout} s")

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"
