"""Loading a model for serving and running the application under uvicorn.

:func:`load_served` makes the :class:`~olv_runtime.server.app.Served` of a model file: the engine
(with the model's tokenizer), its chat template and special tokens (as ``olv chat`` finds them),
and the structured-output compiler when llguidance is installed. :func:`serve` runs the
application on one address until SIGINT / SIGTERM: it then refuses new requests (503), lets the
in-flight ones finish for ``shutdown_timeout`` seconds, cancels the rest, stops the engine and
returns 0 (1 when the model failed to load).
"""
from __future__ import annotations

import importlib.util
import logging
import pathlib
import signal

import uvicorn

from olv_runtime.engine import Engine
from olv_runtime.executor.session import SessionOptions
from olv_runtime.generation.chat import load_chat_template
from olv_runtime.generation.generate import eos_token_ids
from olv_runtime.generation.structured import GrammarCompiler
from olv_runtime.io import load
from olv_runtime.io.sidecars import load_tokenizer
from olv_runtime.server.app import Served, ServeOptions, create_app

__all__ = ["load_served", "serve"]

log = logging.getLogger("olv_runtime.server")


def load_served(model_path, *, model_name: str | None = None, max_batch: int = 16,
                kv_cache_tokens: int | None = None, kv_dtype: str = "float32",
                session_options: SessionOptions | None = None,
                max_tokens_per_step: int = 512) -> Served:
    """Load a model for serving.

    Parameters
    ----------
    model_path : path
        A converted model (``olv generate`` runs it): tokenizer.json, tokenizer_config.json /
        chat_template.jinja and generation_config.json beside it are used when present.
    model_name : str, optional
        Default: the file name.
    max_batch, kv_cache_tokens, kv_dtype, session_options, max_tokens_per_step
        :class:`~olv_runtime.Engine`'s.

    Raises
    ------
    OlvError
        The model, its tokenizer or its chat template cannot be read (the loaders' exceptions).
    """
    path = pathlib.Path(model_path)
    model = load(path)
    tokenizer = load_tokenizer(model)
    template, special = load_chat_template(path) if tokenizer is not None else (None, {})
    engine = Engine(model, max_batch=max_batch, kv_cache_tokens=kv_cache_tokens,
                    kv_dtype=kv_dtype, session_options=session_options,
                    max_tokens_per_step=max_tokens_per_step, tokenizer=tokenizer)
    grammar = None
    eos = eos_token_ids(engine.session)
    if tokenizer is not None and eos and engine.vocab and importlib.util.find_spec("llguidance"):
        grammar = GrammarCompiler(tokenizer, engine.vocab, eos)
    return Served(engine, model_name or path.name, tokenizer, template, special, grammar)


class _Server(uvicorn.Server):
    """uvicorn's server, telling the application when shutdown starts (503 from then on)."""

    def __init__(self, config, state):
        super().__init__(config)
        self.olv_state = state

    def handle_exit(self, sig, frame) -> None:
        self.olv_state.begin_drain()
        super().handle_exit(sig, frame)


def serve(loader, *, host: str = "127.0.0.1", port: int = 8000,
          options: ServeOptions | None = None, log_level: str = "info") -> int:
    """Run the server until SIGINT / SIGTERM (module docstring); returns the exit status.

    Parameters
    ----------
    loader : callable
        Returns a :class:`~olv_runtime.server.app.Served` (run in a thread after the socket is
        bound, so ``/health`` answers 503 while it runs).
    host : str
        The address to bind: 127.0.0.1 unless told otherwise.
    port : int
    options : ServeOptions, optional
    """
    options = options or ServeOptions()
    failed = []
    server = None

    def on_load_error(exc):
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(loader, options, on_load_error=on_load_error)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            # a backstop: the application cancels what still runs at 80 %
                            timeout_graceful_shutdown=options.shutdown_timeout + 1.0,
                            access_log=False)
    server = _Server(config, app.state.olv)
    # uvicorn restores the handlers it found and raises the signal again once it has stopped:
    # these make that second delivery a no-op, so a SIGTERM'd server exits 0
    previous = {s: signal.signal(s, _ignore) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 1 if failed else 0


def _ignore(sig, frame) -> None:
    log.info("olv serve: signal %d after shutdown", sig)
