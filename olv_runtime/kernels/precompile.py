"""Compile kernels a session is about to need in a worker process, beside the main process.

Cold start (issue 14): with an empty numba cache nearly all of the time before the first token is
numba compiling (type inference, lowering, LLVM), single-threaded, one function after the other.
When the main process knows early that it will need a compiled function with a given signature
later -- the compiled decode step (:mod:`.decode_stack`), known when the session makes its plan
-- it hands that signature to a worker process, which compiles it on another core while the main
process finishes the session and compiles and runs the prefill kernels. The main process then
takes the worker's result instead of compiling it itself. A session on a cold cache starts the
worker even before the signature is known (:func:`prestart`, before the weights are prepacked):
the worker's own start-up (Python, numpy, numba, the kernel modules, numba's first-compilation
set-up, about a second) then overlaps the main process's work, and the job arrives through the
worker's stdin.

Protocol (:func:`start` / :meth:`Job.wait`):

* :func:`start` keeps only the entries (numba dispatcher, argument types) that are neither
  compiled in this process nor in numba's disk cache; for those it starts
  ``python -m olv_runtime.kernels.precompile JOB``. The entries are compiled in their order:
  a caller lists first the callees it shares with kernels the main process compiles later
  (e.g. the attention rows of the decode step, which the prefill attention calls too).
* The worker saves into the main process's numba cache (the same directory), so that each
  process loads from the disk cache what the other has compiled already instead of compiling
  it again (the prefill kernels and the decode step share callees: the attention rows, the
  exact-mode GEMV groups, RMSNorm rows). numba's own save is not safe for two processes
  saving different signatures of one function at the same moment (each picks the same free
  data-file number: the index can then name the other's data), so while a worker is used both
  processes save under an exclusive lock of the cache directory, and write the data file before
  the index entry that names it (:func:`_share_cache`, which replaces
  ``numba.core.caching.IndexDataCacheFile.save``; loading is unchanged: numba replaces both
  files atomically). Where that cannot be installed (another numba), the worker uses a private
  ``NUMBA_CACHE_DIR`` and the main process copies the finished entries over (:meth:`Job.wait`).
* Entries already asked for get their existing job (one worker per set of entries in a
  process, however many sessions ask); a worker waiting from :func:`prestart` takes the job
  (else a new one starts); :func:`release_idle` ends a waiting worker no job came to (it
  removes its directory and exits at the end of its input).
* The worker imports each dispatcher's module, compiles each signature in order
  (``dispatcher.compile``, which saves it -- and every callee it compiles -- into the cache) and
  writes where the cache files are.
* :meth:`Job.wait` (before the first call of a worker's function) waits for the worker, loads
  each entry from the worker's cache files into the dispatcher exactly as numba loads a disk cache
  hit (same index key: signature, target machine, bytecode hash; same source stamp), with a
  private directory saves it into the main process's own numba cache (later processes load it
  from there), and removes the temporary directory.

The kernel clock (:func:`kernel_seconds`): the seconds a thread has spent preparing compiled
kernels -- numba compiling or loading from its disk cache (the time it holds or waits for numba's
compiler lock, nested acquisitions counted once) and :meth:`Job.wait` blocked on a worker -- so
that :func:`olv_runtime.generate` reports rates without that time and says how much it was
(``GenerationStats.prefill_compile_seconds`` / ``decode_compile_seconds``).

Anything that does not work out -- no second CPU, ``OLV_COMPILE_WORKERS=0``, no temporary
directory, the worker failing or timing out, an entry missing from its cache -- only means the
function is compiled in-process at its first call, as without this module: results never depend
on it (the same compiler, flags and source compile the same code). The main process's cache not
being writable only skips the save. Workers still running at exit are ended.
"""
from __future__ import annotations

import atexit
import fcntl
import importlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numba
from numba.core import caching, config, event
from numba.core.caching import IndexDataCacheFile
from numba.core.compiler_lock import global_compiler_lock

from olv_runtime.config import compile_workers, precompile_shared, worker_environment

log = logging.getLogger("olv_runtime.precompile")
__all__ = ["Job", "start", "prestart", "release_idle", "asked", "enabled", "cache_index_exists",
           "kernel_seconds", "preparing", "WAIT_TIMEOUT"]

#: Seconds :meth:`Job.wait` waits for a worker before ending it (then compiling in-process).
WAIT_TIMEOUT = 600.0

_LIVE: set = set()  # jobs whose worker may still run (ended at exit)
_JOBS: dict = {}    # ((module, qualname, signature), ...) -> the Job compiling those entries


# ------------------------------------------------------------------------------------------------
# the kernel clock
# ------------------------------------------------------------------------------------------------
_TL = threading.local()  # per thread: .total (s), .depth (nested compiler-lock holds), .t0
_CLOCK = []              # the listener, once registered
_CLOCK_LOCK = threading.Lock()


def _add_seconds(dt: float) -> None:
    _TL.total = getattr(_TL, "total", 0.0) + dt


def _clock_start() -> None:
    d = getattr(_TL, "depth", 0)
    if d == 0:
        _TL.t0 = time.perf_counter()
    _TL.depth = d + 1


def _clock_end() -> None:
    d = getattr(_TL, "depth", 0) - 1
    if d < 0:  # an acquisition from before the listener was registered
        return
    _TL.depth = d
    if d == 0:
        _add_seconds(time.perf_counter() - _TL.t0)


def _install_clock() -> None:
    """Register the listener of numba's ``numba:compiler_lock`` events (once per process).
    numba acquires that lock around every compilation and every load from its disk cache
    (``Dispatcher.compile``), re-entrantly for the callees a compilation compiles; the
    listener adds the outermost hold (from the request, so waiting for another thread's
    compilation counts too) to the thread's total."""
    if _CLOCK:
        return
    with _CLOCK_LOCK:
        if _CLOCK:
            return
        class _Clock(event.Listener):
            def on_start(self, ev):
                _clock_start()

            def on_end(self, ev):
                _clock_end()

        clock = _Clock()
        event.register("numba:compiler_lock", clock)
        _CLOCK.append(clock)


class preparing:
    """``with preparing(): ...`` counts the block on the thread's :func:`kernel_seconds` (once,
    however it nests with compilations): for kernel preparation numba does not see, e.g. the
    first import of a kernel module (its dispatchers and intrinsics are made at import)."""

    def __enter__(self):
        _install_clock()
        _clock_start()
        return self

    def __exit__(self, *exc):
        _clock_end()
        return False


def kernel_seconds() -> float:
    """Seconds the calling thread has spent preparing compiled kernels since this clock was
    first read in the process: numba compiling or loading a function from its disk cache
    (holding or waiting for numba's compiler lock), waiting for a compile worker
    (:meth:`Job.wait`) and the blocks marked with :class:`preparing`. Monotonic; callers take
    differences around the work they time (:func:`olv_runtime.generate`). A compilation already
    running in this thread when the clock is first read is not counted."""
    _install_clock()
    return getattr(_TL, "total", 0.0) + (
        time.perf_counter() - _TL.t0 if getattr(_TL, "depth", 0) > 0 else 0.0)


def enabled() -> bool:
    """Whether workers are used: ``OLV_COMPILE_WORKERS=0`` never, ``=1`` always, unset, empty or
    ``auto`` when the process may use at least two CPUs; any other value raises
    :class:`~olv_runtime.errors.EnvironmentVariableError`."""
    env = compile_workers()
    if env in ("0", "1"):
        return env == "1"
    try:
        ncpu = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        ncpu = os.cpu_count() or 1
    return ncpu >= 2


def _name(disp) -> tuple[str, str]:
    f = disp.py_func
    return f.__module__, f.__qualname__


def _cached(disp, sig) -> bool:
    """True if ``sig`` is compiled in this process or present in the dispatcher's disk cache."""
    if tuple(sig) in disp.overloads:
        return True
    cache = disp._cache
    cf = getattr(cache, "_cache_file", None)
    if cf is None:  # no disk cache (cache=False): nothing to load a worker's result into
        return True
    key = cache._index_key(tuple(sig), disp.targetctx.codegen())
    return key in cf._load_index()


def cache_index_exists(filename: str, qualnames) -> bool:
    """Whether numba's disk cache holds an index for any of the functions ``qualnames`` of the
    module file ``filename`` of this package (e.g. ``"decoder_layers.py"``), found without
    importing the module (numba's own locators on its path). True too when the location cannot
    be determined: callers only start a worker on a certainly cold cache."""
    try:
        if config.CACHE_LOCATOR_CLASSES:
            return True
        py_file = os.path.join(os.path.dirname(os.path.abspath(__file__)), filename)
        stem = os.path.splitext(filename)[0]
        for cls in caching.CacheImpl._locator_classes:
            loc = cls.from_function(_probe, py_file)
            if loc is not None:
                path = loc.get_cache_path()
                break
        else:
            return True
        names = os.listdir(path) if os.path.isdir(path) else []
        for q in qualnames:
            head = f"{stem}.{q}-"
            if any(n.startswith(head) and n.endswith(".nbi") for n in names):
                return True
        return False
    except Exception:
        return True


def _probe():  # a function object for numba's locators (they read its first line number only)
    pass


class Job:
    """Compilation of ``entries`` in one worker process (see :func:`start`)."""

    def __init__(self, entries, proc, tmp, result_path):
        self.entries = list(entries)
        self._proc = proc
        self._tmp = tmp
        self._result = result_path
        self._lock = threading.Lock()
        self._done = False
        #: entries loaded from the worker (set by :meth:`wait`)
        self.loaded = 0
        #: seconds :meth:`wait` was blocked on the worker (the first call; loading excluded)
        self.waited = 0.0
        self.started = time.perf_counter()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the worker and load its compiled entries into the dispatchers; returns how
        many were loaded (0 when the worker failed: the functions compile at their first call).
        Thread-safe; later calls return at once. The time blocked here counts on the calling
        thread's :func:`kernel_seconds` (waiting for the worker explicitly; loading its entries
        through numba's compiler lock)."""
        _install_clock()
        t0 = time.perf_counter()
        with self._lock:
            if self._done:
                _add_seconds(time.perf_counter() - t0)  # another thread waited: so did this one
                return self.loaded
            self._done = True
            try:
                try:
                    rc = self._proc.wait(WAIT_TIMEOUT if timeout is None else timeout)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                    rc = -1
                self.waited = time.perf_counter() - t0
                _add_seconds(self.waited)
                if rc == 0:
                    self.loaded = self._load()
            finally:
                self._cleanup()
            log.debug("compile worker: exit code %s, %d of %d entries loaded, %.2f s after its "
                      "start, waited %.2f s", rc, self.loaded, len(self.entries),
                      time.perf_counter() - self.started, self.waited)
            return self.loaded

    def _load(self) -> int:
        with global_compiler_lock:  # as numba's own cache loads (and on the kernel clock)
            return self._load_locked()

    def _load_locked(self) -> int:
        try:
            with open(self._result, "rb") as f:
                paths = pickle.load(f)
        except (OSError, pickle.PickleError, EOFError):
            return 0
        n = 0
        for (disp, sig), path in zip(self.entries, paths):
            if path is None:
                continue
            sig = tuple(sig)
            try:
                cache = disp._cache
                impl = cache._impl
                src = IndexDataCacheFile(cache_path=path, filename_base=impl.filename_base,
                                         source_stamp=impl.locator.get_source_stamp())
                key = cache._index_key(sig, disp.targetctx.codegen())
                data = src.load(key)
                if data is None:
                    continue
                with global_compiler_lock:
                    if sig in disp.overloads:
                        continue
                    disp.targetctx.refresh()
                    cres = impl.rebuild(disp.targetctx, data)
                    if not cres.objectmode:
                        disp.targetctx.insert_user_function(cres.entry_point, cres.fndesc,
                                                            [cres.library])
                    disp.add_overload(cres)
                n += 1
            except Exception:  # an unusable entry: compiled in-process at its first call
                continue
            if os.path.abspath(path) == os.path.abspath(cache.cache_path):
                continue  # the worker saved it into this process's cache (shared)
            try:  # for the next processes (the cache may not be writable: then nothing)
                impl.locator.ensure_cache_path()
                cache._cache_file.save(key, data)
            except Exception:
                pass
        return n

    def _finished(self, i: int) -> bool:
        """Whether the worker has compiled (or given up on) entry ``i``, or has ended."""
        if self._proc.poll() is not None:
            return True
        try:
            with open(self._result + ".progress") as f:
                return str(i) in f.read().split()
        except OSError:
            return False

    def claim(self, i: int) -> bool:
        """Take entry ``i`` for the main process (:class:`_Await`): True when the worker has not
        started it (it then skips it), False when it has (the caller waits for it:
        :meth:`await_entry`). Whoever creates the entry's claim file first compiles it."""
        return _claim(os.path.dirname(self._result), i)

    def await_entry(self, i: int, timeout: float = WAIT_TIMEOUT) -> None:
        """Block until the worker has finished entry ``i`` (the main process is about to compile
        a function the worker is compiling: with the shared cache it then loads the worker's
        result instead of compiling it a second time). Returns at once once the job is done;
        at ``timeout`` without giving up the job. Counted on the calling thread's
        :func:`kernel_seconds`."""
        if self._done:
            return
        with preparing():
            t0 = time.perf_counter()
            while not self._finished(i) and time.perf_counter() - t0 < timeout:
                time.sleep(0.005)

    def _cleanup(self):
        _unhook(self)
        _LIVE.discard(self)
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)


def start(entries) -> Job | None:
    """Start compiling ``entries`` -- ``(numba dispatcher, tuple of numba argument types)`` --
    in a worker process. Returns the :class:`Job`, or None when there is nothing to compile or
    workers are not used (:func:`enabled`); never raises for environment reasons. The same
    entries asked for again while their job exists get that job (one worker per set of
    entries in a process, however many sessions ask)."""
    if not enabled():
        return None
    todo = []
    try:
        for disp, sig in entries:
            if not _cached(disp, sig):
                todo.append((disp, tuple(sig)))
    except Exception:
        return None
    if not todo:
        return None
    key = tuple((*_name(d), s) for d, s in todo)
    job = _JOBS.get(key)
    if job is not None:  # another session asked for the same entries: one worker serves both
        return job
    job = _hand_over(todo)
    if job is None:
        job = _spawn_job(todo)
    if job is None:
        return None
    _LIVE.add(job)
    _JOBS[key] = job
    if _SHARED:  # the main process waits for these instead of compiling them a second time
        for i, (disp, sig) in enumerate(todo):
            _hook(disp, sig, job, i)
    log.debug("compile worker started for %s", ", ".join(".".join(_name(d)) for d, _ in todo))
    return job


# ------------------------------------------------------------------------------------------------
# the main process waits for what the worker compiles (shared cache)
# ------------------------------------------------------------------------------------------------
class _Await:
    """Stands in for ``dispatcher.compile`` (an instance attribute, which numba's own calls --
    ``_compile_for_args`` from Python, ``get_call_template`` when a caller is typed -- look up
    before the class's method) while a worker is asked for signatures of that dispatcher. A
    request for one of them claims the entry (:meth:`Job.claim`): if the worker has not started
    it, numba compiles it here and the worker skips it; if the worker is compiling it, the
    request waits for it (:meth:`Job.await_entry`) and numba then finds it in the (shared) disk
    cache. Other signatures pass through."""

    def __init__(self, disp):
        self.disp = disp
        self.waits = {}  # signature -> (job, entry index)

    def __call__(self, sig):
        w = self.waits.pop(tuple(sig), None) if not isinstance(sig, str) else None
        if w is not None:
            if not self.waits:
                self.disp.__dict__.pop("compile", None)  # nothing left to wait for
            job, i = w
            # the worker has started it: wait for it (then a cache load); not yet: compile it
            # here (the worker skips it) -- never both, and never waiting for entries before it
            if not job._done and not job.claim(i):
                job.await_entry(i)
        return type(self.disp).compile(self.disp, sig)


def _claim(tmp: str, i: int) -> bool:
    """Create the claim file of entry ``i`` in the job's directory ``tmp``; False if it
    exists (the other process took the entry)."""
    try:
        os.close(os.open(os.path.join(tmp, f"claim-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:  # no directory (the job is over): the caller compiles
        return True


def _hook(disp, sig, job, i) -> None:
    try:
        h = disp.__dict__.get("compile")
        if not isinstance(h, _Await):
            h = _Await(disp)
            disp.compile = h
        h.waits[tuple(sig)] = (job, i)
    except Exception:  # a dispatcher without an instance dict: the main process compiles
        pass


def _unhook(job) -> None:
    """Remove the waits of ``job`` (it is done or has ended)."""
    for disp, sig in job.entries:
        h = getattr(disp, "__dict__", {}).get("compile")
        if isinstance(h, _Await):
            w = h.waits.get(tuple(sig))
            if w is not None and w[0] is job:
                del h.waits[tuple(sig)]
            if not h.waits:
                disp.__dict__.pop("compile", None)


def asked(module: str) -> bool:
    """Whether this process has started a job for a function of ``module`` (a later session
    then does not :func:`prestart` a worker: its driver is most likely that job's)."""
    return any(m == module for key in _JOBS for m, _, _ in key)


def _job_bytes(todo) -> bytes:
    # sys.path: the worker imports the same modules
    return pickle.dumps((list(sys.path), [(*_name(d), s) for d, s in todo]))


# ------------------------------------------------------------------------------------------------
# one numba cache for the main process and its workers
# ------------------------------------------------------------------------------------------------
_LOCK_NAME = ".olv-save.lock"  # in each cache directory: held while an entry is saved
_SHARED = []  # [True] once IndexDataCacheFile.save is the locked one


def _share_cache() -> bool:
    """Make numba's cache saves safe between processes (see the module docstring): replace
    ``IndexDataCacheFile.save`` by :func:`_locked_save`. Returns False (nothing changed) when
    this numba's cache file class does not have the methods it relies on, or there is no
    ``fcntl`` (the worker then uses a private cache directory)."""
    if _SHARED:
        return True
    try:
        cls = caching.IndexDataCacheFile
        for name in ("save", "_load_index", "_save_index", "_save_data", "_data_name"):
            if not callable(getattr(cls, name, None)):
                return False
    except Exception:
        return False
    orig = cls.save

    def save(self, key, data):
        return _locked_save(self, key, data, orig)

    save.__doc__ = _locked_save.__doc__
    cls.save = save
    _SHARED.append(True)
    return True


def _locked_save(self, key, data, orig):
    """numba's ``IndexDataCacheFile.save`` under an exclusive ``flock`` of the cache directory's
    lock file, reading the index under the lock and writing the data file before the index
    entry naming it (so a reader that finds the entry finds its data). Without the lock file
    (read-only directory): numba's own save (which fails there too)."""
    try:
        fd = os.open(os.path.join(self._cache_path, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return orig(self, key, data)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        overloads = self._load_index()
        name = overloads.get(key)
        if name is None:
            used = set(overloads.values())
            i = 1
            while self._data_name(i) in used:
                i += 1
            name = self._data_name(i)
            self._save_data(name, data)
            overloads[key] = name
            self._save_index(overloads)
        else:  # the same key compiled again: its data file is replaced (atomically)
            self._save_data(name, data)
    finally:
        os.close(fd)  # releases the lock


def _popen(tmp, args, stdin):
    # the worker saves into this process's cache (under the same lock), or into its own
    env = worker_environment(_share_cache(), os.path.join(tmp, "cache"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in
                                                 env.get("PYTHONPATH", "").split(os.pathsep)
                                                 if p])
    return subprocess.Popen(
        [sys.executable, "-m", "olv_runtime.kernels.precompile", *args],
        env=env, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        close_fds=True)


def _spawn_job(todo) -> Job | None:
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix="olv-compile-")
        job_path = os.path.join(tmp, "job.pkl")
        result_path = os.path.join(tmp, "result.pkl")
        with open(job_path, "wb") as f:
            f.write(_job_bytes(todo))
        proc = _popen(tmp, [job_path, result_path], subprocess.DEVNULL)
    except Exception:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return None
    return Job(todo, proc, tmp, result_path)


# ------------------------------------------------------------------------------------------------
# a worker started before its job is known (prestart / release_idle)
# ------------------------------------------------------------------------------------------------
_IDLE: dict = {"worker": None}  # (Popen with a stdin pipe, its temporary directory) or None


def prestart(modules=()) -> bool:
    """Start a worker that imports ``modules`` (and warms numba's compiler up) before its job
    is known, so that the job -- given by the next :func:`start` -- begins compiling at once
    instead of after the worker's start-up (about a second: Python, numpy, numba, the kernel
    modules, numba's first-compilation set-up). At most one such worker waits at a time;
    :func:`release_idle` (or the exit of this process) ends it if no job came. Returns whether
    a worker is waiting; never raises for environment reasons."""
    if not enabled():
        return False
    w = _IDLE["worker"]
    if w is not None and w[0].poll() is None:
        return True
    _IDLE["worker"] = None
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix="olv-compile-")
        proc = _popen(tmp, ["--serve", os.path.join(tmp, "result.pkl"), *modules],
                      subprocess.PIPE)
    except Exception:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return False
    _IDLE["worker"] = (proc, tmp)
    return True


def _hand_over(todo) -> Job | None:
    """The job ``todo`` given to the waiting worker of :func:`prestart` (None: no live one)."""
    w, _IDLE["worker"] = _IDLE["worker"], None
    if w is None:
        return None
    proc, tmp = w
    try:
        if proc.poll() is not None:
            raise OSError("the waiting worker has ended")
        proc.stdin.write(_job_bytes(todo))
        proc.stdin.close()
    except Exception:
        _end_idle(w)
        return None
    return Job(todo, proc, tmp, os.path.join(tmp, "result.pkl"))


def release_idle() -> None:
    """End the worker of :func:`prestart` if no job was given to it (it reads the end of its
    input, removes its temporary directory and exits)."""
    w, _IDLE["worker"] = _IDLE["worker"], None
    if w is not None:
        _end_idle(w)


def _end_idle(w) -> None:
    proc, tmp = w
    try:
        proc.stdin.close()
    except Exception:
        pass
    if proc.poll() is not None:  # ended already: remove its directory here
        shutil.rmtree(tmp, ignore_errors=True)
    _RELEASED.append(w)


_RELEASED: list = []  # released idle workers (killed and cleaned up at exit if still running)


@atexit.register
def _end_workers():
    for job in list(_LIVE):
        job._cleanup()
    w, _IDLE["worker"] = _IDLE["worker"], None
    for proc, tmp in _RELEASED + ([w] if w is not None else []):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _compile_job(path, todo, result_path: str) -> int:
    sys.path.extend(p for p in path if p not in sys.path)
    if precompile_shared() and not _share_cache():
        # cannot save safely into the shared cache (cannot happen: the main process checked
        # the same numba): compile without saving, the main process compiles in-process
        return 1
    paths = []
    tmp = os.path.dirname(result_path)
    with open(result_path + ".progress", "w") as progress:
        for i, (module, qualname, sig) in enumerate(todo):
            if not _claim(tmp, i):  # the main process compiles it (Job.claim)
                paths.append(None)
                continue
            try:
                obj = importlib.import_module(module)
                for part in qualname.split("."):
                    obj = getattr(obj, part)
                obj.compile(sig)
                paths.append(obj._cache.cache_path)
            except Exception:
                paths.append(None)
            progress.write(f"{i}\n")  # entry i is in the cache (or failed): see Job.await_entry
            progress.flush()
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(paths, f)
    os.replace(tmp, result_path)
    return 0


def _worker(job_path: str, result_path: str) -> int:
    with open(job_path, "rb") as f:
        path, todo = pickle.load(f)
    return _compile_job(path, todo, result_path)


def _warm_probe(x):  # compiled (not cached) by a waiting worker: numba's first-compile set-up
    return x + 1


def _serve(result_path: str, modules) -> int:
    """A :func:`prestart` worker: import, warm up, then read the job from stdin (end of input
    without a job: remove the directory and exit)."""
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception:
            pass
    try:
        numba.njit(_warm_probe)(1)
    except Exception:
        pass
    data = sys.stdin.buffer.read()
    if not data:
        shutil.rmtree(os.path.dirname(result_path), ignore_errors=True)
        return 0
    path, todo = pickle.loads(data)
    return _compile_job(path, todo, result_path)


if __name__ == "__main__":
    _rc = _serve(sys.argv[2], sys.argv[3:]) if sys.argv[1] == "--serve" else \
        _worker(sys.argv[1], sys.argv[2])
    # the result file is complete (written, renamed) and the cache files are closed: skip the
    # interpreter's teardown of numba and LLVM (~0.5 s during which the waiting main process
    # would still see the worker running)
    os._exit(_rc)
