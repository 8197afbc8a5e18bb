"""The run directory as a unit of storage: readers name what they cannot read, every table reads with plain
pandas / pyarrow / DuckDB / Polars, one run per directory, one writer per rank, unwritable outputs fail at start."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from runfiles import file_of
from triage_monitor.offline.analysis import open_run
from triage_monitor.batch import TokenBatch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig


def _batch(step, B=4, T=32):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 4
    lp = (s + torch.randn(B, T, generator=g) * .1).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool),
                                  sample_ids=torch.arange(B) + 100 * step)


def _write(d, steps=5, roll_steps=50, **kw):
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2, roll_steps=roll_steps), **kw) as mon:
        return [mon.log_step(s, _batch(s)) for s in range(steps)]


# ============================================================================ corrupt files are named
def test_truncated_parquet_files_are_counted_named_and_logged(tmp_path, caplog):
    d = tmp_path / "run"
    _write(d, roll_steps=1)                                   # a file per step: one step's files are damaged
    bad_step, bad_tok = file_of(d, "steps", 3), file_of(d, "tokens", 2)
    for f in (bad_step, bad_tok):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])                # a truncated file, as a killed copy leaves it
    run = open_run(d)
    assert run.unreadable == []
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        steps = run.steps()
        assert steps["step"].tolist() == [0, 1, 2, 4]        # step 3 left out, and said so
        with pytest.raises(KeyError, match="unreadable"):
            run.tokens(2)
        assert len(run.tokens(1)) == 4 * 32
        run.steps()                                           # read again: named once
    assert [p for p, _ in run.unreadable] == [str(bad_step), str(bad_tok)]
    assert all(reason for _, reason in run.unreadable)
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 2 and str(bad_step) in warned[0] and str(bad_tok) in warned[1]


# ============================================================================ four plain readers
def _run_with_every_table(d):
    """Two ranks, steps 0-11 (step 2 quarantines a NaN token, an alert fires at steps >= 9), then a resumed
    attempt that redoes steps 10-11 on rank 0 alone."""
    from triage_monitor.alerting.alerts import AlertEngine
    from triage_monitor.alerting.alert_rules import Rule

    def batch(step, rank):
        b = _batch(10 * step + rank)
        if step == 2:
            lp = b.learner_logp.clone()
            lp[0] = float("nan")
            return TokenBatch.from_flat(lp, b.sampler_logp, b.advantage, b.sample_id[b.sample_index], b.position,
                                        on_invalid="quarantine")
        return b

    cfg = MonitorConfig(window=2, calibration_steps=2)
    rule = Rule(name="late", metric="reward", condition="above", threshold=8.5, level="WARN")
    for rank in (0, 1):
        with MismatchMonitor(d, cfg, rank=rank, attempt=1, alerts=AlertEngine([rule], sinks=[])) as mon:
            for s in range(12):
                mon.log_step(s, batch(s, rank), extra={"reward": float(s)})
    with MismatchMonitor(d, cfg, rank=0, attempt=2, alerts=AlertEngine([rule], sinks=[])) as mon:
        for s in (10, 11):
            mon.log_step(s, batch(s, 0), extra={"reward": float(s) - 5})     # no alert any more


@pytest.mark.no_fork
def test_every_table_reads_with_pandas_pyarrow_duckdb_and_polars(tmp_path):
    import duckdb
    import numpy as np
    import pandas as pd
    import polars as pl
    import pyarrow.dataset as ds

    d = tmp_path / "run"
    _run_with_every_table(d)
    run = open_run(d)
    # what each table holds, worked out from the writes above: steps 0-11 on both ranks from attempt 1, steps
    # 10-11 of rank 0 from attempt 2 too (a plain reader keeps each step's latest attempt: below)
    expected_steps = sorted([(s, r, 1) for s in range(12) for r in (0, 1)] + [(s, 0, 2) for s in (10, 11)])
    expected = {
        "steps": expected_steps,
        "tokens": expected_steps,
        "quarantine": [(2, 0, 1), (2, 1, 1)],
        "alerts": [(9, 0, 1)],                      # the rule fires once when reward crosses 8.5, on rank 0 only
    }
    def n_rows(table, step):         # 4 × 32 tokens a step, one of step 2 quarantined; one row in the others
        return (4 * 32 - (step == 2)) if table == "tokens" else 1

    for table, keys in expected.items():
        path = d / table
        frames = {
            "pandas": pd.read_parquet(path),
            "pyarrow": ds.dataset(path, format="parquet").to_table().to_pandas(),
            "duckdb": duckdb.sql(f"SELECT * FROM read_parquet('{path}/*.parquet')").df(),
            "polars": pl.read_parquet(path).to_pandas(),
        }
        for reader, df in frames.items():
            where = f"{table} read by {reader}"
            for col in ("step", "rank", "attempt"):
                assert df[col].dtype == np.int64, (where, col, df[col].dtype)
            got = df.groupby(["step", "rank", "attempt"]).size()
            assert sorted(got.index) == keys, where
            assert got.tolist() == [n_rows(table, k[0]) for k in sorted(got.index)], where
            assert len(df.columns) == len(frames["pandas"].columns), where      # one schema per table
            assert (df.sort_values("step")["step"].diff().dropna() >= 0).all()  # numeric order, not 0, 1, 10, 11
            assert len(df[df.step > 9]) == sum(n_rows(table, k[0]) for k in keys if k[0] > 9), where
    steps = pd.read_parquet(d / "steps")
    assert steps["reward"].dtype == np.float64 and steps["alignment_suspect"].isna().sum() > 0
    latest = steps[steps.attempt == steps.groupby("step").attempt.transform("max")]    # the reader's rule
    live = run.steps(rank=None)
    assert sorted(zip(latest.step, latest["rank"])) == sorted(zip(live.step, live["rank"]))
    assert live.set_index(["step", "rank"]).loc[(10, 0), "reward"] == 5.0
    assert sorted(run.alerts()["step"]) == [9]


# ============================================================================ one writer per rank
HOLDER = """
import sys, time
from triage_monitor.monitor import MismatchMonitor
mon = MismatchMonitor(sys.argv[1], rank=int(sys.argv[2]), attempt=1)
print("ready", flush=True)
time.sleep(120)
"""


def _holder(d, rank=0):
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(d), str(rank)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip() == "ready", p.stderr.read()
    return p


@pytest.mark.multiprocess
def test_a_second_process_writing_the_same_rank_is_refused_at_start(tmp_path):
    import signal

    from triage_monitor.rundir.records import RunLockedError

    d = tmp_path / "run"
    p = _holder(d, rank=0)
    try:
        with pytest.raises(RunLockedError, match=f"rank 0 .*pid {p.pid}") as err:
            MismatchMonitor(d, rank=0)
        assert str(d) in str(err.value)
        with MismatchMonitor(d, rank=1, attempt=7) as mon:    # another rank of the same run: allowed
            mon.log_step(0, _batch(0))
        # the holder is killed (no close, no cleanup): the OS releases its lock, the next writer starts
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        assert p.returncode == -signal.SIGKILL
        with MismatchMonitor(d, rank=0) as mon:
            mon.log_step(0, _batch(0))
        assert open_run(d).steps()["step"].tolist() == [0]
    finally:
        p.kill()
        p.wait()


def test_a_monitor_left_open_in_this_process_is_taken_over(tmp_path, caplog):
    """A monitor never closed (a notebook cell run twice) does not block a new one of the same rank in the same
    process: the new one takes its lock with one warning naming the rank and the directory (text typed out here),
    and its steps are written."""
    d = tmp_path / "run"
    MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2)).log_step(0, _batch(0))   # never closed
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        _write(d, steps=2)
    assert [r.getMessage() for r in caplog.records if "was not closed" in r.getMessage()] == [
        f"triage-monitor: an earlier writer of rank 0 of {d} in this process was not closed; the new one takes over "
        "(close monitors, or use them in a with-block)"]
    assert open_run(d).step_numbers() == [0, 1]


LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, bytes.fromhex(sys.argv[2]))
fcntl.flock(fd, fcntl.LOCK_EX)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("text, holder", [
    (b"", "unknown process"),                                   # a holder that wrote nothing (yet)
    (b" \n\t\n", "unknown process"),                            # only white space
    (b"\xffpid 7 on h\xfe\n", "\ufffdpid 7 on h\ufffd"),        # bytes that are not UTF-8: one U+FFFD each
    (b"y" * 600, "y" * 512),                                    # a long text: its first 512 bytes
], ids=["empty", "blank", "not-utf8", "long"])
def test_a_lock_held_by_another_process_is_refused_quoting_its_text(tmp_path, text, holder):
    """A writer lock held by another process (any program: here a bare ``flock`` holder whose lock file holds
    ``text``) refuses the writer of that rank at start with ``RunLockedError`` whose ``.path`` is the run
    directory; the message (typed out here) quotes the lock file's first 512 bytes, decoded with U+FFFD for
    bytes that are not UTF-8 and stripped, or "unknown process" when nothing is left."""
    import subprocess
    import sys

    from triage_monitor.rundir.records import RunLockedError

    d = tmp_path / "run"
    d.mkdir()
    p = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(d / ".writer-rank-12.lock"), text.hex()],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        with pytest.raises(RunLockedError) as err:
            MismatchMonitor(d, MonitorConfig(window=2), rank=12, attempt=7)
        assert str(err.value) == (
            f"{d}: another process is writing this run's rank 12 ({holder}); one writer per rank: stop it, or "
            "write to another directory (a killed writer's lock is released by the OS)")
        assert err.value.path == d
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    assert p.returncode == 0, p.stderr.read()


def test_a_writers_lock_file_names_it_and_is_readable_by_all(tmp_path):
    """While a monitor writes, ``.writer-rank-<R>.lock`` holds one line "pid <pid> on <host>, attempt <n>, since
    <local time, ISO 8601 with UTC offset>" (what a refused second writer quotes) and, under umask 022, is
    rw-r--r-- like any file the process creates (anyone can read who holds it; it is not executable).  Expected
    values: this process's pid and host name, the time parsed back with ``datetime.fromisoformat`` and within
    a minute of now."""
    import os
    import re
    import socket
    import stat
    from datetime import datetime, timezone

    d = tmp_path / "run"
    umask = os.umask(0o022)
    try:
        with MismatchMonitor(d, MonitorConfig(window=2), rank=3, attempt=7):
            lock = d / ".writer-rank-3.lock"
            text, mode = lock.read_text(), stat.S_IMODE(lock.stat().st_mode)
    finally:
        os.umask(umask)
    assert mode == 0o644
    m = re.fullmatch(r"pid (\d+) on (.+), attempt 7, since (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4})\n", text)
    assert m, text
    assert int(m[1]) == os.getpid() and m[2] == socket.gethostname()
    since = datetime.fromisoformat(m[3])
    assert abs((datetime.now(timezone.utc) - since).total_seconds()) < 60


def _lock_is_free(d, rank=0):
    """True when a new open file of ``d/.writer-rank-<rank>.lock`` gets ``flock(LOCK_EX | LOCK_NB)`` (released at
    once): the OS's own answer to whether a writer holds the rank."""
    import fcntl
    import os

    fd = os.open(d / f".writer-rank-{rank}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_force_locks_the_new_run_and_a_refused_start_leaves_no_lock(tmp_path, caplog):
    """A writer that moved a run aside (``force``, rank 0) holds the lock of the new run while it writes (the OS
    refuses a second flock; the lock file names this process and attempt), and a start refused for another
    configuration releases the lock it took: the next writer starts without a take-over warning."""
    import os

    from triage_monitor.rundir.records import RunConflictError

    d = tmp_path / "run"
    cfg = MonitorConfig(window=2, calibration_steps=2)
    _write(d, steps=1, manifest={"model": "a"})
    with MismatchMonitor(d, cfg, manifest={"model": "b"}, force=True, attempt=9):
        assert not _lock_is_free(d)
        assert (d / ".writer-rank-0.lock").read_text().startswith(f"pid {os.getpid()} on ")
        assert ", attempt 9, since " in (d / ".writer-rank-0.lock").read_text()
    assert _lock_is_free(d)
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        with pytest.raises(RunConflictError):
            MismatchMonitor(d, cfg, manifest={"model": "c"})
        assert _lock_is_free(d)
        _write(d, steps=1, manifest={"model": "b"})
    assert [r.getMessage() for r in caplog.records if "was not closed" in r.getMessage()] == []


def test_force_on_a_rank_other_than_0_neither_checks_nor_moves_the_run(tmp_path):
    """Only rank 0 acts on ``force``: a rank-1 writer started with ``force`` next to a run of another model is not
    refused (rank 0 decides) and moves nothing: the directory and its run.json stay as they were."""
    d = tmp_path / "run"
    _write(d, steps=2, manifest={"model": "a"})
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), rank=1, attempt=7, force=True,
                         manifest={"model": "b"}) as mon:
        mon.log_step(0, _batch(0))
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    assert open_run(d).manifest.info["model"] == "a" and len(open_run(d).manifest.attempts) == 1


def test_a_run_writer_by_default_blocks_and_neither_resumes_nor_forces(tmp_path):
    """``RunWriter`` built with its defaults: a queue of 256 MiB that blocks when full, and an existing run of
    another model is refused (no resume), left where it is (no force)."""
    from triage_monitor.rundir.records import RunConflictError, RunWriter

    d = tmp_path / "run"
    cfg, versions = MonitorConfig(window=2).to_dict(), {"tool_version": "0", "torch": "0"}
    w = RunWriter(d, 1, 0, 1, cfg, {"model": "a"}, versions)
    assert w.sink.backpressure == "block" and w.sink.max_queue_bytes == 256 * 1024 * 1024
    w.close("finished", 0)
    with pytest.raises(RunConflictError):
        RunWriter(d, 2, 0, 1, cfg, {"model": "b"}, versions)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_an_attempt_records_its_start_host_pid_and_world_size(tmp_path):
    """run.json's attempt entry says when (local time, ISO 8601 with UTC offset; the run's ``created`` for its first
    attempt), where (host, pid) and how wide (world size) the attempt ran; the run records the Python, torch and
    tool versions that created it, and a continued run is "running" again while its new attempt writes.
    Expected: this process's host name, pid and versions, one process, the time parsed back with
    ``datetime.fromisoformat`` within a minute of now."""
    import json
    import os
    import platform
    import re
    import socket
    from datetime import datetime, timezone

    import triage_monitor

    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2), attempt=7):
        pass
    m = json.loads((d / "run.json").read_text())
    assert (m["status"], m["python"], m["torch"], m["tool_version"]) == (
        "finished", platform.python_version(), torch.__version__, triage_monitor.__version__)
    with MismatchMonitor(d, MonitorConfig(window=2), attempt=8):
        assert json.loads((d / "run.json").read_text())["status"] == "running"
    (a,) = m["attempts"]
    assert {k: a.get(k) for k in ("attempt", "host", "pid", "world_size")} == {
        "attempt": 7, "host": socket.gethostname(), "pid": os.getpid(), "world_size": 1}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", a["started"]), a["started"]
    assert abs((datetime.now(timezone.utc) - datetime.fromisoformat(a["started"])).total_seconds()) < 60
    assert m["created"] == a["started"]


def test_the_atomic_writers_create_parents_and_leave_only_their_file(tmp_path):
    """``Store.write_bytes`` (run.json) and ``blocks.write_parquet`` (a whole Parquet file) create missing parent
    directories and leave only the file they wrote (no temporary file).  run.json is standard JSON (NaN and inf as
    null, by hand: {"x": NaN, "y": [1.5, inf]} reads back as {"x": None, "y": [1.5, None]}), indented by two
    spaces (the text typed out here)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from triage_monitor.rundir.blocks import write_parquet
    from triage_monitor.rundir.manifest import json_text
    from triage_monitor.rundir.storage import open_store

    path = tmp_path / "a" / "b" / "c.json"
    open_store(tmp_path).write_bytes("a/b/c.json", json_text({"x": float("nan"), "y": (1.5, float("inf"))}).encode())
    assert json.loads(path.read_text()) == {"x": None, "y": [1.5, None]}
    assert path.read_text() == '{\n  "x": null,\n  "y": [\n    1.5,\n    null\n  ]\n}'     # indented by 2: diffable
    assert [p.name for p in path.parent.iterdir()] == ["c.json"]
    table = tmp_path / "d" / "e" / "t.parquet"
    write_parquet(open_store(tmp_path / "d"), "e/t.parquet", pa.table({"x": [1, 2]}))
    assert pq.read_table(table).to_pydict() == {"x": [1, 2]}
    assert [p.name for p in table.parent.iterdir()] == ["t.parquet"]


# ============================================================================ one run per directory
def test_another_configuration_is_refused_naming_the_keys_and_the_way_out(tmp_path):
    from triage_monitor.rundir.records import RunConflictError

    d = tmp_path / "run"
    _write(d, steps=3, manifest={"correction": "triage", "seed": 1})
    before = sorted(p.name for p in (d / "steps").iterdir())
    with pytest.raises(RunConflictError) as err:               # what was trained differs
        _write(d, steps=1, manifest={"correction": "none", "seed": 5})
    msg = str(err.value)
    assert "correction: 'triage' -> 'none'" in msg and "seed: 1 -> 5" in msg
    assert "--resume" in msg and "--force" in msg and "new directory" in msg
    assert err.value.differences == {"correction": ("triage", "none"), "seed": (1, 5)}
    assert err.value.path == d
    with pytest.raises(RunConflictError, match=r"monitor_config.window: 2 -> 3") as err:   # how it is measured
        with MismatchMonitor(d, MonitorConfig(window=3, calibration_steps=2),
                             manifest={"correction": "triage", "seed": 1}):
            pass
    assert "--resume" not in str(err.value)                # a metric configuration cannot be resumed into
    assert sorted(p.name for p in (d / "steps").iterdir()) == before     # nothing written by the refused ones
    assert len(open_run(d).manifest.attempts) == 1


def test_same_configuration_continues_as_a_new_attempt_and_resume_records_changes(tmp_path):
    d = tmp_path / "run"
    _write(d, steps=4, manifest={"correction": "triage", "seed": 1, "note": "free text"})
    _write(d, steps=2, manifest={"correction": "triage", "seed": 1, "note": "other text"})   # not an identity key
    _write(d, steps=2, manifest={"correction": "none", "seed": 1}, resume=True)
    run = open_run(d)
    assert [a.get("changed") for a in run.manifest.attempts] == [None, None, {"correction": ["triage", "none"]}]
    assert run.steps()["step"].tolist() == [0, 1, 2, 3]
    assert run.steps()["attempt"].nunique() == 2            # steps 0-1 of the last attempt, 2-3 of the first


def test_force_moves_the_old_run_aside_and_starts_a_new_one(tmp_path):
    d = tmp_path / "run"
    _write(d, steps=6, manifest={"correction": "triage"})
    _write(d, steps=3, manifest={"correction": "none"}, force=True)
    run = open_run(d)
    assert run.steps()["step"].tolist() == [0, 1, 2] and len(run.manifest.attempts) == 1
    assert run.manifest.info["correction"] == "none"
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1
    old = open_run(aside[0])
    assert old.steps()["step"].tolist() == list(range(6)) and old.manifest.info["correction"] == "triage"


def test_unwritable_output_names_the_path_and_reason(tmp_path):
    """An output directory is created with its missing parents, and the probe leaves nothing in it.  An output that
    cannot be written is refused naming the directory and the OS reason, and, when the file that
    failed is another one (the probe file in an existing directory), that file too.  Cases: a directory under a
    regular file (mkdir of the directory itself fails: Not a directory) and /sys, an existing directory where the
    kernel refuses new files even to root (the reason is taken from creating a file there directly, so it holds
    where /sys is mounted read-only too).  Messages typed out here."""
    import re

    from triage_monitor.rundir.records import OutputError, UnwritableOutputError, probe_writable

    nested = tmp_path / "runs" / "exp" / "seed0"
    assert probe_writable(str(nested)).local() == nested and nested.is_dir() and list(nested.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(UnwritableOutputError) as err:
        probe_writable(tmp_path / "file" / "out")
    assert str(err.value) == f"{tmp_path / 'file' / 'out'}: cannot write the output directory: Not a directory"
    assert err.value.path == tmp_path / "file" / "out"
    assert issubclass(UnwritableOutputError, OutputError)

    with pytest.raises(OSError) as direct:
        open("/sys/not-creatable", "xb")
    with pytest.raises(UnwritableOutputError) as err:
        probe_writable("/sys")
    assert re.fullmatch(rf"/sys: cannot write the output directory: {re.escape(direct.value.strerror)} "
                        r"\(/sys/\.tmp-probe-[0-9a-f]{32}\)", str(err.value)), str(err.value)


# ============================================================================ the commands that write a run
def _token_table(path, steps=3, shift=0.0):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(int(shift * 10))
    n = 4 * 16
    df = pd.DataFrame({"step": np.repeat(np.arange(steps), n), "sample_id": np.tile(np.repeat(np.arange(4), 16), steps),
                       "position": np.tile(np.arange(16), 4 * steps),
                       "sampler_logp": -rng.random(n * steps), "advantage": np.ones(n * steps)})
    df["learner_logp"] = (df["sampler_logp"] + shift).clip(upper=0)
    df.to_parquet(path)
    return path


def test_import_into_a_run_of_another_source_is_refused_then_forced(tmp_path, capsys):
    from triage_monitor.cli import main

    a, b, out = _token_table(tmp_path / "a.parquet"), _token_table(tmp_path / "b.parquet", 2, 0.1), tmp_path / "run"
    assert main(["import", "table", str(a), "--out", str(out)]) == 0
    assert main(["import", "table", str(b), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"imported_from: '{a}' -> '{b}'" in err and "--force" in err
    assert open_run(out).steps()["step"].tolist() == [0, 1, 2]           # untouched
    assert main(["import", "table", str(a), "--out", str(out)]) == 0     # the same import again: a new attempt
    assert len(open_run(out).manifest.attempts) == 2
    assert main(["import", "table", str(b), "--out", str(out), "--force"]) == 0
    assert open_run(out).steps()["step"].tolist() == [0, 1]
    assert len(list(tmp_path.glob("run.replaced-*"))) == 1


def test_import_into_a_read_only_directory_fails_at_start_naming_path_and_reason(tmp_path, capsys):
    from triage_monitor.cli import main

    src = _token_table(tmp_path / "a.parquet")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # an unwritable output is an I/O error: exit 3 (docs/cli.md#exit-statuses)
    assert main(["import", "table", str(src), "--out", str(blocker / "run")]) == 3
    out = capsys.readouterr()
    assert f"{blocker / 'run'}: cannot write the output directory: Not a directory" in out.err
    assert "imported" not in out.out


@pytest.mark.multiprocess
def test_demo_into_a_run_of_another_correction_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import triage_monitor.demo.grpo as grpo
    from triage_monitor.cli import main

    out = tmp_path / "demo"
    small = ["--steps", "3", "--sft-steps", "5", "--prompts-per-step", "2", "--group-size", "4", "--eval-size", "4",
             "--calibration-steps", "2", "--window", "2"]
    assert main(["demo", "--out", str(out), *small]) == 0
    capsys.readouterr()

    def no_training(*args, **kwargs):
        raise AssertionError("the SFT warm start ran although --out holds another run")

    monkeypatch.setattr(grpo, "sft_warm_start", no_training)     # refused before any training work
    assert main(["demo", "--out", str(out), *small, "--correction", "none", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "correction: 'triage' -> 'none'" in err and "demo_config.seed: 0 -> 5" in err and "--resume" in err
    run = open_run(out)
    assert run.manifest.info["correction"] == "triage" and run.steps()["step"].tolist() == [0, 1, 2]


def test_a_hook_into_a_run_of_another_framework_is_refused_when_its_monitor_starts(tmp_path):
    from triage_monitor.hooks.worker_runtime import HookSettings, WorkerRuntime
    from triage_monitor.rundir.records import RunConflictError

    d = tmp_path / "run"
    _write(d, steps=2, manifest={"framework": "trl"})
    cfg = MonitorConfig(window=2, calibration_steps=2)
    with pytest.raises(RunConflictError, match="framework: 'trl' -> 'verl'"):
        WorkerRuntime(HookSettings(run_dir=str(d), monitor=cfg, manifest={"framework": "verl"}, rank=0)).monitor
    rt = WorkerRuntime(HookSettings(run_dir=str(d), monitor=cfg, manifest={"framework": "verl"}, rank=0, resume=True))
    assert rt.monitor is not None
    rt.close()
    assert open_run(d).manifest.attempts[-1]["changed"] == {"framework": ["trl", "verl"]}


# ---------------------------------------------------------------- locations given as URIs
@pytest.mark.parametrize("location, scheme", [("gs://bucket/a/b", "gs"), ("hdfs://namenode:8020/runs/x", "hdfs"),
                                              ("GS://Bucket/run", "gs"), ("az+blob://c/run", "az+blob")])
def test_a_run_directory_given_as_an_unsupported_uri_is_refused_naming_the_scheme(tmp_path, monkeypatch, location,
                                                                                   scheme):
    """A scheme other than s3 and file (``MismatchMonitor("gs://bucket/run")``) is never a local folder
    ``gs:/bucket/run``: every way in (the monitor, a hook's settings, ``open_run``, the layout, the path as ``Path``
    collapses it) refuses it with an ``UnsupportedLocationError`` (a ValueError) naming the location and the
    scheme; nothing is created."""
    from pathlib import Path

    from hooks.worker_runtime import HookSettings
    from triage_monitor.offline.analysis import RunDirError
    from triage_monitor.errors import UnsupportedLocationError
    from triage_monitor.rundir.layout import RunLayout

    monkeypatch.chdir(tmp_path)
    for make in (lambda: MismatchMonitor(location), lambda: HookSettings(run_dir=location),
                 lambda: RunLayout(location), lambda: RunLayout(Path(location))):
        with pytest.raises(UnsupportedLocationError) as err:
            make()
        assert err.value.scheme == scheme and isinstance(err.value, ValueError)
        given = location if "://" in location else location
        assert str(err.value).startswith(f"run directory {given!r}: the {scheme!r} scheme is not supported; it must "
                                         "be a local path, a file:// URI, or an s3:// URI"), str(err.value)
    with pytest.raises(RunDirError, match=re.escape(f"the '{scheme}' scheme is not supported")):
        open_run(location)
    assert list(tmp_path.iterdir()) == []


def test_file_uris_and_plain_paths_are_local(tmp_path):
    """``file:///abs/run`` is the local path /abs/run (also as ``Path`` collapses it); a plain relative or absolute
    path is unchanged, a Windows-style drive letter (one letter and a colon) is not a scheme."""
    from pathlib import Path

    from triage_monitor.rundir.layout import run_path

    assert run_path(f"file://{tmp_path}/run") == tmp_path / "run"
    assert run_path(Path(f"file://{tmp_path}/run")) == tmp_path / "run"
    assert run_path("runs/exp1") == Path("runs/exp1") and run_path(tmp_path) == tmp_path
    assert run_path("C:/runs/x") == Path("C:/runs/x")
    with MismatchMonitor(f"file://{tmp_path}/run") as mon:
        mon.log_step(0, TokenBatch.from_flat(torch.tensor([-0.5]), torch.tensor([-0.7]), torch.ones(1),
                                             torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)))
    assert open_run(f"file://{tmp_path}/run").step_numbers() == [0]


@pytest.mark.parametrize("argv, scheme", [
    (["analyze", "gs://b/run"], "gs"), (["alerts", "gs://b/run"], "gs"), (["report", "gs://b/run", "-o", "x.html"], "gs"),
    (["dashboard", "gs://b/run"], "gs"), (["import", "table", "t.jsonl", "--out", "gs://b/run"], "gs"),
    (["analyze", "run", "--out", "s3://b/t.csv"], "s3"), (["report", "run", "-o", "s3://b/x.html"], "s3"),
    (["demo", "--out", "s3://b/run", "--steps", "2", "--sft-steps", "1"], "s3"),
    (["study", "--out", "s3://b/run", "--arms", "none", "--seeds", "1"], "s3")])
def test_every_command_refuses_an_unsupported_uri_with_exit_2_and_one_line(tmp_path, monkeypatch, capsys, argv,
                                                                           scheme):
    """A run read or written at a location of an unsupported scheme, and an output that must be local (a table,
    a report, the demo's and the study's runs) given as s3://, are refused: exit 2, one line naming the scheme,
    nothing created.  (s3:// runs: tests/test_object_store.py.)"""
    from triage_monitor.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text('{"step": 0, "sample_id": 0, "learner_logp": -0.5, "sampler_logp": -0.6, '
                                      '"advantage": 1.0}\n')
    with MismatchMonitor(tmp_path / "run", MonitorConfig(tau_tail=-1.0)) as mon:      # a real run to read
        mon.log_step(0, TokenBatch.from_flat(torch.tensor([-0.5]), torch.tensor([-0.7]), torch.ones(1),
                                             torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)))
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and f"the {scheme!r} scheme is not supported" in errors[0], err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before     # nothing created
