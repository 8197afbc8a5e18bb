"""Runs on an S3-compatible object store: a real S3 server (moto's server mode, from the package registry) started
on 127.0.0.1 by these tests and stopped after them; the real pyarrow S3 client talks to it over HTTP, no mocked
client.  The monitor writes ``s3://bucket/run`` (credentials and endpoint from the usual AWS variables, or the
URI's query), every command reads it, a hook writes to it, a killed writer's pending objects are read and sealed,
the lease keeps a second writer of a rank out, and what cannot work on a store (moving a run aside, claiming a
rank) is refused naming it."""

from __future__ import annotations

import json
import os

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

moto_server = pytest.importorskip("moto.server", reason="moto[server] is in the test extra")

from triage_monitor.offline.analysis import compare_live, open_run, recompute  # noqa: E402
from triage_monitor.batch import TokenBatch  # noqa: E402
from triage_monitor.cli import main  # noqa: E402
from triage_monitor.monitor import MismatchMonitor, MonitorConfig  # noqa: E402
from triage_monitor.rundir.storage import open_store  # noqa: E402


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free port of 127.0.0.1 for the module, with the AWS variables a user sets
    (``AWS_ENDPOINT_URL`` included: no option of ours to learn).  Yields ``(endpoint, make_bucket)``."""
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_ENDPOINT_URL", "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true")
    client = boto3.client("s3", endpoint_url=endpoint)
    made = []

    def bucket(name: str) -> str:
        if name not in made:
            client.create_bucket(Bucket=name)
            made.append(name)
        return name

    try:
        yield endpoint, bucket
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _batch(step, B=4, T=24):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.2).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool),
                                  sample_ids=torch.arange(B) + 10 * step)


def _keys(store, table):
    return sorted(e.name for e in store.listdir(table))


def test_a_monitor_writes_a_run_to_s3_that_reads_back_equal_to_a_local_one(s3, tmp_path):
    """The same steps written to ``s3://bucket/run`` and to a local directory: the store holds the manifest, one
    block per table (roll_steps 4: two sealed, one at close), no pending object left; every table, the live rows
    and the recomputed metrics read back equal to the local run's, and the live values are reproduced."""
    _, bucket = s3
    uri = f"s3://{bucket('runs')}/exp/a"
    cfg = MonitorConfig(window=3, calibration_steps=2, roll_steps=4)
    for where in (uri, tmp_path / "local"):
        with MismatchMonitor(where, cfg, attempt=5) as mon:
            for s in range(10):
                mon.log_step(s, _batch(s), extra={"reward": float(s)})
    store = open_store(uri)
    assert store.is_file("run.json") and json.loads(store.read_bytes("run.json"))["status"] == "finished"
    assert _keys(store, "tokens") == [f"steps-{a:08d}-{b:08d}-rank-0000-attempt-5-part-{p}.parquet"
                                      for p, (a, b) in enumerate([(0, 3), (4, 7), (8, 9)])]
    assert [n for n in _keys(store, "steps") if n.startswith(".")] == []
    remote, local = open_run(uri), open_run(tmp_path / "local")
    assert str(remote.path) == "s3://runs/exp/a" and remote.path.name == "a"
    pd.testing.assert_frame_equal(remote.steps().drop(columns="wall_time"), local.steps().drop(columns="wall_time"))
    pd.testing.assert_frame_equal(remote.tokens(6), local.tokens(6))
    rec = recompute(remote)
    pd.testing.assert_frame_equal(rec, recompute(local))
    assert compare_live(remote, rec)["equal"].all()
    with store.open_input("tokens/" + _keys(store, "tokens")[1]) as f:       # a plain Parquet object
        assert pq.read_table(f).column("step").to_pylist()[0] == 4


def test_every_command_reads_an_s3_run_and_import_writes_one(s3, tmp_path, capsys):
    """``analyze``, ``alerts``, ``report`` and the dashboard's launcher take the s3:// run as given; ``analyze``
    saves its table and its state cache in the run's store; ``import table --out s3://...`` writes a run there."""
    _, bucket = s3
    uri = f"s3://{bucket('cmds')}/run"
    with MismatchMonitor(uri, MonitorConfig(window=2, calibration_steps=2)) as mon:
        for s in range(4):
            mon.log_step(s, _batch(s))
    assert main(["analyze", uri]) == 0
    out = capsys.readouterr().out
    assert "s3://cmds/run/analysis/metrics.csv" in out.replace("\n", "")
    store = open_store(uri)
    assert "metrics.csv" in _keys(store, "analysis") and any(n.startswith("states-") for n in _keys(store, "analysis"))
    assert main(["alerts", uri, "--format", "json"]) in (0, 1)
    capsys.readouterr()
    assert main(["report", uri, "-o", str(tmp_path / "r.html"), "--draws", "9"]) == 0
    assert (tmp_path / "r.html").stat().st_size > 10_000
    from triage_monitor.dashboards.launch import validate_runs

    assert validate_runs([uri]) == [uri]
    from streamlit.testing.v1 import AppTest

    from triage_monitor.dashboards.launch import app_path

    os.environ["TRIAGE_MONITOR_RUNS"] = os.pathsep.join([uri, str(tmp_path / "missing")])
    try:
        at = AppTest.from_file(str(app_path()), default_timeout=300).run()
    finally:
        del os.environ["TRIAGE_MONITOR_RUNS"]
    assert not at.exception and len(at.get("plotly_chart")) >= 6               # the S3 run's page is drawn
    assert any("no such directory" in e.value for e in at.error)                # and the other named as missing
    rows = [{"step": s, "sample_id": i, "learner_logp": -0.5 - 0.01 * i, "sampler_logp": -0.6, "advantage": 1.0}
            for s in range(3) for i in range(5)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    target = f"s3://{bucket('cmds')}/imported"
    assert main(["import", "table", str(tmp_path / "t.jsonl"), "--out", target]) == 0
    assert f"imported 3 step(s) into {target}" in capsys.readouterr().out
    assert open_run(target).step_numbers() == [0, 1, 2] and len(open_run(target).tokens(1)) == 5


def test_the_uri_query_sets_the_endpoint_without_the_variable(s3, monkeypatch):
    endpoint, bucket = s3
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    host = endpoint.split("://", 1)[1]
    uri = f"s3://{bucket('query')}/run?endpoint_override={host}&scheme=http"
    with MismatchMonitor(uri, MonitorConfig(window=2, calibration_steps=2)) as mon:
        mon.log_step(0, _batch(0))
    run = open_run(uri)
    assert run.step_numbers() == [0] and str(run.path) == "s3://query/run"
    with pytest.raises(ValueError, match="unknown option 'color'"):
        open_store(f"s3://{bucket('query')}/run?color=red")


KILLED = """
import os, sys, torch
sys.path.insert(0, sys.argv[2])
from test_object_store import _batch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
mon = MismatchMonitor(sys.argv[1], MonitorConfig(window=2, calibration_steps=2), attempt=1)
for s in range(3):
    mon.log_step(s, _batch(s))
mon.flush()
os._exit(0)            # killed: no close, its open blocks are not sealed, its lease not removed
"""


@pytest.mark.multiprocess
def test_a_killed_writers_pending_objects_are_read_and_the_next_writer_seals_them(s3):
    """A writer process that ends without closing (killed) leaves each step of its open blocks as one pending
    object, and its lease: a reader reads every step; the next writer of the rank on this host (the dead
    process's lease: taken over at once) seals them into a block of the earlier attempt before it writes its own,
    and removes the pending objects."""
    import subprocess
    import sys
    from pathlib import Path

    _, bucket = s3
    uri = f"s3://{bucket('killed')}/run"
    r = subprocess.run([sys.executable, "-c", KILLED, uri, str(Path(__file__).parent)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    store = open_store(uri)
    assert len([n for n in _keys(store, "tokens") if n.startswith(".pending-")]) == 3
    assert store.exists(".writer-rank-0.lock")
    run = open_run(uri)
    assert run.step_numbers() == [0, 1, 2] and len(run.tokens(2)) == 4 * 24 and len(run.steps()) == 3
    with MismatchMonitor(uri, MonitorConfig(window=2, calibration_steps=2), attempt=2) as again:
        again.log_step(3, _batch(3))
    assert _keys(store, "tokens") == ["steps-00000000-00000002-rank-0000-attempt-1-part-0.parquet",
                                      "steps-00000003-00000003-rank-0000-attempt-2-part-0.parquet"]
    assert open_run(uri).step_numbers() == [0, 1, 2, 3]


def test_a_second_writer_of_a_rank_is_refused_while_the_lease_is_renewed(s3, monkeypatch, caplog):
    """The lease object of a live writer refuses a second writer of its rank, quoting it; one not renewed for
    LEASE_STALE_S (a killed writer's on another host) is taken over with a warning; close removes it.  ``force`` cannot move a run
    aside on a store and says so."""
    import logging
    import time

    from triage_monitor.rundir import locks
    from triage_monitor.errors import RunLockedError, UnwritableOutputError

    _, bucket = s3
    uri = f"s3://{bucket('lease')}/run"
    store = open_store(uri)
    first = MismatchMonitor(uri, MonitorConfig(window=2), attempt=11)
    assert store.read_bytes(".writer-rank-0.lock").decode().startswith(f"pid {os.getpid()} on ")
    with pytest.raises(RunLockedError, match=r"another process is writing this run's rank 0 \(pid \d+ on .*attempt 11"):
        MismatchMonitor(uri, MonitorConfig(window=2), attempt=12)
    line = store.read_bytes(".writer-rank-0.lock").decode()
    other_host = line.replace(" on ", " on another-host-", 1)          # not checkable from here: only its age
    store.write_bytes(".writer-rank-0.lock", other_host.encode())
    with pytest.raises(RunLockedError, match="another-host-"):
        MismatchMonitor(uri, MonitorConfig(window=2), attempt=12)
    stale = other_host.split(", renewed ")[0] + f", renewed {time.time() - locks.LEASE_STALE_S - 5:.3f}\n"
    first.writer._lock._stop.set()                                 # the first writer stops renewing (killed)
    store.write_bytes(".writer-rank-0.lock", stale.encode())
    caplog.set_level(logging.WARNING, logger="triage_monitor")
    with MismatchMonitor(uri, MonitorConfig(window=2), attempt=12) as second:
        assert "attempt 12," in store.read_bytes(".writer-rank-0.lock").decode()
        second.log_step(0, _batch(0))
    assert any("a stopped writer's lease, taken over" in r.getMessage() for r in caplog.records)
    assert not store.exists(".writer-rank-0.lock")                 # released at close
    with pytest.raises(UnwritableOutputError, match="cannot move a run aside on an object store"):
        MismatchMonitor(uri, MonitorConfig(window=2), force=True)
    first.close()


def test_a_missing_bucket_is_an_error_at_start_naming_it(s3):
    from triage_monitor.errors import UnwritableOutputError

    with pytest.raises(UnwritableOutputError, match=r"s3://no-such-bucket/run: cannot write the output directory"):
        MismatchMonitor("s3://no-such-bucket/run")


def test_a_hook_writes_its_run_to_s3_and_refuses_to_claim_a_rank_there(s3, monkeypatch):
    """A loss hook's ``run_dir`` may be an s3:// URI: its worker runtime builds the monitor there (rank from
    ``RANK``); a process with no rank at all is refused naming the ways to give one (ranks are claimed with an
    exclusive create, which a store lacks).  verl's job files (attempt, published step) live in the store too."""
    from triage_monitor.triage.controller import TriageConfig
    from triage_monitor.hooks import verl as verl_hook
    from triage_monitor.hooks.worker_runtime import HookSettings, WorkerRuntime

    _, bucket = s3
    uri = f"s3://{bucket('hooks')}/run"
    monkeypatch.setenv("RANK", "0")
    rt = WorkerRuntime(HookSettings(run_dir=uri, monitor=MonitorConfig(window=2, calibration_steps=1),
                                    triage=TriageConfig(gate_width=2, repair_width=2)))
    assert rt.monitor is not None and rt.monitor.run_dir == "s3://hooks/run"
    rt.monitor.log_step(0, _batch(0))
    rt.close()
    assert open_run(uri).step_numbers() == [0]
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="ranks cannot be claimed on an object store"):
        WorkerRuntime(HookSettings(run_dir=f"s3://{bucket('hooks')}/other")).monitor
    a = verl_hook.shared_attempt(uri, "job1")
    assert verl_hook.shared_attempt(uri, "job1") == a
    verl_hook.publish_step(uri, 7, "job1")
    assert verl_hook.read_step(uri, "job1") == 7


# ------------------------------------------------------------------ failure paths, on the local disk and on S3
# Each storage failure (a write that raises, a rename / commit that fails, a full store) against both backends: the
# local disk (a temporary file renamed into place) and the S3 server above (an upload under a temporary key, moved
# onto the target).  Either way the error reaches the caller, nothing partial appears under the target's name, no
# temporary file or object is left, and an earlier complete file keeps its content.
import errno  # noqa: E402

DATA = bytes(range(256)) * 64


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path):
    """``(store, kind)``: a fresh run location on the local disk or on the S3 server."""
    if request.param == "local":
        return open_store(tmp_path / "run"), "local"
    _, bucket = request.getfixturevalue("s3")
    return open_store(f"s3://{bucket('failures')}/{request.node.name.replace('[', '-').rstrip(']')}"), "s3"


def _names(store, rel=""):
    return sorted(e.name for e in store.listdir(rel))


class _Stream:
    """A writable stream that raises ENOSPC once ``room`` bytes have been written (a store that fills up)."""

    def __init__(self, real, room):
        self.real, self.room = real, room

    def write(self, b):
        if len(b) > self.room:
            self.real.write(bytes(b)[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self.real.write(b)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.real.close()


class _FailingFS:
    """The S3 file system with a failure injected: uploads that fill up after ``room`` bytes, or a failing move
    (the commit of the upload onto its target: the object store's rename)."""

    def __init__(self, fs, room=None, move_fails=False):
        self.fs, self.room, self.move_fails = fs, room, move_fails

    def open_output_stream(self, path, *a, **kw):
        out = self.fs.open_output_stream(path, *a, **kw)
        return out if self.room is None else _Stream(out, self.room)

    def move(self, src, dst):
        if self.move_fails:
            raise OSError(errno.EIO, "Input/output error")
        return self.fs.move(src, dst)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def _fill_up(monkeypatch, store, kind, room):
    """From now on every write to ``store`` fails with ENOSPC after ``room`` bytes."""
    if kind == "s3":
        monkeypatch.setattr(store, "fs", _FailingFS(store.fs, room=room))
        return
    from triage_monitor.rundir import storage

    def full_open(path, mode="r", *a, **kw):
        f = open(path, mode, *a, **kw)
        return _Stream(f, room) if "x" in mode or "w" in mode else f
    monkeypatch.setattr(storage, "open", full_open, raising=False)

    # the local pending files are written through pyarrow's own file (blocks.write_pending): that one fills up too
    import pyarrow as pa

    real_osfile = pa.OSFile

    def full_native(path, mode="r", *a, **kw):
        if "w" not in mode:
            return real_osfile(path, mode, *a, **kw)
        return pa.PythonFile(_Stream(open(path, "wb"), room), mode="w")
    monkeypatch.setattr(pa, "OSFile", full_native)


def _fail_rename(monkeypatch, store, kind):
    if kind == "s3":
        monkeypatch.setattr(store, "fs", _FailingFS(store.fs, move_fails=True))
        return

    def refuse(src, dst):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "replace", refuse)


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), ValueError("the encoder failed")],
                         ids=["oserror", "valueerror"])
def test_a_write_that_raises_leaves_nothing_and_keeps_the_earlier_file(backend, exc):
    """A write whose producer raises midway (an OSError, or any other exception: a pyarrow encoder's): the error
    reaches the caller, the new file does not appear, a rewritten file keeps its earlier content, no temporary
    file or object is left."""
    store, _ = backend
    store.write_bytes("run.json", b"old")
    with pytest.raises(type(exc)):
        with store.writing("steps/t.parquet") as out:
            out.write(DATA[: len(DATA) // 2])
            raise exc
    with pytest.raises(type(exc)):
        with store.writing("run.json") as out:
            out.write(b"new, half")
            raise exc
    assert store.read_bytes("run.json") == b"old"
    assert _names(store) == ["run.json"] and _names(store, "steps") == []


def test_a_rename_that_fails_keeps_the_earlier_file_and_leaves_nothing(backend, monkeypatch):
    """The last step of a write fails (the local rename, the object store's move of the upload onto its key):
    the error reaches the caller, the earlier content stays, a new file does not appear, nothing is left."""
    store, kind = backend
    store.write_bytes("run.json", b"old")
    _fail_rename(monkeypatch, store, kind)
    with pytest.raises(OSError) as err:
        store.write_bytes("run.json", b"new")
    assert err.value.errno == errno.EIO
    with pytest.raises(OSError):
        store.write_bytes("steps/t.parquet", DATA)
    monkeypatch.undo()
    assert store.read_bytes("run.json") == b"old"
    assert _names(store) == ["run.json"] and _names(store, "steps") == []


def test_a_full_store_fails_the_write_whole_and_keeps_the_earlier_file(backend, monkeypatch):
    """The store fills up during a write (ENOSPC after 1,000 bytes): the error (ENOSPC) reaches the caller, the
    file does not appear, a rewritten file keeps its earlier content, nothing is left; once there is room again a
    write succeeds whole."""
    store, kind = backend
    store.write_bytes("run.json", b"old")
    _fill_up(monkeypatch, store, kind, room=1000)
    for rel in ("steps/t.parquet", "run.json"):
        with pytest.raises(OSError) as err:
            store.write_bytes(rel, DATA)
        assert err.value.errno == errno.ENOSPC, rel
    monkeypatch.undo()
    assert store.read_bytes("run.json") == b"old"
    assert _names(store) == ["run.json"] and _names(store, "steps") == []
    store.write_bytes("steps/t.parquet", DATA)
    assert store.read_bytes("steps/t.parquet") == DATA


def test_a_monitor_on_a_full_store_drops_that_step_only_and_the_run_reads_back(backend, monkeypatch):
    """A monitor whose store is full while step 1 is written (its pending files fail with ENOSPC): the step's rows
    are counted as dropped (its 96 token rows and its steps row), no file holds step 1, steps 0 and 2 read back
    whole, nothing temporary is left."""
    store, kind = backend
    with MismatchMonitor(store.location, MonitorConfig(window=2, calibration_steps=1)) as mon:
        for s in range(3):
            if s == 1:
                _fill_up(monkeypatch, mon.sink.store, kind, room=0)
            mon.log_step(s, _batch(s))
            mon.sink.flush()
            monkeypatch.undo()
        dropped = mon.sink.dropped_rows
    assert dropped == 4 * 24 + 1
    run = open_run(store.location)
    assert run.step_numbers() == [0, 2] and run.steps()["step"].tolist() == [0, 2]
    assert [len(run.tokens(s)) for s in (0, 2)] == [4 * 24, 4 * 24]
    for table in ("tokens", "steps"):
        assert not [n for n in _names(store, table) if n.startswith(".tmp-")], table
