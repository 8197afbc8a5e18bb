"""Faults, for real: SIGKILL mid-write, read-only and full output directories, backpressure memory, resume.

Child processes run this file as a script (``python tests/test_faults.py <mode> <dir> ...``) so the
kill, the file-size limit and the peak-RSS measurement hit a real, separate process.

Unwritable directories: tests run as root here, and root ignores permission bits, so ``chmod`` cannot
make a directory unwritable.  The tests use (1) a run directory *under a regular file* (every mkdir
fails with NotADirectoryError, for any user) and (2) a read-only tmpfs mount where ``mount`` is
permitted.  Full disk: a 1 MiB tmpfs where ``mount`` is permitted, and always a child process with
``RLIMIT_FSIZE`` (SIGXFSZ ignored, so writes fail with EFBIG instead of killing the process); for the
writer lock's line, a lock file linked to ``/dev/full`` (every write fails with ENOSPC).
"""

import contextlib
import io
import json
import logging
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runfiles import steps_of  # noqa: E402
from triage_monitor.alerting.alerts import AlertEngine, CallbackSink, Rule  # noqa: E402
from triage_monitor.offline.analysis import open_run, recompute  # noqa: E402
from triage_monitor.batch import TokenBatch  # noqa: E402
from triage_monitor.monitor import MismatchMonitor, MonitorConfig  # noqa: E402
from triage_monitor.rundir.records import UnwritableOutputError  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def batch(step, B=16, T=256, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    s = -torch.rand(B, T, generator=g) * 4
    lp = (s + torch.randn(B, T, generator=g) * 0.1 - (torch.rand(B, T, generator=g) < 0.04) * 3).clamp(max=0)
    m = torch.rand(B, T, generator=g) < 0.9
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), m, sample_ids=torch.arange(B) + 1000 * step)


def run_child(*args, timeout=120, preexec=None):
    return subprocess.run([sys.executable, __file__, *map(str, args)], env=ENV, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec)


def visible_files(d: Path) -> list:
    return [p for p in d.rglob("*.parquet") if not p.name.startswith(".")]


def assert_all_readable(d: Path, table: str = "tokens") -> int:
    """Every visible Parquet file reads completely with plain pyarrow, and every pending file with the run's
    reader; returns the rows of ``table`` (None: every table) they hold, each step of a rank once (a pending file
    whose block is sealed too is the same records)."""
    from triage_monitor.rundir.blocks import read_part
    from triage_monitor.rundir.layout import TABLES, RunLayout

    for p in visible_files(d):
        pq.read_table(p)
    layout, rows = RunLayout(d), 0
    for t in TABLES if table is None else (table,):
        idx = layout.index(t)
        sealed = {(p.rank, p.attempt, p.part, s) for p in idx.parts if p.sealed for s in range(p.lo, p.hi + 1)}
        for p in idx.parts:
            if p.sealed or (p.rank, p.attempt, p.part, p.lo) not in sealed:
                rows += read_part(layout.store, p).num_rows
    return rows


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """Mount a tmpfs at ``path`` (``options`` e.g. "size=1m" or "ro"); yields False when not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


# ============================================================================== SIGKILL
def child_train(d):
    """Log big steps forever; after step 3, flush (a checkpoint barrier); report what was submitted."""
    mon = MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2))
    for step in range(10_000):
        b = batch(step, B=64, T=1024)
        mon.log_step(step, b)
        print(f"submitted {step} {b.num_tokens} {mon.sink._queued_bytes}", flush=True)
        if step == 3:
            mon.flush()
            print("flushed 3", flush=True)


@pytest.mark.multiprocess
def test_sigkill_while_writing_leaves_only_complete_files(tmp_path):
    d = tmp_path / "run"
    p = subprocess.Popen([sys.executable, __file__, "train", str(d)], env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    submitted, flushed, busy_kill = {}, False, False
    deadline = time.monotonic() + 120
    for line in p.stdout:
        parts = line.split()
        if parts[0] == "flushed":
            flushed = True
        elif parts[0] == "submitted":
            submitted[int(parts[1])] = int(parts[2])
            # kill right after a submit while the writer still has bytes queued (it is busy), 4+ steps later
            if flushed and len(submitted) >= 8 and int(parts[3]) > 0:
                os.kill(p.pid, signal.SIGKILL)
                busy_kill = True
                break
        assert time.monotonic() < deadline, "child never got busy"
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL and busy_kill, p.stderr.read()

    # every visible file is complete; every step up to the flush barrier is fully there
    on_disk = assert_all_readable(d)
    run = open_run(d)
    for step in range(4):
        assert len(run.tokens(step)) == submitted[step]
    steps_on_disk = run.step_numbers()
    assert steps_on_disk == list(range(len(steps_on_disk)))  # the writer is FIFO: no holes
    for step in steps_on_disk:                               # no partial step: exact row counts
        assert len(run.tokens(step)) == submitted[step]
    # analysis skips temporary files and recomputes what survived
    rec = recompute(run)
    assert rec["step"].tolist() == steps_on_disk
    lost = sum(submitted.values()) - on_disk
    tmp_left = list(d.rglob(".tmp-*"))
    print(f"\nSIGKILL: {len(submitted)} steps submitted ({sum(submitted.values())} token rows), "
          f"{len(steps_on_disk)} complete on disk, rows lost {lost} "
          f"(= the {len(submitted) - len(steps_on_disk)} step(s) still queued), temp files left {len(tmp_left)}")
    assert lost == sum(n for s, n in submitted.items() if s not in steps_on_disk)
    assert run.manifest.status == "running"               # the manifest shows the job never closed


# ============================================================================== unwritable
def _alerting_monitor(d, **cfg):
    fired = []
    rule = Rule(name="writer_dropping", metric="writer_dropped_rows", condition="above", threshold=0, level="ERROR")
    mon = MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2, **cfg),
                          alerts=AlertEngine([rule], sinks=[CallbackSink(fired.append)]))
    return mon, fired


def assert_warned_once(caplog):
    """One warning from the writer (rows dropped), at most one about a block left in pending files and at most one
    about run.json, however many steps failed."""
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and ("could not" in r.getMessage() or "dropped" in r.getMessage())      # I/O warnings only,
            and "of this run were not written" not in r.getMessage()]              # not close()'s summary
    assert len([m for m in msgs if "rows are counted as dropped" in m]) == 1, msgs
    assert len([m for m in msgs if "run.json" in m]) <= 1, msgs
    assert len([m for m in msgs if "stay in pending files" in m]) <= 1, msgs
    assert len(msgs) <= 3, msgs


def test_run_dir_under_a_regular_file_is_an_error_at_start(tmp_path):
    # unwritable from the start: the monitor refuses at construction (before any training step), naming the
    # path and the OS reason; this holds for any user (root included)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a regular file")
    with pytest.raises(UnwritableOutputError, match="Not a directory") as err:
        MismatchMonitor(blocker / "run")
    assert str(blocker / "run") in str(err.value) and err.value.path == blocker / "run"


def test_read_only_mount_is_an_error_at_start(tmp_path):
    ro = tmp_path / "ro"
    with tmpfs(ro, "ro") as ok:
        if not ok:
            pytest.skip("mount not permitted here (the regular-file test covers unwritable directories)")
        with pytest.raises(UnwritableOutputError, match="Read-only file system") as err:
            MismatchMonitor(ro / "run")
        assert str(ro / "run") in str(err.value) and not list(ro.iterdir())


def test_read_only_mount_mid_run_training_continues(tmp_path, caplog):
    # the disk turns read-only while training: no exception reaches the training loop; rows are counted
    # as dropped, warned once, and the writer_dropping alert fires
    mnt = tmp_path / "rw"
    with tmpfs(mnt, "size=64m") as ok:
        if not ok:
            pytest.skip("mount not permitted here (the RLIMIT_FSIZE test covers failing writes mid-run)")
        caplog.set_level(logging.WARNING)
        # a block per step: a remount read-only is refused while a file is open for writing (a block being
        # written keeps its file open between steps), so the remount comes between two blocks
        mon, fired = _alerting_monitor(mnt / "run", roll_steps=1)
        metrics = [mon.log_step(0, batch(0))]
        mon.flush()
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode == 0
        for step in range(1, 4):
            metrics.append(mon.log_step(step, batch(step)))
            mon.flush()                  # let the writer fail now, so the next step sees the count
        mon.close()
        assert len(metrics) == 4 and all(not math.isnan(m["rho_asym"]) for m in metrics)
        assert "Read-only file system" in mon.sink.last_error
        assert mon.sink.dropped_rows >= sum(m["n_tokens"] for m in metrics[1:])
        assert metrics[0]["writer_dropped_rows"] == 0 and metrics[2]["writer_dropped_rows"] >= metrics[1]["n_tokens"]
        assert_warned_once(caplog)
        assert [a.rule for a in fired] == ["writer_dropping"]
        assert open_run(mnt / "run").step_numbers() == [0]


def test_full_tmpfs_counts_dropped_rows_and_keeps_files_whole(tmp_path, caplog):
    mnt = tmp_path / "small"
    with tmpfs(mnt, "size=1m") as ok:
        if not ok:
            pytest.skip("mount not permitted here (the RLIMIT_FSIZE test covers a full disk)")
        caplog.set_level(logging.WARNING)
        mon, fired = _alerting_monitor(mnt / "run")
        metrics = []
        for step in range(12):
            metrics.append(mon.log_step(step, batch(step, B=32, T=512)))
            mon.flush()
        mon.close()
        assert len(metrics) == 12                                      # training went on
        assert mon.sink.written_rows > 0 and mon.sink.dropped_rows > 0
        assert "No space left" in mon.sink.last_error
        assert metrics[-1]["writer_dropped_rows"] > 0 and fired
        assert_warned_once(caplog)
        assert not list(mnt.rglob(".tmp-*"))                           # failed writes leave no temp file
        assert assert_all_readable(mnt / "run", None) == mon.sink.written_rows   # what is visible is complete


def _no_flock():
    """Make ``fcntl.flock`` fail as on a file system without flock (an NFS mount without its lock daemon answers
    ENOLCK).  No file system mountable here lacks flock, so the tests (in this process or a child) replace it."""
    import errno
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    fcntl.flock = no_flock


def test_a_file_system_without_flock_warns_once_and_holds_an_exclusive_lock_file(tmp_path, caplog, monkeypatch):
    """On a file system without flock a writer still starts: one warning names the lock file, the OS reason and
    the stand-in (text typed out here); while it writes, ``.writer-rank-0.lock.excl`` holds "pid <this pid> on
    <this host>, attempt <its attempt>, ..." and a second writer of the rank in another process would be refused
    (the multi-process test below); at close the file is removed, the steps are written and the flock lock file
    holds no holder line."""
    import fcntl
    import socket

    monkeypatch.setattr(fcntl, "flock", fcntl.flock)       # restored after the test
    _no_flock()
    caplog.set_level(logging.WARNING, logger="triage_monitor")
    d = tmp_path / "run"
    lock, excl = d / ".writer-rank-0.lock", d / ".writer-rank-0.lock.excl"
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), attempt=17) as mon:
        for step in range(2):
            mon.log_step(step, batch(step, B=2, T=16))
        held = excl.read_text()
    assert [r.getMessage() for r in caplog.records if r.name == "triage_monitor.records"] == [
        f"triage-monitor: cannot lock {lock} (No locks available): no flock on this file system; the exclusive lock "
        f"file {excl} stands in for it (created with O_EXCL, removed at close)"]
    assert held.startswith(f"pid {os.getpid()} on {socket.gethostname()}, attempt 17, since ")
    assert not excl.exists() and lock.read_text() == ""
    assert open_run(d).step_numbers() == [0, 1]


def child_noflock_hold(d):
    """Without flock: hold rank 0 of run ``d`` (one step written), print "held", wait for stdin to close."""
    _no_flock()
    mon = MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), alerts=False)
    mon.log_step(0, batch(0, B=2, T=16))
    mon.flush()
    print("held", flush=True)
    sys.stdin.read()
    mon.close()


def child_noflock_start(d):
    """Without flock: start a writer of rank 0 of ``d``, log step 1; print "ok" or the error's type and text."""
    _no_flock()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from triage_monitor.rundir.records import RunLockedError

    try:
        with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), alerts=False) as mon:
            mon.log_step(1, batch(1, B=2, T=16))
    except RunLockedError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        return
    print(json.dumps({"error": None}))


@pytest.mark.multiprocess
def test_without_flock_a_second_process_is_refused_and_a_killed_writers_lock_is_taken_over(tmp_path, monkeypatch):
    """Without flock (in every process here), with real processes: while a writer holds rank 0, a second process
    is refused with ``RunLockedError`` naming the holder's pid and the stand-in file; so is ``force``.  The holder
    is SIGKILLed (no close: its ``.lock.excl`` stays behind, naming a pid that is no longer running on this host);
    the next writer takes it over with one warning and writes.  A stand-in naming another host is never taken
    over: refused, naming the file to remove."""
    d = tmp_path / "run"
    excl = d / ".writer-rank-0.lock.excl"
    holder = subprocess.Popen([sys.executable, __file__, "noflock-hold", str(d)], env=ENV, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        assert excl.read_text().startswith(f"pid {holder.pid} on ")
        r = run_child("noflock-start", d)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["error"] == "RunLockedError", r.stderr
        assert f"rank 0 (pid {holder.pid} on " in out["message"] and f"{excl} stands in for the lock" in out["message"]
        import fcntl

        from triage_monitor.rundir.records import RunLockedError

        monkeypatch.setattr(fcntl, "flock", fcntl.flock)
        _no_flock()
        with pytest.raises(RunLockedError, match=f"rank 0 \\(pid {holder.pid} on "):
            MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), force=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]        # nothing moved aside
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)                            # reaped: the pid is no longer running
        assert holder.returncode == -signal.SIGKILL and excl.exists()
    finally:
        holder.kill()
        holder.wait()
    r = run_child("noflock-start", d)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"error": None}, r.stderr
    assert r.stderr.count("a killed writer's lock, taken over") == 1 and f"(pid {holder.pid} on " in r.stderr
    assert not excl.exists()
    assert open_run(d).step_numbers() == [0, 1]
    excl.write_text("pid 4242 on another-host.example, attempt 1, since 2024-01-01T00:00:00+0000\n")
    r = run_child("noflock-start", d)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] == "RunLockedError" and "(pid 4242 on another-host.example, " in out["message"]
    assert "remove it once that job is gone" in out["message"] and excl.exists()


def child_fsize(d, limit):
    """Run 10 steps under RLIMIT_FSIZE = limit bytes with SIGXFSZ ignored; print a JSON summary."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda r: warnings.append(r.getMessage()) if r.levelno >= logging.WARNING else None
    logging.getLogger("triage_monitor").addHandler(handler)
    mon, fired = _alerting_monitor(d)
    logged = []
    for step in range(10):
        size = 64 if step < 3 else 2048          # small steps fit under the limit, big ones do not
        logged.append(mon.log_step(step, batch(step, B=16, T=size))["writer_dropped_rows"])
        mon.flush()
    mon.close()
    print(json.dumps({"steps": len(logged), "dropped_seen": logged, "dropped": mon.sink.dropped_rows,
                      "written": mon.sink.written_rows, "error": mon.sink.last_error, "warnings": warnings,
                      "alerts": [a.rule for a in fired]}))


@pytest.mark.multiprocess
def test_file_size_limit_full_disk_in_child_process(tmp_path):
    d = tmp_path / "run"
    r = run_child("fsize", d, 100_000)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["steps"] == 10 and out["written"] > 0 and out["dropped"] > 0
    assert "File too large" in out["error"]
    assert out["dropped_seen"][:3] == [0, 0, 0] and out["dropped_seen"][-1] > 0
    io_warnings = [w for w in out["warnings"] if "could not" in w or "dropped" in w]
    assert len([w for w in io_warnings if "rows are counted as dropped" in w]) == 1 and len(io_warnings) <= 2
    assert out["alerts"] == ["writer_dropping"]
    assert_all_readable(d)
    assert not list(d.rglob(".tmp-*"))
    assert open_run(d).step_numbers()[:3] == [0, 1, 2]


def test_a_disk_without_free_blocks_refuses_the_start_naming_the_lock_file_and_holds_no_lock(tmp_path, caplog):
    """No free block for the lock file's holder line (the start check's empty probe file still fits): the lock
    file is a link to ``/dev/full``, where every write fails with ENOSPC as on a full disk.  The start fails with
    an ``UnwritableOutputError`` naming the lock file and the OS reason (typed out), its ``path`` the run
    directory, and the lock is not kept: once the disk has room, a monitor of that rank in the same process
    starts without taking over an earlier writer."""
    from triage_monitor.rundir import locks

    d = tmp_path / "run"
    d.mkdir()
    lock = d / ".writer-rank-0.lock"
    lock.symlink_to("/dev/full")
    held = dict(locks._HELD)
    with pytest.raises(UnwritableOutputError) as err:
        MismatchMonitor(d, MonitorConfig(window=2))
    assert str(err.value) == f"{lock}: cannot write the writer lock file: No space left on device"
    assert err.value.path == d and locks._HELD == held
    lock.unlink()
    caplog.set_level(logging.WARNING, logger="triage_monitor")
    with MismatchMonitor(d, MonitorConfig(window=2)) as mon:
        mon.log_step(0, batch(0, B=2, T=8))
    assert not [r for r in caplog.records if "was not closed" in r.getMessage()]
    assert open_run(d).step_numbers() == [0]


def test_a_directory_in_place_of_the_lock_file_refuses_the_start_naming_it(tmp_path):
    """A directory at ``.writer-rank-0.lock`` (left by a copy tool, say): the start fails with an
    ``UnwritableOutputError`` naming the lock file and the OS reason, its ``path`` the run directory."""
    d = tmp_path / "run"
    (d / ".writer-rank-0.lock").mkdir(parents=True)
    with pytest.raises(UnwritableOutputError) as err:
        MismatchMonitor(d, MonitorConfig(window=2))
    assert str(err.value) == f"{d / '.writer-rank-0.lock'}: cannot open the writer lock file: Is a directory"
    assert err.value.path == d


# ============================================================================== resume on a failing disk
def fill_disk(path: Path) -> None:
    """Write zeros to ``path`` until the file system answers ENOSPC (unbuffered: nothing is left to flush)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as exc:
        assert exc.errno == 28, exc                      # ENOSPC
    finally:
        os.close(fd)


def files_of(d: Path) -> dict:
    """``{relative path: bytes}`` of the run's visible table files."""
    return {str(p.relative_to(d)): p.read_bytes() for p in visible_files(d)}


def names_of_step(d: Path, table: str, step: int) -> list:
    """The names of the files of ``table`` that hold ``step`` (every attempt and part)."""
    from triage_monitor.rundir.layout import RunLayout

    return sorted(p.name.split("/")[1] for p in RunLayout(d).index(table).covering(step))


def test_a_resume_on_a_full_disk_keeps_the_earlier_attempts_files(tmp_path, caplog):
    """A job resumed on a full disk (a tmpfs filled to ENOSPC) repeats steps 2-3: none of its records can be
    written, and the earlier attempt's files stay byte for byte (no attempt ever removes another's files), so
    readers read steps 2-3 from the earlier attempt.  With room again, a third attempt repeats step 2: readers take
    its records of step 2 and the first attempt's of step 3; the first attempt's files are still there whole."""
    mnt = tmp_path / "disk"
    with tmpfs(mnt, "size=4m") as ok:
        if not ok:
            pytest.skip("mount not permitted here (the RLIMIT_FSIZE and dropped-file tests cover it)")
        d, cfg = mnt / "run", MonitorConfig(window=2, calibration_steps=2)
        with MismatchMonitor(d, cfg, alerts=False) as mon:
            for s in range(5):
                mon.log_step(s, batch(s, B=8, T=64))
        a1, before = mon.attempt, files_of(d)
        assert sorted(before) == [f"{t}/steps-00000000-00000004-rank-0000-attempt-{a1}-part-0.parquet"
                                  for t in ("steps", "tokens")]
        fill_disk(mnt / "filler")
        caplog.set_level(logging.WARNING, logger="triage_monitor")
        with MismatchMonitor(d, cfg, alerts=False) as mon:
            for s in (2, 3):
                mon.log_step(s, batch(s, B=8, T=64, seed=4))
        assert mon.sink.written_steps == 0 and "No space left" in mon.sink.last_error
        assert files_of(d) == before
        run = open_run(d)
        assert run.step_numbers() == [0, 1, 2, 3, 4] and set(run.steps()["attempt"]) == {a1}
        assert [len(run.tokens(s)) for s in (2, 3)] == [batch(s, B=8, T=64).num_tokens for s in (2, 3)]
        assert not list(mnt.rglob(".tmp-*")) and not list(mnt.rglob(".pending-*"))
        (mnt / "filler").unlink()
        with MismatchMonitor(d, cfg, alerts=False) as mon:
            mon.log_step(2, batch(2, B=8, T=64, seed=5))
        a3 = mon.attempt
        for table in ("tokens", "steps"):
            assert names_of_step(d, table, 2) == [
                f"steps-00000000-00000004-rank-0000-attempt-{a1}-part-0.parquet",
                f"steps-00000002-00000002-rank-0000-attempt-{a3}-part-0.parquet"]
        assert all(files_of(d)[k] == v for k, v in before.items())
        run = open_run(d)
        assert len(run.tokens(2)) == batch(2, B=8, T=64, seed=5).num_tokens and set(run.tokens(2)["attempt"]) == {a3}
        assert set(run.tokens(3)["attempt"]) == {a1} and run.steps().set_index("step")["attempt"].to_dict() == {
            0: a1, 1: a1, 2: a3, 3: a1, 4: a1}


def child_fsize_resume(d, limit):
    """Resume run ``d`` under RLIMIT_FSIZE = limit bytes (SIGXFSZ ignored): repeat steps 2 and 3 with big token
    files (over the limit) and small steps files (under it); print a JSON summary."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), alerts=False) as mon:
        for s in (2, 3):
            mon.log_step(s, batch(s, B=16, T=2048, seed=4))
    print(json.dumps({"attempt": mon.attempt, "written": mon.sink.written_steps, "error": mon.sink.last_error}))


@pytest.mark.multiprocess
def test_a_resume_under_a_file_size_limit_keeps_the_earlier_token_files(tmp_path):
    """A resumed attempt in a child process under ``RLIMIT_FSIZE`` = 100 kB repeats steps 2-3: its token records
    (each step over the limit) fail with EFBIG, its steps rows (a few kB) are written.  The earlier attempt's token
    file stays byte for byte; the readers take the steps rows of the new attempt and the tokens of the old one (the
    ``attempt`` columns say so): each table's records of a step are its latest attempt's there."""
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), alerts=False) as mon:
        for s in range(5):
            mon.log_step(s, batch(s, B=16, T=2048))
    a1, before = mon.attempt, files_of(d)
    assert all(len(b) > 100_000 for k, b in before.items() if k.startswith("tokens"))      # over the limit
    r = run_child("fsize-resume", d, 100_000)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    a2 = out["attempt"]
    assert "File too large" in out["error"] and out["written"] == 2
    key = f"tokens/steps-00000000-00000004-rank-0000-attempt-{a1}-part-0.parquet"
    for s in (2, 3):
        assert names_of_step(d, "tokens", s) == [key.split("/")[1]]
        assert names_of_step(d, "steps", s) == [f"steps-00000000-00000004-rank-0000-attempt-{a1}-part-0.parquet",
                                                f"steps-00000002-00000003-rank-0000-attempt-{a2}-part-0.parquet"]
    assert (d / key).read_bytes() == before[key]
    run = open_run(d)
    steps = run.steps().set_index("step")
    assert steps.loc[2, "attempt"] == a2 and steps.loc[2, "n_tokens"] == batch(2, B=16, T=2048, seed=4).num_tokens
    assert set(run.tokens(2)["attempt"]) == {a1} and len(run.tokens(2)) == batch(2, B=16, T=2048).num_tokens
    assert not list(d.rglob(".tmp-*"))


def hold_disk(monkeypatch=None):
    """A disk that does not answer: every step the run writer writes waits until the returned ``release`` event is
    set (``entered`` is set when the first one starts waiting).  Patches ``blocks.write_pending`` (through
    ``monkeypatch`` when given, so it is restored)."""
    import threading

    import triage_monitor.rundir.blocks as blocks_mod

    release, entered = threading.Event(), threading.Event()
    real = blocks_mod.write_pending

    def held(store, rel, table):
        entered.set()
        if not release.wait(120):
            raise TimeoutError("the test never released the disk")
        real(store, rel, table)

    if monkeypatch is not None:
        monkeypatch.setattr(blocks_mod, "write_pending", held)
    else:
        blocks_mod.write_pending = held
    return release, entered


def test_a_resume_whose_files_are_dropped_keeps_the_earlier_attempts_files(tmp_path, monkeypatch):
    """``backpressure="drop"`` with a 1-byte queue bound on a disk held still: the resumed attempt's first step
    record (the tokens of step 2, alone in the queue) is taken; every later one is dropped (the steps row of step 2,
    both records of step 3).  The readers take each table's latest attempt of a step: the new tokens of step 2, the
    earlier attempt's steps row of step 2 and both records of step 3, whose files stay.  Dropped rows, worked out by
    hand: the tokens of step 3 plus 2 steps rows."""
    d, cfg = tmp_path / "run", MonitorConfig(window=2, calibration_steps=2)
    with MismatchMonitor(d, cfg, alerts=False) as mon:
        for s in range(5):
            mon.log_step(s, batch(s, B=8, T=64))
    a1 = mon.attempt
    release, entered = hold_disk(monkeypatch)
    mon = MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2, max_queue_bytes=1, backpressure="drop"),
                          alerts=False)
    try:
        for s in (2, 3):
            mon.log_step(s, batch(s, B=8, T=64, seed=4))
        assert entered.wait(60)
    finally:
        release.set()
        mon.close()
    a2 = mon.attempt
    assert mon.sink.dropped_rows == batch(3, B=8, T=64, seed=4).num_tokens + 2
    first = f"steps-00000000-00000004-rank-0000-attempt-{a1}-part-0.parquet"
    assert names_of_step(d, "tokens", 2) == [first, f"steps-00000002-00000002-rank-0000-attempt-{a2}-part-0.parquet"]
    assert names_of_step(d, "steps", 2) == [first]
    for table in ("tokens", "steps"):
        assert names_of_step(d, table, 3) == [first]
    run = open_run(d)
    assert run.step_numbers() == [0, 1, 2, 3, 4] and len(run.steps()) == 5
    assert set(run.tokens(2)["attempt"]) == {a2} and set(run.tokens(3)["attempt"]) == {a1}
    assert run.steps().set_index("step").loc[2, "attempt"] == a1


def test_a_repeated_steps_alerts_are_its_latest_attempts(tmp_path):
    """The alerts of a repeated step are those of the step's latest attempt (over the tokens and steps tables):
    another alert if one fired again, none if none fired; the earlier attempts' alert rows stay in their files.  A
    rule "n_tokens above 0" fires at the first step of each attempt (then stays active); raised above every count,
    it fires nowhere."""
    from triage_monitor.alerting.alerts import AlertEngine

    def engine(threshold):
        return AlertEngine([Rule(name="many", metric="n_tokens", condition="above", threshold=threshold)])

    d, cfg = tmp_path / "run", MonitorConfig(window=2, calibration_steps=2)
    with MismatchMonitor(d, cfg, alerts=engine(0)) as mon:
        for s in range(3):
            mon.log_step(s, batch(s, B=2, T=16))
    a1 = mon.attempt
    assert [(r.step, r.attempt) for r in open_run(d).alerts().itertuples()] == [(0, a1)]
    with MismatchMonitor(d, cfg, alerts=engine(0)) as mon:      # fires again at step 0
        mon.log_step(0, batch(0, B=2, T=16, seed=2))
        mon.log_step(1, batch(1, B=2, T=16, seed=2))
    a2 = mon.attempt
    assert [(r.step, r.attempt) for r in open_run(d).alerts().itertuples()] == [(0, a2)]
    with MismatchMonitor(d, cfg, alerts=engine(1e9)) as mon:    # nothing fires at step 0 now
        mon.log_step(0, batch(0, B=2, T=16, seed=3))
    assert open_run(d).alerts().empty
    assert len(names_of_step(d, "alerts", 0)) == 2              # both earlier attempts' rows are still on disk
    assert open_run(d).steps().set_index("step").loc[0, "attempt"] == mon.attempt


# ============================================================================== backpressure
def child_rss(d, mode, bound_mb, item_mb, n_items):
    """A producer that outruns the disk: n_items columns of item_mb MiB each into a bounded ParquetSink."""
    from triage_monitor.rundir.sink import ParquetSink

    rng = np.random.default_rng(0)
    n = int(item_mb * (1 << 20)) // 8
    sink = ParquetSink(d, attempt=1, max_queue_bytes=int(bound_mb * (1 << 20)), backpressure=mode)
    sink.submit("tokens", 0, 0, {"x": rng.random(n)})       # warm-up: pyarrow's code paths and pools
    sink.flush()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    max_q, t0, accepted = 0, time.monotonic(), 0
    for i in range(1, n_items + 1):
        accepted += sink.submit("tokens", i, 0, {"x": rng.random(n)})
        max_q = max(max_q, sink._queued_bytes)
    produce_s = time.monotonic() - t0
    sink.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mb": (peak - base) / 1024, "base_mb": base / 1024, "max_queued_mb": max_q / (1 << 20),
                      "dropped_rows": sink.dropped_rows, "written_rows": sink.written_rows, "rows_per_item": n,
                      "accepted": accepted, "produce_s": produce_s, "total_s": time.monotonic() - t0}))


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["block", "drop"])
def test_backpressure_bounds_memory(tmp_path, mode):
    bound, item, n_items = 16, 4, 40               # unbounded, the queue would hold 160 MiB
    r = run_child("rss", tmp_path / "run", mode, bound, item, n_items)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\nbackpressure={mode}: peak RSS growth {out['growth_mb']:.1f} MiB over a {out['base_mb']:.0f} MiB "
          f"baseline, bound {bound} MiB, max queued {out['max_queued_mb']:.1f} MiB, dropped rows "
          f"{out['dropped_rows']}, {n_items} x {item} MiB produced in {out['produce_s']:.2f} s")
    assert out["max_queued_mb"] >= bound - item        # the producer did outrun the disk
    assert out["max_queued_mb"] <= bound
    # the queue bound + the file being encoded (item + its Parquet copy) + allocator slack
    assert out["growth_mb"] < bound + 3 * item + 32, out
    total = (n_items + 1) * out["rows_per_item"]
    assert out["written_rows"] + out["dropped_rows"] == total
    if mode == "block":
        assert out["dropped_rows"] == 0
    else:
        assert out["dropped_rows"] > 0 and out["accepted"] < n_items
        assert out["dropped_rows"] == (n_items - out["accepted"]) * out["rows_per_item"]


def test_the_queue_bound_takes_a_file_alone_however_big_and_one_that_fills_it_exactly(tmp_path, held_file):
    """``max_queue_bytes`` with ``backpressure="drop"``, the writer thread held on the first file (its columns are
    built only once released): a file is refused only when it would take the queued bytes *over* the bound and
    something is queued.  A file's size for the bound: its stated size for deferred columns (at least 1), 256 bytes
    per row for a list of rows (at least one row's worth), ``nbytes`` of each array (8 per item for a plain list).
    By hand, with 1 byte held first: bound 100 takes 99 more (exactly 100), not 100 (101); bound 769 takes 3 rows
    (1 + 768), then not 1 byte more; bound 257 takes 1 row; bound 41 takes ten float32 (40 bytes); bound 25 takes
    a plain list of three numbers (24 bytes); bound 2 takes one file without columns (no rows, 1 byte), not a
    second.  Alone in the queue, 300 bytes over a bound of 100 are taken (nothing
    could make room), and after them not 1 byte."""
    import threading

    from triage_monitor.rundir.sink import ParquetSink

    def rows(n):
        return [{"x": float(i)} for i in range(n)]

    cases = [("big", 100, [300, 1], [True, False]),
             ("exact", 100, [1, 100, 99, 1], [True, False, True, False]),
             ("rows", 769, [1, rows(3), 1], [True, True, False]),
             ("one-row", 257, [1, rows(1)], [True, True]),
             ("float32", 41, [1, {"x": np.zeros(10, dtype=np.float32)}], [True, True]),
             ("plain-list", 25, [1, {"x": [1.0, 2.0, 3.0]}], [True, True]),
             ("no-columns", 2, [1, {}, {}], [True, True, False])]               # no rows, 1 byte each
    for name, bound, files, taken in cases:
        release = threading.Event()
        sink = ParquetSink(tmp_path / name, attempt=1, max_queue_bytes=bound, backpressure="drop")
        try:
            got = [sink.submit("steps", step, 0,
                               held_file(release if step == 0 else None, nbytes=f) if isinstance(f, int) else f)
                   for step, f in enumerate(files)]
        finally:
            release.set()
            sink.close()
        assert got == taken, name
        n_rows = [2 if isinstance(f, int) else len(f) if isinstance(f, list) else len(f.get("x", [])) for f in files]
        assert sink.written_steps == sum(bool(n) for n, t in zip(n_rows, taken) if t), name
        assert sink.dropped_rows == sum(n for n, t in zip(n_rows, taken) if not t), name
        assert steps_of(tmp_path / name, "steps") == [step for step, t in enumerate(taken) if t], name


def test_a_new_sink_blocks_on_256_mib_counts_nothing_and_writes_on_one_daemon_thread(tmp_path):
    """A ``ParquetSink`` with its defaults: a 256 MiB queue (256 * 2**20 bytes) that blocks when full, every
    counter 0 and no error yet; its writing runs on one daemon thread named "triage-monitor-writer" (what a thread
    dump shows; a sink never closed does not keep the interpreter from exiting), gone after close.  Any other
    backpressure is refused naming the value (message typed out here)."""
    import threading

    from triage_monitor.rundir.sink import ParquetSink

    def writers():
        return [t for t in threading.enumerate() if t.name == "triage-monitor-writer"]

    before = len(writers())
    sink = ParquetSink(tmp_path / "run", 3)
    try:
        assert (sink.max_queue_bytes, sink.backpressure, sink.attempt) == (256 * 2 ** 20, "block", 3)
        assert (sink.written_steps, sink.written_rows, sink.dropped_rows, sink.last_error) == (0, 0, 0, None)
        assert sink.closed is False
        assert sink.submit("steps", 4, 0, {"x": np.arange(3)})
        mine = [t for t in writers() if t is sink._thread]
        assert len(writers()) == before + 1 and mine and mine[0].daemon
    finally:
        sink.close()
    assert (sink.written_steps, sink.written_rows, sink.dropped_rows) == (1, 3, 0)
    assert len(writers()) == before and not sink._thread.is_alive() and sink.closed is True
    with pytest.raises(ValueError) as err:
        ParquetSink(tmp_path / "other", 1, backpressure="wait")
    assert str(err.value) == "backpressure must be 'block' or 'drop', got 'wait'"


def test_drop_policy_surfaces_in_monitor_metrics(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    mon = MismatchMonitor(tmp_path / "run", MonitorConfig(max_queue_bytes=1, backpressure="drop"))
    ms = [mon.log_step(s, batch(s)) for s in range(6)]
    mon.close()
    assert mon.sink.dropped_rows > 0 and ms[-1]["writer_dropped_rows"] > 0
    assert len([r for r in caplog.records if "dropped" in r.getMessage() and r.name == "triage_monitor"
                and r.levelno == logging.WARNING]) == 1                      # close() adds its one ERROR line
    assert len([r for r in caplog.records if "records_dropped" in r.getMessage()]) == 1     # the default rule, once



@pytest.mark.parametrize("mode", ["block", "drop"])
def test_a_slow_disk_blocks_training_or_drops_rows_visibly(tmp_path, caplog, held_file, mode):
    """A disk slower than training (the writer thread held on a file until released), each backpressure mode at
    the monitor: ``block`` holds ``log_step`` until the writer makes room, drops nothing and every step's row is in
    the steps table; ``drop`` returns at once, loses step 0's files, and says so three ways: ``writer_dropped_rows``
    in the next steps rows on disk, one WARNING line and the ``records_dropped`` alert."""
    import threading

    release = threading.Event()
    d = tmp_path / "run"
    caplog.set_level(logging.WARNING)
    bound = 8 << 20                                     # a step's files are ~0.2 MiB: they fit once the queue is empty
    mon = MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0, max_queue_bytes=bound, backpressure=mode))
    mon.sink.submit("alerts", 0, 0, held_file(release, nbytes=bound))    # the disk is busy with a full queue's file
    out = {}
    training = threading.Thread(target=lambda: out.setdefault(0, mon.log_step(0, batch(0))))
    training.start()
    if mode == "block":
        while mon.sink.blocked_submits == 0:            # the condition: log_step is waiting for room
            assert training.is_alive(), "log_step returned while the writer had no room: nothing blocked"
            time.sleep(0.01)
        assert training.is_alive()
        release.set()
        training.join()
    else:
        training.join()                                 # returns without the writer (no release yet)
        release.set()
        mon.flush()                                     # the slow file written: room again
    for s in (1, 2, 3):
        out[s] = mon.log_step(s, batch(s))
    mon.close()
    steps = open_run(d).steps().set_index("step")
    if mode == "block":
        assert mon.sink.dropped_rows == 0 and sorted(steps.index) == [0, 1, 2, 3]
        assert (steps["writer_dropped_rows"] == 0).all()
        assert not [r for r in caplog.records if "dropped" in r.getMessage()]
    else:
        lost = batch(0).num_tokens + 1                  # step 0's token rows and its steps row
        assert sorted(steps.index) == [1, 2, 3] and mon.sink.dropped_rows == lost
        assert steps.loc[1, "writer_dropped_rows"] == lost and out[1]["writer_dropped_rows"] == lost
        assert len([r for r in caplog.records if r.name == "triage_monitor" and "dropped" in r.getMessage()
                    and r.levelno == logging.WARNING]) == 1
        assert [r.getMessage().split(":")[1].strip() for r in caplog.records
                if r.name == "triage_monitor.alerts"] == ["records_dropped"]


# ============================================================================== resume
def _state_roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)           # no arbitrary unpickling needed


def test_monitor_state_dict_resume_keeps_tau_and_metrics(tmp_path):
    cfg = MonitorConfig(window=1, calibration_steps=4)
    with MismatchMonitor(tmp_path / "a", cfg) as mon:
        straight = [mon.log_step(s, batch(s)) for s in range(7)]
    with MismatchMonitor(tmp_path / "b", cfg) as mon:     # crashes after step 1, mid-calibration
        for s in range(2):
            mon.log_step(s, batch(s))
        state = _state_roundtrip(mon.state_dict())
    assert len(state["tracker"]["calib"]) == 2
    with MismatchMonitor(tmp_path / "b", cfg) as mon:
        mon.load_state_dict(state)
        resumed = [mon.log_step(s, batch(s)) for s in range(2, 7)]
    for a, b in zip(straight[2:], resumed):
        assert a["tau_tail"] == b["tau_tail"] and a["c_tok"] == b["c_tok"] and a["r_amp"] == b["r_amp"]
    # without the state, re-calibrating on post-resume steps gives another tau
    with MismatchMonitor(tmp_path / "c", cfg) as mon:
        fresh = [mon.log_step(s, batch(s)) for s in range(2, 7)]
    assert fresh[-1]["tau_tail"] != straight[-1]["tau_tail"]
    with pytest.raises(ValueError, match="state version"):
        mon.load_state_dict({"version": 99})


def test_resume_from_manifest_keeps_frozen_tau(tmp_path):
    cfg = MonitorConfig(window=2, calibration_steps=2)
    mon = MismatchMonitor(tmp_path / "run", cfg)
    first = [mon.log_step(s, batch(s)) for s in range(4)]
    mon.flush()                                         # killed here: no close()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["calibration"]["frozen_at_step"] == 2   # frozen when the first step after the 2-step reference window arrives
    with MismatchMonitor(tmp_path / "run", cfg) as again:
        assert again.tracker.tau_frozen and again.tracker.tau_tail == first[1]["tau_tail"]
        m = again.log_step(2, batch(2, seed=5))
    assert m["tau_tail"] == first[3]["tau_tail"]


def test_analysis_uses_latest_attempt_per_step(tmp_path):
    d = tmp_path / "run"
    with MismatchMonitor(d) as mon:
        for s in range(6):
            mon.log_step(s, batch(s))
    with MismatchMonitor(d) as mon:                     # resumed from the step-2 checkpoint, died after step 4
        redo = {s: mon.log_step(s, batch(s, B=4, seed=9)) for s in (3, 4)}
    run = open_run(d)
    attempts = [a["attempt"] for a in run.manifest.attempts]
    assert len(attempts) == 2 and attempts[1] > attempts[0]
    steps = run.steps().set_index("step")
    for s in range(6):
        want_attempt = attempts[1] if s in redo else attempts[0]
        assert steps.loc[s, "attempt"] == want_attempt
        assert set(run.tokens(s)["attempt"]) == {want_attempt}
    assert [len(run.tokens(s)) for s in (3, 4)] == [redo[3]["n_tokens"], redo[4]["n_tokens"]]
    rec = recompute(run).set_index("step")
    assert rec.loc[3, "n_tokens"] == redo[3]["n_tokens"]


def _tiny_training(steps, ckpt_at=None, state=None, load_controller=True):
    """A tiny policy trained with TRIAGE weights + Repair (calibrated Gate), SGD; returns (params, checkpoint)."""
    from triage_monitor.triage.controller import CalibrationConfig, TriageConfig, TriageController
    from triage_monitor.triage.loss import weighted_policy_loss

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ctrl = TriageController(TriageConfig(gate_width=8, repair_width=16,
                                         calibration=CalibrationConfig(window=3, neg_quantile=0.3,
                                                                       severe_quantile=0.1, bad_quantile=0.05)))
    start, ckpt = 0, None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        if load_controller:
            ctrl.load_state_dict(state["ctrl"])
        start = state["step"] + 1
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(6, 32, 8, generator=g)
        tok = torch.randint(0, 16, (6, 32), generator=g)
        lp = torch.log_softmax(model(x), -1).gather(-1, tok[..., None]).squeeze(-1)
        samp = (lp.detach() - torch.rand(6, 32, generator=g) * 2.0).clamp(max=0)
        b = TokenBatch.from_padded(lp, samp, torch.randn(6, generator=g), torch.ones(6, 32, dtype=torch.bool))
        out = ctrl(b, step=step)
        loss = weighted_policy_loss(-b.advantage * b.learner_logp, out.token_weights, b) + out.repair_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == ckpt_at:
            ckpt = _state_roundtrip({"model": model.state_dict(), "opt": opt.state_dict(),
                                     "ctrl": ctrl.state_dict(), "step": step})
    return [p.detach().clone() for p in model.parameters()], ckpt


def test_controller_state_dict_resume_gives_identical_weights():
    straight, _ = _tiny_training(8)
    _, ckpt = _tiny_training(8, ckpt_at=1)             # checkpoint in the middle of the calibration window
    resumed, _ = _tiny_training(8, state=ckpt)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    forgot, _ = _tiny_training(8, state=ckpt, load_controller=False)
    assert not all(torch.equal(a, b) for a, b in zip(straight, forgot))


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "train":
        child_train(Path(args[0]))
    elif mode == "fsize":
        child_fsize(Path(args[0]), int(args[1]))
    elif mode == "rss":
        child_rss(Path(args[0]), args[1], float(args[2]), float(args[3]), int(args[4]))
    elif mode == "noflock-hold":
        child_noflock_hold(Path(args[0]))
    elif mode == "noflock-start":
        child_noflock_start(Path(args[0]))
    elif mode == "fsize-resume":
        child_fsize_resume(Path(args[0]), int(args[1]))
