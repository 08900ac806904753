"""Compilation in a worker process (olv_runtime.kernels.precompile, cold start of issue 14)."""
import importlib
import os
import sys
import textwrap
import time

import numpy as np
import pytest
from numba import types

from olv_runtime.kernels import precompile

_SRC = textwrap.dedent('''
    from numba import njit

    @njit(cache=True)
    def affine(x, a):
        return x * a + 1
''') + (
    # a function that takes a while to compile (about a second): a worker busy with it
    "\n@njit(cache=True)\ndef slow(x):\n"
    + "".join(f"    if x > {i}:\n        x = x * 1.0001 + {i}\n" for i in range(300))
    + "    return x\n")


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """A module with one cached njit function that no numba cache has seen (its own file)."""
    name = f"olv_precompile_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OLV_COMPILE_WORKERS", "1")
    mod = importlib.import_module(name)
    yield mod
    sys.modules.pop(name, None)


def test_worker_compiles_main_loads(fresh_module):
    f = fresh_module.affine
    sig = (types.int64, types.int64)
    job = precompile.start([(f, sig)])
    assert job is not None
    assert job.wait() == 1
    assert sig in f.overloads          # installed from the worker's files
    assert f(3, 2) == 7
    assert sum(f.stats.cache_misses.values()) == 0  # never compiled in this process
    assert precompile._cached(f, sig)  # saved into this process's numba cache too
    assert precompile.start([(f, sig)]) is None  # nothing left to do
    assert job.wait() == 1             # a second wait returns at once


def test_disabled_or_unusable_falls_back(fresh_module, monkeypatch):
    f = fresh_module.affine
    monkeypatch.setenv("OLV_COMPILE_WORKERS", "0")
    assert precompile.start([(f, (types.float64, types.int64))]) is None
    monkeypatch.setenv("OLV_COMPILE_WORKERS", "1")
    # a signature the function cannot compile: the worker reports it missing, nothing is
    # loaded, and calls compile in-process as usual
    job = precompile.start([(f, (types.unicode_type, types.float64))])
    assert job is not None and job.wait() == 0
    assert f(2.5, 2) == 6.0


def test_worker_failure_and_unwritable_cache(fresh_module, monkeypatch):
    f = fresh_module.affine
    sig = (types.float32, types.float32)
    job = precompile.start([(f, sig)])
    job._proc.kill()  # the worker dies: nothing loaded, no error
    assert job.wait() == 0
    assert f(np.float32(1.5), np.float32(2.0)) == np.float32(4.0)

    sig = (types.int32, types.int32)

    def refuse(key, data):
        raise PermissionError("read-only cache")

    monkeypatch.setattr(f._cache._cache_file, "save", refuse)
    job = precompile.start([(f, sig)])
    assert job.wait() == 1  # loaded although it cannot be saved for later processes
    assert f(np.int32(2), np.int32(3)) == 7
    assert sum(f.stats.cache_misses.values()) == 1  # the float32 call only


def test_cold_cache_detection(tmp_path, monkeypatch):
    """DecoderStack starts a worker only when numba's cache has no index of the driver at all
    (found without importing its module)."""
    from numba.core import caching, config

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    assert not precompile.cache_index_exists("decoder_layers.py", ("_stack_thread", "_stack_par"))
    import olv_runtime.kernels as k

    src = os.path.join(os.path.dirname(os.path.abspath(k.__file__)), "decoder_layers.py")
    sub = caching._CacheLocator.get_suitable_cache_subpath(src)
    (tmp_path / sub).mkdir(parents=True, exist_ok=True)
    (tmp_path / sub / "decoder_layers._stack_thread_paged-9.py311.nbi").write_bytes(b"")
    assert not precompile.cache_index_exists("decoder_layers.py", ("_stack_thread",))
    (tmp_path / sub / "decoder_layers._stack_thread-457.py311.nbi").write_bytes(b"")
    assert precompile.cache_index_exists("decoder_layers.py", ("_stack_thread", "_stack_par"))


def test_prestarted_worker_takes_the_job(fresh_module):
    """A worker started before its job is known (session creation) compiles the job given
    by the next start; the same entries asked for again get the same job."""
    f = fresh_module.affine
    sig = (types.int16, types.int16)
    assert precompile.prestart((fresh_module.__name__,))
    assert precompile.prestart()  # one waiting worker at a time: the same one
    idle = precompile._IDLE["worker"]
    job = precompile.start([(f, sig)])
    assert job is not None and job._proc is idle[0] and precompile._IDLE["worker"] is None
    assert precompile.start([(f, sig)]) is job  # a second session: the same worker
    assert precompile.asked(fresh_module.__name__) and not precompile.asked("no.such.module")
    assert job.wait() == 1
    assert sum(f.stats.cache_misses.values()) == 0
    assert f(np.int16(2), np.int16(5)) == 11
    precompile.release_idle()  # nothing waiting: no-op


def test_prestarted_worker_without_a_job_exits(fresh_module, monkeypatch):
    assert precompile.prestart()
    proc, tmp = precompile._IDLE["worker"]
    precompile.release_idle()  # end of input: the worker removes its directory and exits
    assert proc.wait(60) == 0
    assert not os.path.exists(tmp)
    # a waiting worker that died: the job goes to a new worker
    assert precompile.prestart()
    dead, _ = precompile._IDLE["worker"]
    dead.kill()
    dead.wait()
    f = fresh_module.affine
    job = precompile.start([(f, (types.int8, types.int8))])
    assert job is not None and job._proc is not dead
    assert job.wait() == 1
    monkeypatch.setenv("OLV_COMPILE_WORKERS", "0")
    assert not precompile.prestart()


def test_cache_saves_are_locked_between_processes(fresh_module, tmp_path):
    """With a worker the main process and the worker save into one numba cache: each save
    holds an exclusive lock of the directory (precompile._share_cache), so two processes never
    pick the same data file for different signatures. A save waits while the lock is held
    (here by this test, as another process would), then writes data and index."""
    import fcntl
    import threading

    from numba.core.caching import IndexDataCacheFile

    assert precompile._share_cache()
    f = fresh_module.affine
    assert f(2, 3) == 7  # compiled (and saved) in this process
    cf = f._cache._cache_file
    assert isinstance(cf, IndexDataCacheFile)
    key_a = next(iter(cf._load_index()))
    data_a = cf.load(key_a)
    key_b = ("another signature",) + tuple(key_a[1:])
    lock = os.open(os.path.join(cf._cache_path, precompile._LOCK_NAME), os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as another process saving at this moment
    t = threading.Thread(target=cf.save, args=(key_b, data_a))
    t.start()
    t.join(0.5)
    blocked = t.is_alive() and key_b not in cf._load_index()
    os.close(lock)
    t.join(60)
    assert blocked
    index = cf._load_index()
    assert index[key_b] != index[key_a]  # its own data file
    assert cf.load(key_b) is not None and cf.load(key_a) is not None


def _until_claimed(job, i):
    path = os.path.join(job._tmp, f"claim-{i}")
    t0 = time.perf_counter()
    while not os.path.exists(path):
        assert time.perf_counter() - t0 < 120, "the worker never started"
        time.sleep(0.005)


def test_main_process_waits_for_an_entry_the_worker_is_compiling(fresh_module):
    """With the shared cache, a function the worker is compiling is not compiled a second time
    by the main process: a request for it (here a call, which compiles at once) waits for the
    worker's entry, then loads it from the cache."""
    slow = fresh_module.slow
    job = precompile.start([(slow, (types.float64,))])
    assert job is not None and precompile._SHARED
    assert isinstance(slow.__dict__.get("compile"), precompile._Await)
    _until_claimed(job, 0)  # the worker has started compiling it (about a second)
    k0 = precompile.kernel_seconds()
    assert slow(1.0) > 1.0
    assert precompile.kernel_seconds() - k0 > 0  # the wait is on the kernel clock
    assert sum(slow.stats.cache_misses.values()) == 0  # loaded, never compiled here
    assert sum(slow.stats.cache_hits.values()) == 1
    assert "compile" not in slow.__dict__  # no stand-in left
    assert job.wait() == 0  # loaded already (at the call)


def test_main_process_compiles_an_entry_the_worker_has_not_started(fresh_module):
    """An entry the worker has not reached yet (it is busy with an earlier one) is compiled by
    the main process when it needs it (no waiting for the earlier entry), and the worker skips
    it."""
    slow, f = fresh_module.slow, fresh_module.affine
    sig = (types.float64, types.float64)
    job = precompile.start([(slow, (types.float64,)), (f, sig)])
    _until_claimed(job, 0)
    assert f(2.0, 3.0) == 7.0
    assert sum(f.stats.cache_misses.values()) == 1  # compiled here, at once
    assert job.wait() == 1  # slow; the worker left f alone
    assert sum(slow.stats.cache_misses.values()) == 0 and slow(1.0) > 1.0
