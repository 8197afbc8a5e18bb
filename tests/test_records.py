"""The run directory's writer side (triage_monitor.records): the monitor's files and their queue sizes, the start
checks' errors and messages, the tables' declared schemas (the steps table's included), moving a run aside."""

import json
import logging
import math
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from runfiles import file_of, files, parts
from triage_monitor.offline.analysis import open_run
from triage_monitor.batch import TokenBatch
from triage_monitor.rundir.manifest import RunManifest
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
from triage_monitor.rundir.records import OutputError, RunConflictError, UnwritableOutputError
from triage_monitor.rundir.sink import DeferredColumns


def _batch(step, B=3, T=16):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.1).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool))


def test_a_token_files_size_for_the_queue_bound_is_the_bytes_of_its_columns(tmp_path):
    """The token file of a step is queued before its columns exist (they are built on the writer thread), with a
    size for the queue bound worked out from the token count: per token the one-byte index shared by the three
    constant columns (step, rank, attempt: 1 byte), the int32 sample index shared by sample_id and group_id (4
    bytes) and four 4-byte columns (position int32, three float32 log-prob and advantage columns: 16 bytes), plus
    4 bytes per float32 token extra.  By hand: 3 x 16 = 48 tokens with one extra give 48 x 25 = 1200 bytes;
    independently, the columns built are that many bytes (each shared index counted once), the three one-value
    dictionaries (8 bytes each) and the two per-sample id dictionaries (3 samples x 8 bytes each)."""
    queued = {}
    with MismatchMonitor(tmp_path / "run", MonitorConfig(window=2)) as mon:
        submit = mon.sink.submit

        def spy(table, step, rank, columns, *args, **kwargs):
            queued.setdefault(table, columns)
            return submit(table, step, rank, columns, *args, **kwargs)

        mon.sink.submit = spy
        mon.log_step(0, _batch(0), token_extras={"entropy": torch.zeros(3, 16)})
    tokens = queued["tokens"]
    assert isinstance(tokens, DeferredColumns) and (tokens.nbytes, tokens.nrows) == (1200, 48)
    built = tokens.build()
    assert built.get_total_buffer_size() == 1200 + 3 * 8 + 2 * 3 * 8 and built.num_rows == 48


# ------------------------------------------------------------------------------------------ the writer thread
def test_monitor_flush_passes_its_timeout_to_the_writer(tmp_path, held_file):
    release = threading.Event()
    with MismatchMonitor(tmp_path / "r", MonitorConfig(window=2, tau_tail=-1.0)) as mon:
        mon.sink.submit("alerts", 0, 0, held_file(release, nbytes=16))
        t0 = time.monotonic()
        mon.flush(timeout=0.3)
        assert 0.25 <= time.monotonic() - t0 < 3
        release.set()
        mon.flush()
        assert mon.sink.written_steps == 1


# ------------------------------------------------------------------------------------------ the start checks
def test_start_errors_carry_the_directory_concerned(tmp_path):
    d = tmp_path / "run"
    MismatchMonitor(d, MonitorConfig(window=2)).close()
    with pytest.raises(RunConflictError) as err:
        MismatchMonitor(d, MonitorConfig(window=3))
    assert err.value.path == d
    assert err.value.differences == {"monitor_config.window": (2, 3)}
    (tmp_path / "file").write_text("")
    with pytest.raises(UnwritableOutputError) as err:
        MismatchMonitor(tmp_path / "file" / "run")
    assert err.value.path == tmp_path / "file" / "run"
    assert OutputError("no path").path is None and RunConflictError("x").differences == {}


def test_a_conflict_message_names_the_first_eight_differences_and_counts_the_rest(tmp_path):
    d = tmp_path / "run"
    MismatchMonitor(d, MonitorConfig(window=2), manifest={"demo_config": {f"k{i}": -1 for i in range(10)}}).close()
    ten = {f"k{i}": i for i in range(10)}                # ten identity keys differing: 'demo_config.k0' ...
    with pytest.raises(RunConflictError) as err:
        MismatchMonitor(d, MonitorConfig(window=2), manifest={"demo_config": ten})
    msg = str(err.value)
    listed = [f"demo_config.k{i}: -1 -> {i}" for i in range(10)]
    assert "; ".join(listed[:8]) + "; and 2 more)" in msg
    assert listed[8] not in msg and len(err.value.differences) == 10
    eight = {**ten, "k8": -1, "k9": -1}
    with pytest.raises(RunConflictError) as err:
        MismatchMonitor(d, MonitorConfig(window=2), manifest={"demo_config": eight})
    assert "; ".join(listed[:8]) + "): continue it" in str(err.value) and "more" not in str(err.value)


# --------------------------------------------------------------------------------------- the steps table
def test_a_metric_key_first_seen_late_is_warned_once_and_backfilled(tmp_path, caplog):
    d = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0)) as mon:
            mon.log_step(0, _batch(0), extra={"reward": 1.0})
            mon.log_step(1, _batch(1), extra={"reward": 2.0, "kl": 0.5})
            mon.log_step(2, _batch(2), extra={"kl": 0.25, "entropy": 3.0})
    warned = [r.getMessage() for r in caplog.records if "new metric column" in r.getMessage()]
    assert warned == ["triage-monitor: step 1 brings new metric column(s) ['kl'] (extra keys not passed at the first "
                      "step): files of the steps/ table differ in columns; open_run().steps() unites them, plain "
                      "readers may take the first file's columns"]
    steps = open_run(d).steps()
    assert steps["kl"].tolist()[1:] == [0.5, 0.25] and math.isnan(steps["kl"][0])
    assert math.isnan(steps["reward"][2]) and steps["entropy"].tolist()[2] == 3.0


def test_a_steps_file_holds_the_step_metrics_and_five_bookkeeping_columns_only(tmp_path):
    """No stray column: the file's columns are log_step's keys plus rank, attempt, wall_time and nan_reasons
    (the writer thread adds a missing ``rank`` column, so a misnamed one would otherwise pass unseen)."""
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), rank=1, attempt=7) as mon:
        out = mon.log_step(4, _batch(4))
    (f,) = (d / "steps").iterdir()
    t = pq.read_table(f)
    assert set(t.column_names) == set(out) | {"step", "rank", "attempt", "wall_time", "nan_reasons"}
    assert {"writer_dropped_rows", "alignment_suspect", "alignment_shift", "alignment_ratio"} <= set(out)
    assert t.column("writer_dropped_rows").to_pylist() == [0.0]


def test_steps_without_an_alignment_check_still_carry_its_columns_as_float_nan(tmp_path):
    """With ``alignment_check_steps=0`` no step computes the alignment check, yet every steps file has its three
    columns, float64 NaN (not null, not missing): the files of a resumed attempt, which starts past the checked
    steps, keep the schema of the first attempt's files."""
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0, alignment_check_steps=0)) as mon:
        for s in range(2):
            assert "alignment_suspect" not in mon.log_step(s, _batch(s))
    for f in sorted((d / "steps").iterdir()):
        t = pq.read_table(f)
        for c in ("alignment_suspect", "alignment_shift", "alignment_ratio"):
            assert t.schema.field(c).type == pa.float64() and t.column(c).null_count == 0, (f.name, c)
            assert math.isnan(t.column(c)[0].as_py())


def test_a_steps_file_with_more_than_one_row_is_skipped_and_named(tmp_path, caplog):
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0)) as mon:
        for s in range(3):
            mon.log_step(s, _batch(s))
    f = file_of(d, "steps", 1)                          # the block of steps 0..2
    t = pq.read_table(f)
    pq.write_table(pa.concat_tables([t, t.slice(1, 1)]), f)     # step 1's row twice
    run = open_run(d)
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        assert run.steps()["step"].tolist() == [0, 2]
        run.steps()
    why = "2 rows for step 1, a steps file holds one row a step"
    assert run.unreadable == [(str(f), why)]
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert warned == [f"triage-monitor: skipped unreadable file {f} ({why})"]


# ------------------------------------------------------------------------------------- force: moving a run aside
def test_force_names_the_old_run_by_utc_time_and_numbers_repeats(tmp_path, monkeypatch):
    import re

    monkeypatch.setenv("TZ", "America/New_York")         # the stamp is UTC whatever the local zone
    time.tzset()
    try:
        d = tmp_path / "run"
        before = time.gmtime()
        for _ in range(3):
            MismatchMonitor(d, MonitorConfig(window=2), force=True).close()
        after = time.gmtime()
    finally:
        monkeypatch.undo()
        time.tzset()
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != "run")
    assert len(names) == 2
    m = re.fullmatch(r"run\.replaced-(\d{8}T\d{6}Z)", names[0])
    assert m and time.strftime("%Y%m%dT%H%M%SZ", before) <= m.group(1) <= time.strftime("%Y%m%dT%H%M%SZ", after)
    if names[1].startswith(names[0]):                    # both moves in the same second: the second one is "-1"
        assert names[1] == names[0] + "-1"
    for n in names:
        assert (tmp_path / n / "run.json").is_file()


def test_force_moves_a_manifest_alone_or_table_directories_alone(tmp_path):
    from triage_monitor.rundir.records import check_run_dir

    only_manifest, only_tables, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    MismatchMonitor(only_manifest, MonitorConfig(window=2)).close()
    (only_tables / "alerts").mkdir(parents=True)
    (other / "notes").mkdir(parents=True)
    for p in (only_manifest, only_tables, other):
        assert check_run_dir(p, {}, {}, force=True) is None
    assert sorted(p.name.split(".replaced-")[0] for p in tmp_path.iterdir() if ".replaced-" in p.name) == ["a", "b"]
    assert not (only_manifest / "run.json").exists() and not (only_tables / "alerts").exists()
    assert (other / "notes").is_dir()                    # not a run: nothing is moved


def test_check_run_dir_by_default_neither_resumes_another_identity_nor_moves_the_run(tmp_path, caplog):
    """``check_run_dir(dir, config, info)`` without keywords: a run of another model is refused (no resume), with
    the run left where it is (no force); an unreadable run.json is refused naming the directory.  With
    ``force=True`` the move is warned naming both directories."""
    from triage_monitor.rundir.records import RunConflictError, check_run_dir

    d = tmp_path / "run"
    cfg = MonitorConfig(window=2)
    MismatchMonitor(d, cfg, manifest={"model": "a"}).close()
    with pytest.raises(RunConflictError, match="model"):
        check_run_dir(d, cfg.to_dict(), {"model": "b"})
    assert (d / "run.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["run"]
    assert isinstance(check_run_dir(d, cfg.to_dict(), {"model": "a"}), RunManifest)     # the same run continues
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        assert check_run_dir(d, cfg.to_dict(), {"model": "b"}, force=True) is None
    (aside,) = [p for p in tmp_path.iterdir() if p.name != "run"]
    assert [r.getMessage() for r in caplog.records if "--force" in r.getMessage()] == [
        f"triage-monitor: --force: the run that was in {d} is now in {aside}; a new run starts"]
    (d / "run.json").write_text("{")
    with pytest.raises(RunConflictError, match=r"holds a run whose run\.json is unreadable \(.*not valid JSON.*\): "
                                               r"write to a new directory, or start over with --force") as err:
        check_run_dir(d, cfg.to_dict(), {})
    assert err.value.path == d


def test_force_is_refused_while_another_writer_holds_the_run(tmp_path):
    from triage_monitor.rundir.records import RunLockedError

    d = tmp_path / "run"
    MismatchMonitor(d, MonitorConfig(window=2), attempt=5).close()
    with MismatchMonitor(d, MonitorConfig(window=2), rank=1, attempt=5):     # rank 1 of the run is being written
        with pytest.raises(RunLockedError, match=r"another process is writing this run's rank 1 \(pid \d+ on .*"
                                                 r"attempt 5"):
            MismatchMonitor(d, MonitorConfig(window=2), rank=0, force=True)
    assert not [p for p in tmp_path.iterdir() if ".replaced-" in p.name]
    MismatchMonitor(d, MonitorConfig(window=2), rank=0, force=True).close()   # released: moved aside now
    assert len([p for p in tmp_path.iterdir() if ".replaced-" in p.name]) == 1


def test_token_files_hold_the_documented_columns_and_types(tmp_path):
    from triage_monitor.rundir.records import TOKEN_SCHEMA

    d = tmp_path / "run"
    b = TokenBatch.from_list([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
                             [torch.tensor([-1.5, -2.0]), torch.tensor([-0.25])], torch.tensor([0.5, -1.0]),
                             sample_ids=torch.tensor([11, 12]), group_ids=torch.tensor([4, 4]))
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), rank=2, attempt=9) as mon:
        mon.log_step(3, b, token_extras={"gate_weight": torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)})
    t = pq.read_table(file_of(d, "tokens", 3, rank=2))
    assert t.schema == TOKEN_SCHEMA.append(pa.field("gate_weight", pa.float32()))
    assert t.to_pydict() == {"step": [3] * 3, "rank": [2] * 3, "sample_id": [11, 11, 12], "group_id": [4, 4, 4],
                             "position": [0, 1, 0], "learner_logp": [-1.0, -2.0, -0.5],
                             "sampler_logp": [-1.5, -2.0, -0.25], "advantage": [0.5, 0.5, -1.0],
                             "attempt": [9] * 3, "gate_weight": [1.0, 0.5, 0.0]}
    row = pq.read_table(file_of(d, "steps", 3, rank=2)).to_pylist()[0]
    assert (row["step"], row["rank"], row["attempt"], row["writer_dropped_rows"]) == (3, 2, 9, 0.0)
    assert abs(row["wall_time"] - time.time()) < 60 and row["n_tokens"] == 3.0
    assert json.loads(row["nan_reasons"]) == {k: v for k, v in json.loads(row["nan_reasons"]).items() if v}
    d = tmp_path / "run0"                                  # rank 0 writes run.json: a later attempt knows this one
    for attempt, record in ((9, True), (10, False)):       # the later attempt without token rows
        with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0, record_tokens=record), attempt=attempt) as mon:
            mon.log_step(3, b)
            mon.log_step(4, b)
        assert [p.attempt for p in parts(d, "tokens")] == [9]               # the later attempt wrote none
    # both attempts' steps rows stay; readers take the later one
    assert [p.name.split("/")[1] for p in parts(d, "steps")] == [
        "steps-00000003-00000004-rank-0000-attempt-10-part-0.parquet",
        "steps-00000003-00000004-rank-0000-attempt-9-part-0.parquet"]
    assert set(open_run(d).steps()["attempt"]) == {10}


def test_alignment_columns_are_in_every_steps_file(tmp_path):
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0, alignment_check_steps=1)) as mon:
        for s in range(3):
            mon.log_step(s, _batch(s))
    files = sorted((d / "steps").iterdir())
    assert all(pq.read_schema(f).names == pq.read_schema(files[0]).names for f in files)
    steps = open_run(d).steps()
    assert steps["alignment_suspect"].tolist()[0] == 0.0 and steps["alignment_suspect"][1:].isna().all()


def test_force_numbers_the_old_run_when_its_name_is_taken(tmp_path, monkeypatch):
    import triage_monitor.rundir.records as records

    monkeypatch.setattr(records.time, "gmtime", lambda *a: time.struct_time((2026, 1, 2, 3, 4, 5, 4, 2, 0)))
    d = tmp_path / "run"
    for taken in ("run.replaced-20260102T030405Z", "run.replaced-20260102T030405Z-1"):
        (tmp_path / taken).mkdir()
    MismatchMonitor(d, MonitorConfig(window=2)).close()
    MismatchMonitor(d, MonitorConfig(window=2), force=True).close()
    assert (tmp_path / "run.replaced-20260102T030405Z-2" / "run.json").is_file()
    MismatchMonitor(d, MonitorConfig(window=2), force=True).close()
    assert (tmp_path / "run.replaced-20260102T030405Z-3" / "run.json").is_file()


def test_alert_rows_carry_the_writers_rank_and_attempt(tmp_path):
    """An alert row written by rank 1 has rank 1, the step and the attempt id in its columns, not only in the file
    name (plain readers group by the columns)."""
    d = tmp_path / "run"
    row = {"rule": "rho", "metric": "rho_asym", "value": 2.0, "threshold": 1.5, "window": 10, "level": "warning",
           "title": "t", "text": "x", "tier": "mismatch"}
    mon = MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), rank=1, attempt=7)
    mon.writer.record_alerts(7, [row])
    attempt = mon.writer.attempt
    mon.close()
    (f,) = (d / "alerts").iterdir()
    got = pq.read_table(f).to_pylist()
    assert got == [{**row, "step": 7, "rank": 1, "attempt": attempt}]


def test_a_steps_file_starts_with_step_and_rank_and_holds_each_once(tmp_path):
    """The steps row of a step: int64 ``step`` and ``rank`` first, each column once, the step's value in it."""
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), rank=1, attempt=7) as mon:
        mon.log_step(4, _batch(4))
    (f,) = (d / "steps").iterdir()
    t = pq.read_table(f)
    assert t.column_names[:2] == ["step", "rank"] and len(set(t.column_names)) == len(t.column_names)
    assert t.column("step").to_pylist() == [4] and t.column("rank").to_pylist() == [1]
    assert t.schema.field("step").type == pa.int64() and t.schema.field("rank").type == pa.int64()


# ------------------------------------------------------------------------------------------ declared schemas
def test_the_steps_table_has_the_schema_declared_from_the_metrics_the_counters_and_the_first_extras(tmp_path):
    """Every steps file of a monitor has the declared schema of its first step's extras
    (:func:`triage_monitor.monitor.steps_schema`): int64 step / rank, the step metrics, the integrity counters with
    the alignment check, tau_tail_frozen, the window metrics, the extras, alerts_active (float64, in the order of
    log_step's keys), then int64 attempt, float64 wall_time and the string nan_reasons; a key first seen late comes
    after them, in the later files only."""
    from triage_monitor.metrics.stats import METRIC_NAMES
    from triage_monitor.monitor import INTEGRITY_METRICS, steps_schema

    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0)) as mon:
        out = mon.log_step(0, _batch(0), extra={"reward": 1.0, "kl": 0.5})
        mon.log_step(1, _batch(1), extra={"kl": 0.25})
        mon.log_step(2, _batch(2), extra={"reward": 2.0, "late": 3.0})
    declared = steps_schema(["reward", "kl"])
    first, second = files(d, "steps")                # a new column seals the block: steps 0-1, then 2
    assert pq.read_schema(first) == declared and pq.read_table(first).column("step").to_pylist() == [0, 1]
    assert pq.read_schema(second) == declared.append(pa.field("late", pa.float64()))
    assert declared.names == ["step", "rank", *[k for k in out if k != "step"], "attempt", "wall_time", "nan_reasons"]
    assert set(declared.names) >= {*METRIC_NAMES, *(f"window/{k}" for k in METRIC_NAMES), *INTEGRITY_METRICS,
                                   "alignment_suspect", "alignment_shift", "alignment_ratio", "tau_tail_frozen",
                                   "alerts_active"}
    types = {f.name: f.type for f in declared}
    assert {n for n, t in types.items() if t != pa.float64()} == {"step", "rank", "attempt", "nan_reasons"}
    assert types["nan_reasons"] == pa.string() and types["step"] == types["rank"] == types["attempt"] == pa.int64()
    row = pq.read_table(first).to_pylist()[1]
    assert math.isnan(row["reward"]) and row["kl"] == 0.25              # a declared extra a step lacks is NaN


def test_a_steps_schema_refuses_bookkeeping_names_and_repeats():
    from triage_monitor.monitor import steps_schema as monitor_steps_schema
    from triage_monitor.rundir.records import steps_schema

    assert steps_schema(["a", "b"]).names == ["step", "rank", "a", "b", "attempt", "wall_time", "nan_reasons"]
    for bad, named in ((["a", "rank"], "['rank']"), (["a", "b", "a"], "['a']"), (["wall_time"], "['wall_time']")):
        with pytest.raises(ValueError) as err:
            steps_schema(bad)
        assert str(err.value) == f"steps metric columns {named} are bookkeeping columns or given twice"
    # the monitor's declaration leaves out extras named like bookkeeping columns and keeps one of a repeat
    assert monitor_steps_schema(["x", "attempt", "x"]) == monitor_steps_schema(["x"])


def test_a_writer_without_a_declared_steps_schema_takes_the_first_rows_keys(tmp_path):
    """``RunWriter`` used without the monitor: the steps schema is the first row's keys (float64; the writer's own
    ``writer_dropped_rows`` included), later rows are NaN where they lack one."""
    from triage_monitor.rundir.records import RunWriter

    w = RunWriter(tmp_path / "run", 5, 0, 1, MonitorConfig(window=2).to_dict(), {}, {"tool_version": "t"})
    b = _batch(0)
    w.record_step(0, b, {"a": 1.0, "b": 2}, {}, None)
    w.record_step(1, b, {"b": 3.0}, {}, None)
    w.close("finished", 2)
    assert w.steps_schema.names == ["step", "rank", "a", "b", "writer_dropped_rows", "attempt", "wall_time",
                                    "nan_reasons"]
    rows = pq.read_table(file_of(tmp_path / "run", "steps", 0)).to_pylist()
    assert (rows[0]["a"], rows[0]["b"], rows[1]["b"]) == (1.0, 2.0, 3.0) and math.isnan(rows[1]["a"])


def test_every_tables_declared_schema_is_the_schema_its_files_have(tmp_path):
    """The tokens, quarantine and alerts files have their declared schemas exactly (what docs/metrics.md names)."""
    from triage_monitor.rundir.records import ALERT_SCHEMA, QUARANTINE_SCHEMA, TOKEN_SCHEMA

    d = tmp_path / "run"
    lp = torch.tensor([[-1.0, float("nan"), -0.5]])
    b = TokenBatch.from_padded(lp, torch.tensor([[-1.5, -1.0, -0.25]]), torch.tensor([0.5]),
                               torch.ones(1, 3, dtype=torch.bool), on_invalid="quarantine")
    row = {"rule": "rho", "metric": "rho_asym", "value": 2.0, "threshold": 1.5, "window": 10, "level": "warning",
           "title": "t", "text": "x"}
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), attempt=3) as mon:
        mon.log_step(0, b)
        mon.writer.record_alerts(0, [row])
    for table, schema in (("tokens", TOKEN_SCHEMA), ("quarantine", QUARANTINE_SCHEMA), ("alerts", ALERT_SCHEMA)):
        assert pq.read_schema(file_of(d, table, 0)) == schema, table
