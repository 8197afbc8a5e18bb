"""Where the offline per-step work runs: this process, local worker processes, or a Ray cluster.

:func:`map_ordered` applies a picklable top-level function to a list of argument tuples and returns
the results in input order, whatever the engine, so a reduction over them (the trailing windows of
:func:`triage_monitor.offline.analysis.recompute`) is bit-identical between engines.  Every engine runs the
function with one torch thread per task (:func:`single_threaded`), so the floating-point reductions
inside a task do not depend on how many cores the machine has either.

* ``engine="local", workers=1``: in this process; the next task's arguments can be prepared by a
  background thread (``prefetch``), e.g. decoding the next step's Parquet files while this one computes;
* ``engine="local", workers=N``: N spawned processes (``concurrent.futures``), each task a contiguous chunk
  of the items (consecutive steps often share a Parquet row group, read once in a chunk); like every spawned
  process they import the program's ``__main__`` first, so a script calling this keeps its work under
  ``if __name__ == "__main__":``;
* ``engine="ray"``: one Ray task per chunk of items (as the worker processes') on the cluster at
  ``address`` (None: a running cluster found through ``RAY_ADDRESS``, else a new local one).  Ray is
  optional: ``pip install triage-monitor[ray]``.  The run directory must be readable at the same path on
  every node.

A progress bar (rich, on stderr) is shown when ``progress`` is true.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import sys
from typing import Any, Callable, Optional, Sequence, TypeVar

#: what the mapped function returns
T = TypeVar("T")

ENGINES = ("local", "ray")


@contextlib.contextmanager
def single_threaded():
    """Run the body with one torch intra-op thread (restored afterwards), where torch is imported: the offline
    map itself is numpy and compiled code, and does not import it."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _call_single_threaded(fn: Callable, args: tuple):
    with single_threaded():
        return fn(*args)


def map_ordered(fn: Callable[..., T], items: Sequence[tuple], *, engine: str = "local", workers: int = 1,
                address: Optional[str] = None, progress: bool = False, description: str = "working",
                prefetch: Optional[Callable] = None, finish: Optional[Callable] = None,
                advance: Optional[Callable] = None) -> list[T]:
    """``[fn(*args) for args in items]``, computed by ``engine``, in input order.

    Args:
        fn: a picklable top-level function (it runs in other processes with ``workers > 1`` or Ray).
        items: argument tuples.
        engine: "local" or "ray".
        workers: local processes (engine "local"); 1 = this process.
        address: Ray cluster address (engine "ray"), e.g. "auto" or "ray://host:10001".
        progress: show a progress bar.
        advance: called once per item done, in place of a bar of this call's own (one bar over several maps,
            :func:`progress_bar`); ``progress`` is then ignored.
        prefetch: ``prefetch(*args)`` returns the arguments actually passed to ``fn``; in this process computed
            one item ahead on a background thread (I/O overlapping compute), in a worker just before ``fn``.
        finish: a picklable top-level function called without arguments where a run of items ends: after the
            last item here, after each chunk in a worker (e.g. to drop what a reader kept for the next items).

    Worker processes and Ray tasks each take a contiguous chunk of the items (:func:`chunks`, about
    :data:`CHUNKS_PER_WORKER` a worker): consecutive items often read the same data (the steps of one Parquet
    row group), which a chunk reads once.

    Raises:
        ValueError: unknown engine or workers < 1.
        ImportError: engine "ray" without Ray installed (the message says how to install it).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if int(workers) < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    items = list(items)
    with (contextlib.nullcontext(advance) if advance is not None else
          _progress(progress, len(items), description)) as advance:
        if engine == "ray":
            return _map_ray(fn, items, address, advance, prefetch, finish)
        if workers == 1:
            try:
                return _map_here(fn, items, advance, prefetch)
            finally:
                if finish is not None:
                    finish()
        return _map_processes(fn, items, int(workers), advance, prefetch, finish)


#: Chunks of contiguous items a worker process or Ray worker gets, about (more balance the load, fewer read less
#: twice: a Parquet row group shared by two chunks' steps is decoded by both).
CHUNKS_PER_WORKER = 4


def chunks(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into at most ``parts`` contiguous ranges of near-equal length, in order."""
    parts = max(1, min(int(parts), n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _call_chunk(fn: Callable, prefetch, finish, chunk: list) -> list[Any]:
    """``fn`` of each item of ``chunk`` in order (in a worker), one torch thread, then ``finish``."""
    try:
        with single_threaded():
            return [_prefetched(fn, prefetch, args) for args in chunk]
    finally:
        if finish is not None:
            finish()


def _map_here(fn: Callable[..., T], items, advance, prefetch) -> list[T]:
    """``fn`` of each item in this process, in order; with ``prefetch``, the next item's arguments made on a
    background thread while this one computes."""
    out: list[T] = []
    if prefetch is None:
        for args in items:
            out.append(_call_single_threaded(fn, args))
            advance()
        return out
    with cf.ThreadPoolExecutor(1, thread_name_prefix="triage-monitor-prefetch") as pool:
        nxt = pool.submit(prefetch, *items[0]) if items else None
        for i in range(len(items)):
            assert nxt is not None      # item i's prefetch: submitted before the loop or in the turn before
            ready = nxt.result()
            nxt = pool.submit(prefetch, *items[i + 1]) if i + 1 < len(items) else None
            out.append(_call_single_threaded(fn, ready))
            advance()
    return out


def _prefetched(fn, prefetch, args):
    return fn(*(prefetch(*args) if prefetch is not None else args))


def ignore_sigint() -> None:
    """Pool-worker initializer: Ctrl-C reaches the whole process group; only the parent handles it (one line,
    exit 130), the workers are stopped by :func:`stop_pool` instead of each printing a traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def stop_pool(pool: cf.ProcessPoolExecutor):
    """On KeyboardInterrupt inside the body: cancel the queued tasks and terminate ``pool``'s workers at once
    (the executor's own exit would wait for every running task), then re-raise."""
    try:
        yield pool
    except KeyboardInterrupt:
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()
        raise


def _map_processes(fn: Callable[..., T], items, workers, advance, prefetch, finish) -> list[T]:
    """``fn`` of each item in ``workers`` spawned processes, a chunk of items a task (:func:`chunks`), in order."""
    out: list = [None] * len(items)
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=ignore_sigint) as pool, \
            stop_pool(pool):
        futs = {pool.submit(_call_chunk, fn, prefetch, finish, [items[i] for i in c]): c
                for c in chunks(len(items), workers * CHUNKS_PER_WORKER)}
        for f in cf.as_completed(futs):
            for i, r in zip(futs[f], f.result()):
                out[i] = r
                advance()
    return out


def _map_ray(fn: Callable[..., T], items, address, advance, prefetch, finish) -> list[T]:
    """``fn`` of each item in Ray tasks (one CPU each), a chunk of items a task (:func:`chunks`), in order."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("engine='ray' needs Ray: pip install 'triage-monitor[ray]' (or pip install ray)") from exc
    if not ray.is_initialized():
        import os

        local = address is None and not os.environ.get("RAY_ADDRESS")     # start a new local cluster
        options: dict[str, Any] = {"include_dashboard": False} if local else {}
        ray.init(address=address, log_to_driver=False, **options)
    task = ray.remote(num_cpus=1)(_call_chunk)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    index = {task.remote(fn, prefetch, finish, [items[i] for i in c]): c
             for c in chunks(len(items), cpus * CHUNKS_PER_WORKER)}
    out: list = [None] * len(items)
    pending = list(index)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for r in done:
            for i, v in zip(index[r], ray.get(r)):
                out[i] = v
                advance()
    return out


def progress_bar(show: bool, total: int, description: str):
    """A context manager giving the ``advance()`` of one progress bar of ``total`` items (rich, on stderr; a no-op
    when not ``show``), for several :func:`map_ordered` calls (their ``advance``)."""
    return _progress(show, total, description)


@contextlib.contextmanager
def _progress(show: bool, total: int, description: str):
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    # on stderr, so that stdout keeps only the command's result (a pipe or a file gets no bar at all)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)
