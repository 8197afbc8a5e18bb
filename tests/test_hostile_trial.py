"""Reproductions of a hostile trial, on real processes and files: a frozen object store (the local
S3 server of tests/test_object_store.py behind a TCP proxy the test freezes, loopback only) never holds the
training thread and a close ends on time, counting what it could not write; a process forked from a monitor's
raises; ranks without a process group cannot hide each other; a writer checks its options before it writes."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig

ROOT = Path(__file__).resolve().parents[1]


def _batch(step, B=4, T=24):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.2).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool),
                                  sample_ids=torch.arange(B) + 10 * step)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free port of 127.0.0.1 (as tests/test_object_store.py starts it) and a TCP proxy in
    front of it.  Yields ``(server_port, proxy, make_bucket)``; the monitor is pointed at the proxy by the URI's
    query, the checks read the server directly."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    import boto3

    from tcp_proxy import TcpProxy

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    proxy = TcpProxy(port)

    def bucket(name: str) -> str:
        client.create_bucket(Bucket=name)
        return name

    try:
        yield port, proxy, bucket
    finally:
        proxy.close()
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[2])
from test_hostile_trial import _batch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig

mon = MismatchMonitor(sys.argv[1], MonitorConfig(window=2, calibration_steps=6))
for s in range(3):
    mon.log_step(s, _batch(s))
assert mon.flush(timeout=120)
print("written", flush=True)
sys.stdin.readline()                      # the test has frozen the store
worst = 0.0
for s in range(3, 12):                    # tau_tail freezes at step 5: run.json is due then
    t = time.monotonic()
    mon.log_step(s, _batch(s))
    worst = max(worst, time.monotonic() - t)
    print(f"step {s}", flush=True)
t = time.monotonic()
ok = mon.close(timeout=3.0)
print(json.dumps({"worst": worst, "close_ok": ok, "close_s": time.monotonic() - t, "tau": mon.tracker.tau_frozen,
                  "dropped": mon.sink.dropped_rows, "abandoned": mon.sink.abandoned_rows}), flush=True)
"""


def test_a_frozen_store_never_holds_the_training_thread_and_close_ends_on_its_bound(s3):
    """A monitor process writes three steps to S3 through the proxy; the test freezes the proxy (every byte held,
    connections open: a frozen store) and keeps it frozen until the process has exited.  Nine more steps, τ_tail
    freezing among them (its run.json write is due), all return: the training thread never waits on the store.
    ``close(timeout=3)`` returns False within its bound plus run.json's grace; the steps still queued are counted
    as dropped (``abandoned_rows``), an ERROR line says run.json could not be written, the process exits, and the
    store's run.json still says ``running`` (what readers report as incomplete)."""
    port, proxy, bucket = s3
    uri = f"s3://{bucket('frozen')}/run?endpoint_override={proxy.endpoint}&scheme=http"
    p = subprocess.Popen([sys.executable, "-c", CHILD, uri, str(ROOT / "tests")], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert p.stdout.readline().strip() == "written", p.stderr.read()
        proxy.freeze()
        p.stdin.write("go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=300)         # a training thread waiting on the store would never get here
        exited_frozen = not proxy._open.is_set()
    finally:
        if p.poll() is None:
            p.kill()
        proxy.thaw()
    assert p.returncode == 0, err
    assert exited_frozen
    assert "Traceback" not in err, err
    lines = out.splitlines()
    assert lines[:9] == [f"step {s}" for s in range(3, 12)]
    res = json.loads(lines[9])
    assert res["tau"] is True and res["close_ok"] is False
    assert res["close_s"] < 3.0 + 5.0 + 5.0                        # the bound, run.json's grace, slack for load
    assert res["abandoned"] > 0 and res["dropped"] >= res["abandoned"]
    assert "could not be written within close()'s bound" in err and "record row(s) of this run were not written" in err
    assert res["worst"] < 5.0, res       # a write through the frozen proxy takes the client's timeouts (>= 3 s) or more
    from triage_monitor.rundir.storage import open_store

    store = open_store(f"s3://frozen/run?endpoint_override=127.0.0.1:{port}&scheme=http")
    manifest = json.loads(store.read_bytes("run.json"))
    assert manifest["status"] == "running" and manifest.get("calibration") is None


def test_close_at_its_bound_counts_the_queued_rows_in_run_json_and_alerts(tmp_path, caplog):
    """A local run whose writer is held (a hung mount, stood in for by a write that waits on an event): ``close(
    timeout=0.5)`` returns False at once after its bound; run.json is written (the disk itself answers) with
    ``status`` finished, ``writer.close_timed_out`` and the queued rows in ``dropped_rows`` and
    ``unwritten_at_close``; one ERROR line and a ``records_dropped`` alert to an alert-taking tracker say so."""
    import threading

    from triage_monitor.rundir.sink import DeferredColumns

    class Tracker:
        alerts: list = []

        def log_metrics(self, step, metrics):
            pass

        def emit(self, alert):
            self.alerts.append(alert)

    release = threading.Event()
    d = tmp_path / "run"
    tracker = Tracker()
    mon = MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), loggers=[tracker])
    mon.sink.submit("alerts", 0, 0, DeferredColumns(lambda: release.wait() and {"x": [1]}, 8, 1))
    for s in range(3):
        mon.log_step(s, _batch(s))
    queued = mon.sink.queued_rows
    t = time.monotonic()
    with caplog.at_level("ERROR", logger="triage_monitor"):
        assert mon.close(timeout=0.5) is False
    took = time.monotonic() - t
    release.set()
    assert took < 0.5 + 5.0 + 5.0
    man = json.loads((d / "run.json").read_text())
    assert man["status"] == "finished" and man["writer"]["close_timed_out"] is True
    assert man["writer"]["unwritten_at_close"] == queued == man["writer"]["dropped_rows"] > 0
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and f"with {queued} row(s) still queued" in errors[0]
    assert [a.rule for a in tracker.alerts] == ["records_dropped"] and tracker.alerts[0].level == "ERROR"


def test_a_full_queue_on_a_held_writer_drops_after_its_bound_instead_of_stalling(tmp_path, caplog):
    """``backpressure="block"`` with a writer that makes no progress (a frozen store): the submit that finds the
    queue full waits ``block_timeout`` seconds at most, then the step is dropped and counted with one warning; the
    next steps are dropped at once until the writer moves again (no second wait)."""
    import threading

    from triage_monitor.rundir.sink import DeferredColumns, ParquetSink

    release = threading.Event()
    sink = ParquetSink(tmp_path, attempt=1, max_queue_bytes=16, block_timeout=0.5)
    try:
        sink.submit("steps", 0, 0, DeferredColumns(lambda: release.wait() and {"x": [1]}, 8, 1))
        sink.submit("steps", 1, 0, DeferredColumns(lambda: {"x": [1]}, 8, 1))
        with caplog.at_level("WARNING", logger="triage_monitor"):
            assert sink.submit("steps", 2, 0, {"x": [1, 2]}) is False
            t = time.monotonic()
            assert sink.submit("steps", 3, 0, {"x": [1, 2, 3]}) is False
            assert time.monotonic() - t < 0.5                       # no second wait
        assert sink.dropped_rows == 5 and sink.timed_out_submits == 2
        assert len([r for r in caplog.records if "made no room" in r.getMessage()]) == 1
    finally:
        release.set()
        sink.close()
    assert sink.written_rows == 2


FORK_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from test_hostile_trial import _batch
from triage_monitor.errors import ForkedWriterError
from triage_monitor.monitor import MismatchMonitor

mon = MismatchMonitor(sys.argv[1])
mon.log_step(0, _batch(0))
pid = os.fork()
if pid == 0:
    msgs = []
    for call in (lambda: mon.log_step(1, _batch(1)), lambda: mon.flush(), lambda: mon.close()):
        try:
            call()
            msgs.append("no error")
        except ForkedWriterError as exc:
            msgs.append(str(exc))
    print("\n".join(msgs), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
mon.log_step(1, _batch(1))
mon.close()
print("parent closed", flush=True)
"""


def test_a_monitor_used_in_a_forked_child_raises_and_the_parent_keeps_writing(tmp_path):
    """After ``os.fork()`` the child's ``log_step``, ``flush()`` and ``close()`` each raise ForkedWriterError naming
    both processes and what to do (no silent loss, no endless flush); the parent's monitor goes on and its run holds
    both of its steps."""
    from triage_monitor.offline.analysis import open_run

    d = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", FORK_CHILD, str(d), str(ROOT / "tests")], cwd=ROOT, text=True,
                       capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 4 and lines[3] == "parent closed"
    for msg in lines[:3]:
        assert "forked from it after it was built" in msg and "build a new monitor in the child" in msg
    assert open_run(d).steps()["step"].tolist() == [0, 1]


def test_a_second_rank_without_a_process_group_or_attempt_is_refused_before_writing(tmp_path):
    """``MismatchMonitor(d, rank=1)`` in a process without torch.distributed would draw its own attempt id and hide
    (or be hidden by) rank 0's records: refused naming ``attempt=``, nothing written; with the shared ``attempt``
    two processes' ranks both read back."""
    from triage_monitor.offline.analysis import open_run
    from triage_monitor.rundir.records import new_attempt_id

    d = tmp_path / "run"
    with pytest.raises(ValueError, match="rank=1 without a torch.distributed process group needs attempt="):
        MismatchMonitor(d, rank=1)
    assert not d.exists()
    attempt = new_attempt_id()
    code = ("import sys; sys.path.insert(0, sys.argv[3]); from test_hostile_trial import _batch; "
            "from triage_monitor.monitor import MismatchMonitor; "
            "m = MismatchMonitor(sys.argv[1], rank=int(sys.argv[2]), attempt=%d); m.log_step(0, _batch(0)); m.close()"
            % attempt)
    for rank in (0, 1):
        subprocess.run([sys.executable, "-c", code, str(d), str(rank), str(ROOT / "tests")], cwd=ROOT, check=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    run = open_run(d)
    assert len(run.steps()) == 1 and len(run.steps(rank=1)) == 1
    assert sorted(run.tokens(0)["rank"].unique().tolist()) == [0, 1]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"attempt": -5}, ValueError, "MismatchMonitor: attempt must be an integer from 0 to 2**63 - 1"),
    ({"rank": 2 ** 70}, ValueError, "MismatchMonitor: rank must be an integer from 0 to 2**63 - 1"),
    ({"rank": "0"}, TypeError, "MismatchMonitor: rank must be an integer"),
    ({"resume": "no"}, TypeError, "MismatchMonitor: resume must be True or False, got 'no'"),
    ({"force": 1}, TypeError, "MismatchMonitor: force must be True or False"),
    ({"config": {"window": 3}}, TypeError, "config must be a MonitorConfig"),
])
def test_a_writer_refuses_options_readers_would_refuse_before_writing_anything(tmp_path, kwargs, error, message):
    """``attempt=-5``, ``rank=2**70``, ``resume="no"`` and friends are refused at construction naming the option,
    and the directory is not even created."""
    d = tmp_path / "run"
    with pytest.raises(error, match=message.replace("*", r"\*").replace("(", r"\(")):
        MismatchMonitor(d, **kwargs)
    assert not d.exists()


def test_monitor_config_refuses_unknown_keys_and_bad_values_at_construction(tmp_path):
    """``MonitorConfig.from_dict`` refuses a misspelt key (``windw``) naming it, ``MonitorConfig(backpressure=
    "yolo")`` is refused where it is built (before any run.json or lock exists); a reader's ``strict=False`` keeps
    ignoring keys a newer release added."""
    with pytest.raises(ValueError, match=r"MonitorConfig: unknown setting\(s\) \['windw'\]"):
        MonitorConfig.from_dict({"windw": 5})
    with pytest.raises(ValueError, match=r"MonitorConfig.metrics: unknown setting\(s\) \['segmnt_width'\]"):
        MonitorConfig.from_dict({"metrics": {"segmnt_width": 5}})
    with pytest.raises(ValueError, match="MonitorConfig.backpressure must be 'block' or 'drop', got 'yolo'"):
        MonitorConfig(backpressure="yolo")
    with pytest.raises(ValueError, match="MonitorConfig.max_queue_bytes must be an integer >= 1"):
        MonitorConfig(max_queue_bytes=0)
    assert MonitorConfig.from_dict({"window": 5, "future_key": 1}, strict=False).window == 5


@pytest.mark.parametrize("kwargs, error, message", [
    ({"attempt": -5}, ValueError, "HookSettings: attempt must be an integer from 0 to 2**63 - 1"),
    ({"rank": 2 ** 70}, ValueError, "HookSettings: rank must be an integer from 0 to 2**63 - 1"),
    ({"resume": "no"}, TypeError, "HookSettings: resume must be True or False, got 'no'"),
    ({"monitor": {"windw": 5}}, ValueError, "MonitorConfig: unknown setting(s) ['windw']"),
    ({"monitor": MonitorConfig(window=2.5)}, ValueError, "HookSettings.monitor.window must be an integer from 1"),
    ({"monitor": {"backpressure": "yolo"}}, ValueError, "MonitorConfig.backpressure must be 'block' or 'drop'"),
])
def test_hook_settings_check_the_writers_options_on_the_driver_naming_them(tmp_path, kwargs, error, message):
    """The options a worker's monitor would refuse (or, before, accept and lose records with) are refused where
    ``HookSettings`` is built, on the driver, naming the option."""
    from triage_monitor.hooks.worker_runtime import HookSettings

    with pytest.raises(error) as err:
        HookSettings(run_dir=str(tmp_path / "run"), **kwargs)
    assert message in str(err.value)
    assert not (tmp_path / "run").exists()


def _cli(*args, timeout=300):
    """``python -m triage_monitor ARGS`` in a process of its own: (exit status, stdout + stderr)."""
    p = subprocess.run([sys.executable, "-m", "triage_monitor", *map(str, args)], cwd=ROOT, text=True,
                       capture_output=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return p.returncode, p.stdout + p.stderr


def _run(d, steps=8, **cfg):
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2, roll_steps=4, **cfg)) as mon:
        for s in range(steps):
            mon.log_step(s, _batch(s))


def test_analyze_never_calls_a_run_that_lost_records_complete(tmp_path):
    """A run whose close gave up on a held writer (rows counted dropped in run.json) and a run whose run.json still
    says ``running`` (a killed job, a close that could not write it): ``analyze`` names each gap on a line of its
    own, never says "the records are complete", and exits 1; the intact run exits 0 and says it."""
    import threading

    from triage_monitor.rundir.sink import DeferredColumns

    whole = tmp_path / "whole"
    _run(whole)
    code, out = _cli("analyze", whole)
    assert code == 0 and "the records are complete" in out
    lost = tmp_path / "lost"
    release = threading.Event()
    mon = MismatchMonitor(lost, MonitorConfig(window=2, calibration_steps=2))
    for s in range(4):
        mon.log_step(s, _batch(s))
    assert mon.flush(timeout=120)
    mon.sink.submit("alerts", 0, 0, DeferredColumns(lambda: release.wait() and {"x": [1]}, 8, 1))
    for s in range(4, 8):
        mon.log_step(s, _batch(s))
    assert mon.close(timeout=0.2) is False
    release.set()
    code, out = _cli("analyze", lost)
    assert code == 1 and "the records are complete" not in out
    assert "incomplete records: the writer dropped" in out and "close() gave up" in out
    man = json.loads((whole / "run.json").read_text())
    man["status"] = "running"
    (whole / "run.json").write_text(json.dumps(man))
    code, out = _cli("analyze", whole)
    assert code == 1 and "incomplete records: run.json says the run is 'running'" in out
    assert "the records are complete" not in out


def test_the_state_cache_is_keyed_by_the_files_and_a_damaged_cache_is_recomputed_with_one_warning(tmp_path):
    """After one ``analyze``, a token block truncated in place is read again (the cache key holds each file's
    name, size and modification time): exit 2 naming the file, never a cached "complete".  A damaged state cache
    (not a zip file) gives one WARNING naming it, is recomputed and rewritten, exit 0 — no traceback."""
    d = tmp_path / "run"
    _run(d)
    code, out = _cli("analyze", d)
    assert code == 0
    (cache,) = (d / "analysis").glob("states-*.npz")
    cache.write_bytes(cache.read_bytes()[:100])
    code, out = _cli("analyze", d)
    assert code == 0 and "Traceback" not in out
    assert out.count(f"the state cache {cache} is damaged (BadZipFile") == 1
    import numpy as np

    with np.load(cache) as z:                       # rewritten whole
        assert z["states"].shape[0] == 8
    block = sorted((d / "tokens").glob("*part-1.parquet"))[0]
    with open(block, "r+b") as f:
        f.truncate(300)
    code, out = _cli("analyze", d)
    assert code == 2 and block.name in out and "the records are complete" not in out


def test_import_table_on_a_full_disk_exits_3_and_marks_the_run_failed(tmp_path):
    """``import table`` in a process whose files may not pass 24 kB (``ulimit -f``: the writes fail with EFBIG,
    as on a full disk): the token rows cannot be written, so the command exits 3 naming the rows lost and the
    error, never "imported N step(s)", and run.json says ``failed``."""
    import resource

    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    n_steps, per = 20, 2048
    sampler = -rng.random(n_steps * per) * 3
    table = pd.DataFrame({"step": np.repeat(np.arange(n_steps), per), "sample_id": np.tile(np.repeat(np.arange(8),
                          per // 8), n_steps), "learner_logp": sampler - 0.01, "sampler_logp": sampler,
                          "advantage": np.ones(n_steps * per), "position": np.tile(np.arange(per // 8), 8 * n_steps)})
    src = tmp_path / "in.parquet"
    table.to_parquet(src)
    out = tmp_path / "run"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (24_000, 24_000))

    p = subprocess.run([sys.executable, "-m", "triage_monitor", "import", "table", str(src), "--out", str(out)],
                       cwd=ROOT, text=True, capture_output=True, timeout=300, preexec_fn=limit,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 3, p.stdout + p.stderr
    assert "imported" not in p.stdout
    assert "record row(s) could not be written" in p.stderr and "File too large" in p.stderr
    assert json.loads((out / "run.json").read_text())["status"] == "failed"


TAKEOVER_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[2])
from test_hostile_trial import _batch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
with MismatchMonitor(sys.argv[1], MonitorConfig(window=2, calibration_steps=2)) as mon:
    for s in range(3, 6):
        mon.log_step(s, _batch(s))
print(mon.attempt, flush=True)
"""


def test_a_writer_taken_over_stops_writing_and_leaves_run_json_to_the_new_one(s3, caplog):
    """Writer A's lease on S3 is made stale (its renewal time 200 s back, as after a freeze of A); writer B, a real
    process, takes rank 0 over, writes steps 3-5 and closes.  A's next renewal finds B's lease: one ERROR line, A's
    later steps are counted dropped (not written), and A's close leaves B's run.json (B's attempt, finished)."""
    import time as _time

    from triage_monitor.offline.analysis import open_run
    from triage_monitor.rundir.storage import open_store

    port, _, bucket = s3
    uri = f"s3://{bucket('takeover')}/run?endpoint_override=127.0.0.1:{port}&scheme=http"
    a = MismatchMonitor(uri, MonitorConfig(window=2, calibration_steps=2))
    for s in range(3):
        a.log_step(s, _batch(s))
    assert a.flush(timeout=120)
    lease = a.writer._lock
    store = open_store(uri)
    store.write_bytes(lease.name, f"{lease._head}, renewed {_time.time() - 200:.3f}\n".encode())
    p = subprocess.run([sys.executable, "-c", TAKEOVER_CHILD, uri, str(ROOT / "tests")], cwd=ROOT, text=True,
                       capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    b_attempt = int(p.stdout.split()[-1])
    assert "a stopped writer's lease, taken over" in p.stderr
    with caplog.at_level("ERROR", logger="triage_monitor"):
        assert lease.renew() is False
    assert [r.getMessage() for r in caplog.records if "took over rank 0" in r.getMessage()]
    a.log_step(6, _batch(6))
    a.close(timeout=60)
    assert a.sink.dropped_rows == _batch(6).num_tokens + 1 and a.sink.written_rows > 0
    man = json.loads(store.read_bytes("run.json"))
    assert man["status"] == "finished" and man["attempts"][-1]["attempt"] == b_attempt
    steps = open_run(uri).steps()
    assert steps["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert (steps.loc[steps["step"] >= 3, "attempt"] == b_attempt).all()


def test_a_live_rule_on_a_metric_the_monitor_does_not_log_is_warned_at_the_first_step(tmp_path, caplog):
    """A rule on ``rho_asymm`` (misspelt) or on an extra never passed is named in one WARNING at the first step
    (not an INFO line at close); a rule on a logged extra (``reward``) is not."""
    from triage_monitor.alerting.alert_rules import Rule

    rules = [Rule(name="typo", metric="rho_asymm", condition="above", threshold=1.0),
             Rule(name="mine", metric="reward", condition="below", threshold=-1.0)]
    with caplog.at_level("WARNING", logger="triage_monitor"):
        with MismatchMonitor(tmp_path / "run", MonitorConfig(window=2, tau_tail=-1.0), alerts=rules) as mon:
            for s in range(3):
                mon.log_step(s, _batch(s), extra={"reward": 0.5})
    warned = [r.getMessage() for r in caplog.records if "does not log" in r.getMessage()]
    assert len(warned) == 1 and "typo ('rho_asymm')" in warned[0] and "mine" not in warned[0]


def test_a_batch_on_the_meta_device_is_refused_naming_the_argument():
    """Log-probs on the ``meta`` device (shapes without values) are a ValueError naming the argument and the
    device, from every layout constructor, instead of torch's NotImplementedError from deep inside."""
    m = torch.zeros(2, 3, device="meta")
    adv, mask = torch.zeros(2, device="meta"), torch.ones(2, 3, dtype=torch.bool, device="meta")
    calls = {"learner_logp": lambda: TokenBatch.from_padded(m, m, adv, mask),
             "learner_logp[0]": lambda: TokenBatch.from_list([m[0]], [m[0]], [torch.zeros(3, device="meta")]),
             "learner_logp ": lambda: TokenBatch.from_flat(m[0], m[0], torch.zeros(3, device="meta"),
                                                           torch.zeros(3, dtype=torch.long, device="meta"),
                                                           torch.arange(3, device="meta"))}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{re.escape(name.strip())} is on the meta device"):
            call()


def test_a_run_ending_at_step_two_to_the_63_minus_1_is_named_exactly(tmp_path):
    """Steps up to 2**63 - 1 (the last int64): the verdict's last-step line names 9223372036854775807, not the
    float's 9223372036854775808; the shipped rules raise no warning about metrics the monitor does not log."""
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2)) as mon:
        for s in range(2 ** 63 - 4, 2 ** 63):
            mon.log_step(s, _batch(s % 1000))
    code, out = _cli("analyze", d)
    last = next(ln for ln in out.splitlines() if ln.strip().startswith("last step:"))
    assert "at step 9223372036854775807," in last and "does not log" not in out
    assert "9223372036854775808" not in out and "not evaluable on this run" in out, out   # no step past int64


def test_analyze_out_and_report_o_on_a_full_disk_leave_no_file_and_no_temporary(tmp_path):
    """``analyze --out t.csv`` / ``--out t.parquet`` and ``report -o r.html`` in processes whose files may not pass
    a size limit (``ulimit -f``, as a full disk): exit 3, and neither the output nor a hidden temporary file is
    left in its directory (a truncated table at its final name was the fault)."""
    import resource

    d = tmp_path / "run"
    _run(d, steps=30)
    outdir = tmp_path / "out"
    outdir.mkdir()

    def limited(args, limit):
        def pre():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        return subprocess.run([sys.executable, "-m", "triage_monitor", *map(str, args)], cwd=ROOT, text=True,
                              capture_output=True, timeout=300, preexec_fn=pre,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    for name in ("t.csv", "t.parquet"):
        p = limited(["analyze", d, "--out", outdir / name], 4000)
        assert p.returncode == 3, p.stdout + p.stderr
        assert f"cannot save the table to {outdir / name}" in p.stderr
        assert sorted(x.name for x in outdir.iterdir()) == []
    p = limited(["report", d, "-o", outdir / "r.html", "--draws", "9"], 100_000)
    assert p.returncode == 3, p.stdout + p.stderr
    assert sorted(x.name for x in outdir.iterdir()) == []


def test_the_dashboard_page_opens_only_the_given_roots_and_takes_no_endpoint_from_a_visitor(tmp_path, monkeypatch):
    """The page as the launcher starts it (``-- RUN --allow-root=...`` after app.py): a run typed in the sidebar
    outside the roots is refused naming them, one inside is shown; an ``s3://`` location typed with
    ``?endpoint_override=`` is refused before any request — a listener at that endpoint is never connected to."""
    import socket

    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from triage_monitor.dashboards.launch import app_path, build_command

    root = tmp_path / "root"
    _run(root / "a", steps=4)
    _run(root / "b", steps=4)
    _run(tmp_path / "elsewhere", steps=4)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    cmd = build_command([str(root / "a")], roots=[str(root)])
    monkeypatch.setattr(sys, "argv", [str(app_path()), *cmd[cmd.index("--") + 1:]])
    monkeypatch.delenv("TRIAGE_MONITOR_RUNS", raising=False)
    at = AppTest.from_file(str(app_path()), default_timeout=180).run()
    assert not at.exception and not at.error
    at.text_area(key="runs_text").input(f"{root / 'b'}\n{tmp_path / 'elsewhere'}").run()
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and errors[0].startswith(f"{tmp_path / 'elsewhere'}: outside the run roots")
    port = listener.getsockname()[1]
    at.text_area(key="runs_text").input(f"s3://bucket/run?endpoint_override=127.0.0.1:{port}&scheme=http").run()
    assert any("may not carry query options" in e.value for e in at.error)
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


def test_the_dashboard_warns_when_it_binds_beyond_loopback(tmp_path, capsys):
    """``dashboard RUN --host 0.0.0.0`` prints a warning naming the host and what it exposes, before the server
    starts (the server is stubbed: a command that exits at once); a loopback address (127.0.0.0/8, ::1, localhost)
    prints none."""
    import argparse

    from triage_monitor.commands import dashboard as dashboard_cmd

    pytest.importorskip("streamlit")
    _run(tmp_path / "a", steps=2)
    parser = dashboard_cmd.add_arguments(argparse.ArgumentParser())
    orig = dashboard_cmd.build_command
    try:
        dashboard_cmd.build_command = lambda *a, **k: [sys.executable, "-c", "pass"]
        for host, warned in (("0.0.0.0", True), ("::", True), ("127.0.0.1", False), ("127.0.0.2", False),
                             ("localhost", False), ("::1", False)):
            assert dashboard_cmd.run(parser.parse_args([str(tmp_path / "a"), "--host", host])) == 0
            err = capsys.readouterr().err
            assert (f"warning: bound to {host}, the page is reachable from the network" in err) is warned
    finally:
        dashboard_cmd.build_command = orig


def test_the_runs_device_in_the_step_time_caption_is_plain_text(tmp_path, monkeypatch):
    """``info.device`` of a crafted run.json (a link and a remote image) is shown verbatim as plain text under the
    step-time breakdown; no Markdown or caption element of the page carries it."""
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from triage_monitor.dashboards.launch import app_path

    device = "cuda:0 [click](https://evil.example/p) ![x](https://evil.example/t.png)"
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), manifest={"device": device}) as mon:
        for s in range(4):
            mon.log_step(s, _batch(s), timings={"generation": 1.0, "update": 0.5, "step": 2.0})
    monkeypatch.setenv("TRIAGE_MONITOR_RUNS", str(d))
    at = AppTest.from_file(str(app_path()), default_timeout=180).run()
    assert not at.exception
    assert any(device in t.value for t in at.text)
    rendered = [m.value for m in at.markdown] + [c.value for c in at.caption]
    assert not [v for v in rendered if "evil.example" in v]


def test_a_bare_tensorboard_tracker_writes_into_the_run_directory(tmp_path):
    """``loggers=["tensorboard"]`` in a process whose working directory is elsewhere: the event file is in
    ``<run>/tensorboard/``, and no ``runs/`` folder appears in the working directory (SummaryWriter's default)."""
    pytest.importorskip("tensorboard")
    work = tmp_path / "cwd"
    work.mkdir()
    d = tmp_path / "run"
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from test_hostile_trial import _batch; "
            "from triage_monitor.monitor import MismatchMonitor, MonitorConfig; "
            "m = MismatchMonitor(sys.argv[1], MonitorConfig(window=2), loggers=['tensorboard']); "
            "[m.log_step(s, _batch(s)) for s in range(3)]; m.close()")
    subprocess.run([sys.executable, "-c", code, str(d), str(ROOT / "tests")], cwd=work, check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert list(work.iterdir()) == []
    assert [p.name.startswith("events.out.tfevents") for p in (d / "tensorboard").iterdir()] == [True]


def test_the_trackers_line_of_docs_hooks_runs_as_written(tmp_path):
    """The ``loggers=`` line of docs/hooks.md (``"tensorboard"`` and ``{"kind": "mlflow", "tracking_uri":
    "file:/shared/mlruns", "experiment": "exp1"}``, ``/shared`` put under tmp) in a process without
    ``MLFLOW_ALLOW_FILE_STORE``: an MLflow run of experiment exp1 holds the monitor's metrics, the TensorBoard events
    are in the run directory, and nothing lands in the working directory."""
    import ast
    import re as re_

    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    text = (ROOT / "docs" / "hooks.md").read_text()
    m = re_.search(r'loggers=(\["tensorboard",\s*# [^\n]*\n\s*\{"kind": "mlflow", "tracking_uri": '
                   r'"file:/shared/mlruns", "experiment": "exp1"\}\])', text)
    assert m, "the loggers= line of docs/hooks.md changed"
    literal = re_.sub(r"#[^\n]*\n", "\n", m.group(1)).replace("/shared", str(tmp_path))
    loggers = ast.literal_eval(literal)
    work = tmp_path / "cwd"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}
    code = ("import sys, json; sys.path.insert(0, sys.argv[2]); from test_hostile_trial import _batch; "
            "from triage_monitor.monitor import MismatchMonitor, MonitorConfig; "
            "m = MismatchMonitor(sys.argv[1], MonitorConfig(window=2), loggers=json.loads(sys.argv[3])); "
            "[m.log_step(s, _batch(s)) for s in range(3)]; m.close()")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), str(ROOT / "tests"), json.dumps(loggers)],
                       cwd=work, timeout=300, capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0 and "could not" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert list(work.iterdir()) == []
    assert any(f.name.startswith("events.out.tfevents") for f in (tmp_path / "run" / "tensorboard").iterdir())
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"file:{tmp_path}/mlruns")
        exp = client.get_experiment_by_name("exp1")
        (run,) = client.search_runs([exp.experiment_id])
        assert "triage/rho_asym" in run.data.metrics or any(k.startswith("triage/") for k in run.data.metrics)
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


KILLED_WRITER = r"""
import sys, os
sys.path.insert(0, sys.argv[2])
from test_hostile_trial import _batch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
mon = MismatchMonitor(sys.argv[1], MonitorConfig(window=2, calibration_steps=2, roll_steps=50))
for s in range(3):                         # 3 x 384k tokens: past the 16 MiB row group, so the block's file exists
    mon.log_step(s, _batch(s, B=128, T=3072))
assert mon.flush(timeout=120)
print("written", flush=True)
sys.stdin.readline()
"""


def _killed_writer(where, env):
    import signal

    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(where), str(ROOT / "tests")], cwd=ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout.readline().strip() == "written", p.stderr.read()
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)


def test_a_killed_writers_temporary_block_and_spool_are_removed_by_the_next_writer(s3, tmp_path):
    """A writer SIGKILLed with open blocks leaves hidden ``.tmp-rank-R-attempt-A-*.parquet`` files (local) or its
    spool directory in ``$TMPDIR`` (S3); the next writer of the rank removes them (the temporaries when it seals
    the killed attempt's pending files, the spool when it makes its own), and the steps read back."""
    from triage_monitor.offline.analysis import open_run

    port, _, bucket = s3
    spool_root = tmp_path / "tmpdir"
    spool_root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(spool_root)}
    d = tmp_path / "run"
    _killed_writer(d, env)
    left = [f.name for f in (d / "tokens").iterdir() if f.name.startswith(".tmp-rank-0000-attempt-")]
    assert left
    uri = f"s3://{bucket('killed-hostile')}/run?endpoint_override=127.0.0.1:{port}&scheme=http"
    _killed_writer(uri, env)
    spools = [x.name for x in spool_root.iterdir() if x.name.startswith("triage-monitor-spool-")]
    assert len(spools) == 1
    code = ("import sys; sys.path.insert(0, sys.argv[3]); from test_hostile_trial import _batch; "
            "from triage_monitor.monitor import MismatchMonitor, MonitorConfig; "
            "[MismatchMonitor(w, MonitorConfig(window=2, calibration_steps=2, roll_steps=50)).close() "
            "for w in (sys.argv[1], sys.argv[2])]")
    subprocess.run([sys.executable, "-c", code, str(d), uri, str(ROOT / "tests")], cwd=ROOT, check=True, timeout=300,
                   env=env)
    assert not [f for f in (d / "tokens").iterdir() if f.name.startswith(".tmp-")]
    assert not [x for x in spool_root.iterdir() if x.name in spools]
    assert open_run(d).steps()["step"].tolist() == [0, 1, 2]
    assert open_run(uri).steps()["step"].tolist() == [0, 1, 2]


def test_analyze_of_a_run_on_a_frozen_store_is_an_io_error(s3):
    """``analyze s3://...`` while the store does not answer (the proxy frozen): the client's timeouts end it with
    one line naming the location and exit 3 (an I/O error), not 2 (a wrong path)."""
    port, proxy, bucket = s3
    uri = f"s3://{bucket('frozen-read')}/run?endpoint_override={proxy.endpoint}&scheme=http"
    with MismatchMonitor(uri, MonitorConfig(window=2, calibration_steps=2)) as mon:
        for s in range(3):
            mon.log_step(s, _batch(s))
    proxy.freeze()
    try:
        code, out = _cli("analyze", uri, timeout=280)
    finally:
        proxy.thaw()
    assert code == 3, out
    assert "s3://frozen-read/run: cannot be read" in out and "Traceback" not in out


def test_readers_take_a_run_json_with_a_setting_of_a_newer_release(tmp_path, monkeypatch):
    """A run.json whose ``monitor_config`` holds a key this release does not know (a newer writer's): ``analyze``
    exits 0 and the dashboard page shows the run without an exception (readers ignore the key; only writers refuse
    unknown settings)."""
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from triage_monitor.dashboards.launch import app_path

    d = tmp_path / "run"
    _run(d, steps=4)
    man = json.loads((d / "run.json").read_text())
    man["monitor_config"]["future_key"] = 1
    (d / "run.json").write_text(json.dumps(man))
    code, out = _cli("analyze", d)
    assert code == 0, out
    monkeypatch.setenv("TRIAGE_MONITOR_RUNS", str(d))
    at = AppTest.from_file(str(app_path()), default_timeout=180).run()
    assert not at.exception and not at.error


def test_alerts_report_and_the_dashboard_name_a_run_that_lost_records(tmp_path, monkeypatch):
    """A run whose run.json records dropped rows (its close gave up): ``alerts`` and ``report`` print an
    ``incomplete records:`` line naming them and exit 1, the dashboard shows a warning naming them."""
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from triage_monitor.dashboards.launch import app_path

    d = tmp_path / "run"
    _run(d, steps=6)
    man = json.loads((d / "run.json").read_text())
    man["writer"] = {"written_rows": 10, "dropped_rows": 13, "close_timed_out": True}
    (d / "run.json").write_text(json.dumps(man))
    code, out = _cli("alerts", d)
    assert code == 1 and "incomplete records: the writer dropped 13 record row(s)" in out
    code, out = _cli("report", d, "-o", tmp_path / "r.html", "--draws", "9")
    assert code == 1 and "incomplete records:" in out and "dropped 13 record row(s)" in out
    assert (tmp_path / "r.html").stat().st_size > 10_000
    monkeypatch.setenv("TRIAGE_MONITOR_RUNS", str(d))
    at = AppTest.from_file(str(app_path()), default_timeout=180).run()
    assert not at.exception
    assert any("Incomplete records" in w.value and "13 record row" in w.value for w in at.warning)
