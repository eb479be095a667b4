"""A small persistent process pool with a per-item wall-clock timeout.

Why not concurrent.futures / multiprocessing.Pool: neither can kill one hung worker and carry on.
Reward verification runs sympy on model output, which can hang in C code (huge powers) where no
signal reaches it, so here a worker that overruns its item is killed and replaced, the item is
reported as a timeout, and the rest of its chunk goes to the next free worker.

Each worker is a fresh Python interpreter started with `subprocess` (never a fork: the parent holds
JAX/XLA threads). Not multiprocessing's "spawn": that re-imports the parent's __main__ module in
every worker, which re-runs a plain script without an `if __name__ == "__main__":` guard (and
fails outright when the script came from stdin). The worker gets the parent's sys.path and talks
to it over a socket pair (multiprocessing.connection). Workers run in their own session, so a
Ctrl-C at the terminal reaches the trainer alone (which closes the pool), and a worker whose
parent has died exits within a second even while it is busy.

Work goes to workers in chunks (one message per chunk, not per item); each worker answers item by
item, which is what lets the parent time each item.

This module imports only the standard library, so a worker starts fast; the function it runs is
named as "module:function" and imported in the worker.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import importlib
import json
import math
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Sequence

OK = "ok"
TIMEOUT = "timeout"
ERROR = "error"


@dataclasses.dataclass(frozen=True)
class ItemResult:
    """Outcome of one item: status is "ok" (value = fn's return), "timeout" or "error"
    (value = a short message)."""
    status: str
    value: Any = None


def _resolve(fn_path: str):
    module_name, _, attr = fn_path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"fn must be 'module:function', got {fn_path!r}")
    return getattr(importlib.import_module(module_name), attr)


def _worker_main(conn, fn_path: str, init_path: str | None, init_args: tuple = ()) -> None:
    """Worker loop: receive a chunk [(key, args)], send back (key, status, value) per item.

    The function may raise TimeoutError to report its own (soft) timeout. `init_path` (optional
    "module:function") runs once before the worker reports ready, so that slow imports and
    warm-up do not count against the first item's timeout.
    """
    try:
        fn = _resolve(fn_path)
        if init_path:
            _resolve(init_path)(*init_args)
    except BaseException:  # noqa: BLE001 - report any import failure to the parent
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if chunk is None:
            return
        for key, args in chunk:
            try:
                reply = (key, OK, fn(*args))
            except TimeoutError as e:
                reply = (key, TIMEOUT, str(e))
            except Exception as e:  # noqa: BLE001 - a bad item must not take the worker down
                reply = (key, ERROR, f"{type(e).__name__}: {e}"[:500])
            try:
                conn.send(reply)
            except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
                conn.send((key, ERROR, f"could not send result: {e}"[:500]))


def _exit_when_orphaned(parent_pid: int) -> None:
    """Worker watchdog: exit at once when the parent process is gone (an item stuck in C code
    would otherwise keep the worker alive after the trainer was killed)."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


# Run by `python -c` in a fresh interpreter: argv = [sys.path (JSON), socket fd, parent pid].
# Everything else (fn, initializer) comes over the socket, so nothing is parsed from argv twice.
_BOOTSTRAP = (
    "import json, sys; sys.path[:0] = [p for p in json.loads(sys.argv[1]) if p not in sys.path]; "
    "from delta_jax.rl.verify_pool import _worker_entry; "
    "_worker_entry(int(sys.argv[2]), int(sys.argv[3]))"
)


def _worker_entry(fd: int, parent_pid: int) -> None:
    """Entry point of a worker interpreter: connect, read (fn, initializer), run the loop."""
    conn = multiprocessing.connection.Connection(fd)
    _exit_when_orphaned(parent_pid)
    try:
        fn_path, init_path, init_args = conn.recv()
    except (EOFError, OSError):
        return
    _worker_main(conn, fn_path, init_path, tuple(init_args))


class _Process:
    """A worker interpreter: the few Process methods the pool uses, over subprocess.Popen."""

    def __init__(self, popen: subprocess.Popen):
        self._popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self):
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        try:
            self._popen.kill()
        except ProcessLookupError:
            pass


def _start_worker_process(fn_path: str, init_path: str | None, name: str,
                          init_args: tuple = ()):
    """Starts one worker interpreter; returns (process, parent end of the connection)."""
    parent_sock, child_sock = socket.socketpair()
    child_fd = child_sock.fileno()
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    # Make sure the child can import this package even when only the parent's cwd or a test
    # runner's path setting made it importable.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if here not in paths:
        paths.insert(0, here)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, json.dumps(paths), str(child_fd),
             str(os.getpid())],
            pass_fds=(child_fd,), stdin=subprocess.DEVNULL, start_new_session=True,
            close_fds=True)
    finally:
        child_sock.close()
    conn = multiprocessing.connection.Connection(parent_sock.detach())
    conn.send((fn_path, init_path, tuple(init_args)))
    del name  # (kept for messages; a fresh interpreter has no process name to set)
    return _Process(popen), conn


class _Worker:
    """One worker process and what it is doing."""

    def __init__(self, fn_path: str, init_path: str | None, name: str, init_args: tuple = ()):
        self.name = name
        self.process, self.conn = _start_worker_process(fn_path, init_path, name, init_args)
        self.ready = False
        self.started_at = time.monotonic()
        self.current: collections.deque = collections.deque()  # item keys in flight, in order
        self.deadline = math.inf
        self.items_done = 0

    @property
    def busy(self) -> bool:
        return bool(self.current)

    def stop(self, graceful: bool = True) -> None:
        if graceful and self.process.is_alive():
            try:
                self.conn.send(None)
            except Exception:  # noqa: BLE001 - pipe already gone
                pass
            self.process.join(timeout=2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001
            pass


class VerifyPool:
    """Persistent worker processes running `fn(*args)` per item with a wall-clock timeout.

    Args:
      fn: "module:function" imported in each worker (must be importable there).
      num_workers: worker processes.
      timeout_s: wall-clock seconds allowed per item; a worker past it is killed and replaced.
      initializer: optional "module:function" called once in each worker before it takes work
        (with initializer_args, picklable: e.g. what to load), so that its imports do not count
        against the first item's timeout (startup_timeout_s bounds it instead).
      start_method: "spawn" only (a fresh interpreter per worker; "fork" and "forkserver" are
        refused: the parent has JAX threads, and a forkserver re-imports __main__).
      max_items_per_worker: recycle a worker after this many items (bounds sympy cache growth).
      startup_timeout_s: how long a new worker may take to import `fn` before it is an error.
      chunk_size: items per message; default splits a batch into ~4 chunks per worker (<= 64).

    Thread-safe (one batch at a time); usable from any thread. Close with .close(), a `with`
    block, or let the atexit hook do it.
    """

    def __init__(self, fn: str, num_workers: int = 2, timeout_s: float = 10.0,
                 initializer: str | None = None, initializer_args: tuple = (),
                 start_method: str = "spawn",
                 max_items_per_worker: int | None = 20_000,
                 startup_timeout_s: float = 300.0, chunk_size: int | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if start_method != "spawn":
            raise ValueError(f"start_method must be 'spawn' (a fresh interpreter; never fork a "
                             f"JAX process), got {start_method!r}")
        self.fn = fn
        self.initializer = initializer
        self.initializer_args = tuple(initializer_args)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.max_items_per_worker = max_items_per_worker
        self.startup_timeout_s = float(startup_timeout_s)
        self.chunk_size = chunk_size
        self._lock = threading.Lock()
        self._closed = False
        self._spawned = 0
        self.stats = collections.Counter()  # timeouts / errors / restarts over the pool's life
        self._workers = [self._new_worker() for _ in range(num_workers)]
        # A weak reference, so the hook does not keep an unused pool alive.
        self_ref = weakref.ref(self)
        self._atexit_hook = lambda: (p := self_ref()) is not None and p.close()
        atexit.register(self._atexit_hook)

    # -- lifecycle -------------------------------------------------------------------------

    def _new_worker(self) -> _Worker:
        self._spawned += 1
        return _Worker(self.fn, self.initializer, name=f"verify-worker-{self._spawned}",
                       init_args=self.initializer_args)

    def _replace(self, idx: int, graceful: bool) -> None:
        self._workers[idx].stop(graceful=graceful)
        self._workers[idx] = self._new_worker()
        self.stats["restarts"] += 1

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                w.stop(graceful=True)
            self._workers = []
        try:
            atexit.unregister(self._atexit_hook)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> "VerifyPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- work ------------------------------------------------------------------------------

    def map(self, items: Sequence[tuple]) -> list[ItemResult]:
        """Runs fn(*args) for each args tuple in `items`; returns one ItemResult per item, in order.

        Never raises for a bad item (timeouts and crashes become results); raises RuntimeError
        only if a worker cannot start at all (e.g. fn is not importable).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifyPool is closed")
            try:
                return self._map_locked(list(items))
            except BaseException:
                # Interrupted mid-batch (start-up failure, KeyboardInterrupt): workers still
                # holding items of this batch would answer into the next one; replace them.
                for idx, w in enumerate(self._workers):
                    if w.busy:
                        w.current.clear()
                        self._replace(idx, graceful=False)
                raise

    def _map_locked(self, items: list[tuple]) -> list[ItemResult]:
        n = len(items)
        results: list[ItemResult | None] = [None] * n
        if n == 0:
            return []
        chunk = self.chunk_size or max(1, min(64, math.ceil(n / (4 * self.num_workers))))
        pending = collections.deque(range(n))  # item indices not yet sent
        remaining = n
        # A worker that died while idle (killed from outside, its parent thread gone) is
        # replaced before it is handed work.
        for idx, w in enumerate(list(self._workers)):
            if not w.process.is_alive():
                self._replace(idx, graceful=False)

        while remaining:
            now = time.monotonic()
            # Hand a chunk to every idle ready worker.
            for idx, w in enumerate(list(self._workers)):
                if w.ready and not w.busy and pending:
                    keys = [pending.popleft() for _ in range(min(chunk, len(pending)))]
                    try:
                        w.conn.send([(k, items[k]) for k in keys])
                    except OSError:  # it died since: the chunk goes to the next worker
                        pending.extendleft(reversed(keys))
                        self._replace(idx, graceful=False)
                        continue
                    w.current.extend(keys)
                    w.deadline = now + self.timeout_s

            waiting = [w for w in self._workers if w.busy or not w.ready]
            next_deadline = min((w.deadline if w.ready else w.started_at + self.startup_timeout_s)
                                for w in waiting)
            ready_conns = multiprocessing.connection.wait(
                [w.conn for w in waiting], timeout=max(0.0, next_deadline - time.monotonic()))

            for idx, w in enumerate(list(self._workers)):
                if w.conn in ready_conns:
                    remaining -= self._drain(idx, results, pending)
            now = time.monotonic()
            for idx, w in enumerate(list(self._workers)):
                if not w.ready and now > w.started_at + self.startup_timeout_s:
                    w.stop(graceful=False)
                    raise RuntimeError(f"verify worker did not start within "
                                       f"{self.startup_timeout_s:.0f} s (fn={self.fn})")
                if w.busy and now > w.deadline:
                    # Hung item: kill the worker, report the item, resend the rest of its chunk.
                    key = w.current.popleft()
                    results[key] = ItemResult(TIMEOUT, f"no result within {self.timeout_s} s")
                    remaining -= 1
                    self.stats["timeouts"] += 1
                    pending.extendleft(reversed(w.current))
                    w.current.clear()
                    self._replace(idx, graceful=False)
        return results  # type: ignore[return-value]

    def _drain(self, idx: int, results: list, pending: collections.deque) -> int:
        """Reads every message waiting from worker idx; returns how many items it finished."""
        w = self._workers[idx]
        finished = 0
        while True:
            try:
                if not w.conn.poll():
                    break
                msg = w.conn.recv()
            except (EOFError, OSError):
                # The worker died: blame the item it was on, resend the rest.
                w.process.join(timeout=1.0)
                if not w.ready:
                    raise RuntimeError(f"verify worker exited during start-up "
                                       f"(exit code {w.process.exitcode}, fn={self.fn})")
                if w.current:
                    key = w.current.popleft()
                    results[key] = ItemResult(
                        ERROR, f"worker crashed (exit code {w.process.exitcode})")
                    finished += 1
                    self.stats["crashes"] += 1
                    pending.extendleft(reversed(w.current))
                    w.current.clear()
                self._replace(idx, graceful=False)
                return finished
            if not w.ready:
                kind, payload = msg
                if kind != "ready":
                    w.stop(graceful=False)
                    raise RuntimeError(f"verify worker failed to start (fn={self.fn}):\n{payload}")
                w.ready = True
                continue
            key, status, value = msg
            expected = w.current.popleft()
            assert key == expected, (key, expected)
            results[key] = ItemResult(status, value)
            finished += 1
            w.items_done += 1
            if status == TIMEOUT:
                self.stats["timeouts"] += 1
            elif status == ERROR:
                self.stats["errors"] += 1
            w.deadline = time.monotonic() + self.timeout_s
        if (not w.busy and self.max_items_per_worker
                and w.items_done >= self.max_items_per_worker):
            self._replace(idx, graceful=True)
        return finished
