"""Fuzz worker (tests/test_fuzz.py): loads, validates and runs one model per input line.

Protocol (one JSON object per line): stdin ``{"id": int, "path": str}``; stdout first
``{"start": id}`` then ``{"done": id, "status": "ok" | "olv" | "raw", "type": ..., "msg": ...}``.
The parent attributes a signal, a non-zero exit or a missing "done" (hang) to the case started
last, then restarts the worker for the remaining cases.

Status "raw" is any exception that is not an :class:`olv_runtime.OlvError`. An OlvError that
wraps a non-OlvError raised inside an operator (the session's catch-all ``InvalidArgument``
naming the node) is reported separately as "wrapped".
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np


def run_case(path: str) -> None:
    if os.environ.get("OLV_FUZZ_SELFTEST") == "1":  # the harness's own test (test_fuzz.py)
        if path == "selftest:crash":
            import signal

            os.kill(os.getpid(), signal.SIGSEGV)
        if path == "selftest:hang":
            import time

            time.sleep(3600)
        if path == "selftest:raw":
            raise ZeroDivisionError("raw")
    import olv_runtime
    from olv_runtime.decoding import resolve

    model = olv_runtime.load(path)
    resolve(model)
    sess = olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(num_threads=1))
    names = [a.name for a in sess.get_inputs()]
    if "input_ids" in names:
        text = sess.get_modelmeta().get("olv.vocab_size", "8")
        vocab = min(int(text), 1 << 20) if text.isdigit() else 8  # (the worker's own ids)
        state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
        try:
            ids = np.array([[1, 2, 3]], np.int64) % max(vocab, 1)
            out = state.run({"input_ids": ids})
            step = np.array([[int(np.argmax(out["logits"][0, -1])) if "logits" in out else 0]],
                            np.int64)
            state.run({"input_ids": step})
        finally:
            state.close()
    elif not names:
        sess.run(None, {})


def main() -> int:
    from olv_runtime.errors import OlvError

    out = sys.stdout
    for line in sys.stdin:
        case = json.loads(line)
        out.write(json.dumps({"start": case["id"]}) + "\n")
        out.flush()
        rec = {"done": case["id"], "status": "ok"}
        try:
            run_case(case["path"])
        except OlvError as exc:
            cause = exc.__cause__
            wrapped = cause is not None and not isinstance(cause, OlvError)
            rec.update(status="wrapped" if wrapped else "olv", type=type(exc).__name__,
                       msg=str(exc)[:300],
                       cause=type(cause).__name__ if wrapped else None)
        except BaseException as exc:  # noqa: BLE001 - everything else is a finding
            if isinstance(exc, KeyboardInterrupt):
                raise
            rec.update(status="raw", type=type(exc).__name__, msg=str(exc)[:300])
        out.write(json.dumps(rec) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
