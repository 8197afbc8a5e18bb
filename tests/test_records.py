"""The run directory's writer side (triage_monitor.records): the background writer's flush deadline, the start
checks' errors and messages, the manifest's JSON, the steps table's one schema."""

import argparse
import json
import logging
import math
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from triage_monitor.analysis import open_run
from triage_monitor.batch import TokenBatch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
from triage_monitor.records import (DeferredColumns, OutputError, ParquetSink, RunConflictError, RunManifest,
                                    UnwritableOutputError, add_existing_run_arguments, read_manifest, table_file,
                                    write_json_atomic)


def _batch(step, B=3, T=16):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.1).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool))


def test_a_token_files_size_for_the_queue_bound_is_the_bytes_of_its_columns(tmp_path):
    """The token file of a step is queued before its columns exist (they are built on the writer thread), with a
    size for the queue bound worked out from the token count: per token five int64 columns (step, rank,
    sample_id, group_id, attempt: 40 bytes) and four 4-byte ones (position int32, three float32 log-prob and
    advantage columns: 16 bytes), plus 4 bytes per float32 token extra.  By hand: 3 x 16 = 48 tokens with one
    extra give 48 x 60 = 2880 bytes; independently, the columns built are exactly that many bytes."""
    queued = {}
    with MismatchMonitor(tmp_path / "run", MonitorConfig(window=2)) as mon:
        submit = mon.sink.submit

        def spy(table, step, rank, columns, *args, **kwargs):
            queued.setdefault(table, columns)
            return submit(table, step, rank, columns, *args, **kwargs)

        mon.sink.submit = spy
        mon.log_step(0, _batch(0), token_extras={"entropy": torch.zeros(3, 16)})
    tokens = queued["tokens"]
    assert isinstance(tokens, DeferredColumns) and (tokens.nbytes, tokens.nrows) == (2880, 48)
    built = tokens.build()
    assert sum(a.nbytes for a in built.values()) == 2880 and {len(a) for a in built.values()} == {48}


# ------------------------------------------------------------------------------------------ the writer thread
def test_flush_with_a_timeout_returns_at_the_deadline_and_without_waits_for_the_disk(tmp_path):
    release = threading.Event()

    def slow_columns():                       # a file the writer thread is still building
        release.wait(10)
        return {"x": np.arange(3)}

    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("steps", 0, 0, DeferredColumns(slow_columns, 24, 3))
        t0 = time.monotonic()
        sink.flush(timeout=0.3)
        waited = time.monotonic() - t0
        assert 0.25 <= waited < 3, waited
        assert sink.written_files == 0
        threading.Timer(0.3, release.set).start()
        sink.flush()                          # no timeout: until the file is on disk
        assert sink.written_files == 1 and sink.written_rows == 3
        assert pq.read_table(table_file(tmp_path, "steps", 0, 0, 1)).column("x").to_pylist() == [0, 1, 2]
        # a removal queued behind a slow file is waited for too
        old = table_file(tmp_path, "tokens", 0, 0, 0)
        old.parent.mkdir()
        old.write_bytes(b"")
        release.clear()
        sink.submit("steps", 1, 0, DeferredColumns(slow_columns, 24, 3))
        sink.submit_delete("tokens", 0, 0, attempt=0)
        threading.Timer(0.2, release.set).start()
        sink.flush()
        assert not old.exists() and sink.written_files == 2
    finally:
        release.set()
        sink.close()


def test_monitor_flush_passes_its_timeout_to_the_writer(tmp_path, held_file):
    release = threading.Event()
    with MismatchMonitor(tmp_path / "r", MonitorConfig(window=2, tau_tail=-1.0)) as mon:
        mon.sink.submit("alerts", 0, 0, held_file(release, nbytes=16))
        t0 = time.monotonic()
        mon.flush(timeout=0.3)
        assert 0.25 <= time.monotonic() - t0 < 3
        release.set()
        mon.flush()
        assert mon.sink.written_files == 1


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


def test_resume_and_force_arguments(tmp_path):
    p = argparse.ArgumentParser()
    add_existing_run_arguments(p)
    assert vars(p.parse_args([])) == {"resume": False, "force": False}
    assert vars(p.parse_args(["--resume"])) == {"resume": True, "force": False}
    assert vars(p.parse_args(["--force"])) == {"resume": False, "force": True}
    with pytest.raises(SystemExit):
        p.parse_args(["--resume", "--force"])          # one or the other
    helps = {a.option_strings[0]: a.help for a in p._actions if a.option_strings[0] in ("--resume", "--force")}
    assert ("continue the run already in --out as a new attempt even if its model / task / correction / seed / "
            "source differ (the changes are recorded in run.json); the metric configuration must match"
            == helps["--resume"])
    assert "a run already there is moved to <out>.replaced-<UTC time>" in helps["--force"]
    assert helps["--force"].startswith("start a new run in --out")


# --------------------------------------------------------------------------------------------- the manifest
def test_manifest_json_is_standard_json_with_nan_as_null(tmp_path):
    obj = {"a": math.nan, "b": [1.5, math.inf, (2.0, -math.inf)], "c": {"d": math.nan, "e": "x"},
           "f": np.int64(3), "g": np.float64(0.25), "h": tmp_path, "i": np.float32(0.5), "j": {3}}
    write_json_atomic(obj, tmp_path / "m.json")
    text = (tmp_path / "m.json").read_text()
    assert json.loads(text) == {"a": None, "b": [1.5, None, [2.0, None]], "c": {"d": None, "e": "x"}, "f": 3,
                                "g": 0.25, "h": str(tmp_path), "i": 0.5, "j": "{3}"}
    assert "NaN" not in text and "Infinity" not in text
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_schema_one_manifest_reads_its_calibrated_tau_and_drops_duplicated_keys(tmp_path):
    old = {"monitor_config": {"window": 4}, "tau_tail_calibrated": -0.7, "segment_width": 64, "window": 4,
           "schema_version": 1, "future_key": [1, 2]}
    (tmp_path / "run.json").write_text(json.dumps(old))
    m = read_manifest(tmp_path)
    assert m.calibration == {"tau_tail": -0.7} and m.tau_tail == -0.7 and m.schema_version == 1
    assert m.extra == {"future_key": [1, 2]}
    assert m.to_dict()["future_key"] == [1, 2] and "segment_width" not in m.to_dict()
    assert "extra" not in m.to_dict()             # unknown keys go back at the top level, not under "extra"
    odd = RunManifest.from_dict({**old, "extra": {"a": 1}})      # a key named like the field is one more unknown
    assert odd.extra == {"future_key": [1, 2], "extra": {"a": 1}} and odd.to_dict()["extra"] == {"a": 1}
    given = RunManifest.from_dict({**old, "monitor_config": {"tau_tail": -0.2}})
    assert given.calibration is None and given.tau_tail == -0.2
    (tmp_path / "run.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"run.json: expected a JSON object, got list"):
        read_manifest(tmp_path)
    (tmp_path / "run.json").write_text("{")
    with pytest.raises(ValueError, match=r"run.json: not valid JSON"):
        read_manifest(tmp_path)


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
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), rank=1) as mon:
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
    f = next((d / "steps").glob("step-00000001-*.parquet"))
    t = pq.read_table(f)
    pq.write_table(pa.concat_tables([t, t]), f)
    run = open_run(d)
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        assert run.steps()["step"].tolist() == [0, 2]
        run.steps()
    assert run.unreadable == [(str(f), "2 rows, a steps file holds one")]
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert warned == [f"triage-monitor: skipped unreadable file {f} (2 rows, a steps file holds one)"]



def test_numpy_float32_nan_in_the_manifest_is_written_as_null(tmp_path):
    """np.float32 is no Python float: its NaN / inf must become null too, not stop the monitor at start."""
    with MismatchMonitor(tmp_path / "r", MonitorConfig(window=2), manifest={"lr": np.float32("nan"),
                                                                           "clip": [np.float32("inf")]}):
        pass
    info = json.loads((tmp_path / "r" / "run.json").read_text())["info"]
    assert info["lr"] is None and info["clip"] == [None]


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
    from triage_monitor.records import check_run_dir

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
    from triage_monitor.records import RunConflictError, check_run_dir

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
    from triage_monitor.records import RunLockedError

    d = tmp_path / "run"
    MismatchMonitor(d, MonitorConfig(window=2), attempt=5).close()
    with MismatchMonitor(d, MonitorConfig(window=2), rank=1, attempt=5):     # rank 1 of the run is being written
        with pytest.raises(RunLockedError, match=r"another process is writing this run's rank 1 \(pid \d+ on .*"
                                                 r"attempt 5"):
            MismatchMonitor(d, MonitorConfig(window=2), rank=0, force=True)
    assert not [p for p in tmp_path.iterdir() if ".replaced-" in p.name]
    MismatchMonitor(d, MonitorConfig(window=2), rank=0, force=True).close()   # released: moved aside now
    assert len([p for p in tmp_path.iterdir() if ".replaced-" in p.name]) == 1


# ------------------------------------------------------------------------------------- the queue bound
def test_a_full_queue_blocks_or_drops_and_a_closed_sink_counts_its_rows(tmp_path, held_file):
    release = threading.Event()
    sink = ParquetSink(tmp_path / "block", attempt=1, max_queue_bytes=150, backpressure="block")
    try:
        assert sink.submit("steps", 0, 0, held_file(release))    # alone in the queue: accepted
        accepted = []
        t = threading.Thread(target=lambda: accepted.append(sink.submit("steps", 1, 0, {"x": np.arange(7)})))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not accepted                      # 100 + 56 bytes > 150: waits for the writer
        release.set()
        t.join(10)
        assert accepted == [True]
        sink.flush()
        assert sink.written_files == 2 and sink.written_rows == 9 and sink.dropped_rows == 0
    finally:
        release.set()
        sink.close()
    assert sink.closed and sink.submit("steps", 2, 0, [{"x": 1}, {"x": 2}]) is False and sink.dropped_rows == 2
    sink.submit_delete("steps", 0, 0, attempt=1)                   # nothing queued after close
    assert table_file(tmp_path / "block", "steps", 0, 0, 1).exists()

    release = threading.Event()
    sink = ParquetSink(tmp_path / "drop", attempt=1, max_queue_bytes=150, backpressure="drop")
    try:
        assert sink.submit("steps", 0, 0, held_file(release, rows=2))
        assert sink.submit("steps", 1, 0, {"x": np.arange(6)}) is True        # 100 + 48 bytes fit
        assert sink.submit("steps", 2, 0, {"x": np.arange(3)}) is False       # + 24 does not: dropped, counted
        assert sink.submit("steps", 3, 0, [{"x": 1}]) is False                # a row counts 256 bytes
        assert sink.dropped_rows == 4
        release.set()
        sink.flush()
        assert sink.written_rows == 8 and sink.written_files == 2
    finally:
        release.set()
        sink.close()
    with pytest.raises(ValueError, match="backpressure must be 'block' or 'drop', got 'wait'"):
        ParquetSink(tmp_path, attempt=1, backpressure="wait")


def test_an_unwritable_file_is_counted_and_reported_once(tmp_path, caplog):
    (tmp_path / "steps").write_text("")                  # the table directory cannot be created
    sink = ParquetSink(tmp_path, attempt=1)
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        for s in range(3):
            sink.submit("steps", s, 0, {"x": np.arange(4)})
        sink.close()
    assert sink.dropped_rows == 12 and sink.written_rows == 0 and sink.written_files == 0
    assert sink.last_error.startswith(("FileExistsError: ", "NotADirectoryError: "))
    warned = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warned) == 1 and "steps rows for step 0" in warned[0]


def test_token_files_hold_the_documented_columns_and_types(tmp_path):
    from triage_monitor.records import TOKEN_SCHEMA

    d = tmp_path / "run"
    b = TokenBatch.from_list([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
                             [torch.tensor([-1.5, -2.0]), torch.tensor([-0.25])], torch.tensor([0.5, -1.0]),
                             sample_ids=torch.tensor([11, 12]), group_ids=torch.tensor([4, 4]))
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), rank=2, attempt=9) as mon:
        mon.log_step(3, b, token_extras={"gate_weight": torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)})
    t = pq.read_table(table_file(d, "tokens", 3, 2, 9))
    assert t.schema == TOKEN_SCHEMA.append(pa.field("gate_weight", pa.float32()))
    assert t.to_pydict() == {"step": [3] * 3, "rank": [2] * 3, "sample_id": [11, 11, 12], "group_id": [4, 4, 4],
                             "position": [0, 1, 0], "learner_logp": [-1.0, -2.0, -0.5],
                             "sampler_logp": [-1.5, -2.0, -0.25], "advantage": [0.5, 0.5, -1.0],
                             "attempt": [9] * 3, "gate_weight": [1.0, 0.5, 0.0]}
    row = pq.read_table(table_file(d, "steps", 3, 2, 9)).to_pylist()[0]
    assert (row["step"], row["rank"], row["attempt"], row["writer_dropped_rows"]) == (3, 2, 9, 0.0)
    assert abs(row["wall_time"] - time.time()) < 60 and row["n_tokens"] == 3.0
    assert json.loads(row["nan_reasons"]) == {k: v for k, v in json.loads(row["nan_reasons"]).items() if v}
    d = tmp_path / "run0"                                  # rank 0 writes run.json: a later attempt knows this one
    for attempt, record in ((9, True), (10, False)):       # the later attempt without token rows
        with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0, record_tokens=record), attempt=attempt) as mon:
            mon.log_step(3, b)
            mon.log_step(4, b)
        assert table_file(d, "tokens", 4, 0, 9).exists() == record
    assert not table_file(d, "tokens", 3, 0, 9).exists() and not table_file(d, "tokens", 3, 0, 10).exists()
    assert sorted(p.name for p in (d / "steps").iterdir()) == ["step-00000003-rank-0000-attempt-10.parquet",
                                                               "step-00000004-rank-0000-attempt-10.parquet"]


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
    import triage_monitor.records as records

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
           "title": "t", "text": "x"}
    mon = MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), rank=1)
    mon.writer.record_alerts(7, [row])
    attempt = mon.writer.attempt
    mon.close()
    (f,) = (d / "alerts").iterdir()
    got = pq.read_table(f).to_pylist()
    assert got == [{**row, "step": 7, "rank": 1, "attempt": attempt}]


def test_config_differences_name_keys_set_on_one_side_only():
    """An existing run's manifest against a new writer's configuration: a metric setting only the new one has, an
    identity key only the old run has (a dict) and one only the new writer has, and a dict key whose inner keys
    differ on both sides are all named, as (old, new) with None for the missing side."""
    from triage_monitor.records import config_differences

    old = RunManifest(monitor_config={"window": 10, "metrics": {"segment_width": 64}},
                      info={"demo_config": {"steps": 30}, "column_map": {"lp": "learner_logp", "adv": "advantage"}})
    metric, identity = config_differences(
        old, {"window": 10, "metrics": {"segment_width": 64, "heavy_fraction": 0.1}, "record_tokens": False},
        {"model": "qwen", "column_map": {"lp": "learner_logp", "s": "sampler_logp"}})
    assert metric == {"monitor_config.metrics.heavy_fraction": (None, 0.1)}
    assert identity == {"demo_config": ({"steps": 30}, None), "model": (None, "qwen"),
                        "column_map.adv": ("advantage", None), "column_map.s": (None, "sampler_logp")}
    # numpy scalars compare as the JSON values they are written as
    assert config_differences(RunManifest(monitor_config={"window": 10}, info={"seed": 3}), {"window": np.int64(10)},
                              {"seed": np.int64(3)}) == ({}, {})


def test_close_waits_at_most_its_timeout_for_a_busy_writer_which_still_writes_the_file(tmp_path, held_file):
    """``close(timeout=0.2)`` while the writer thread is busy with a file returns with the thread still running
    (a hung disk does not hang the job's exit); the file is written once the writer gets on."""
    release = threading.Event()
    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("steps", 0, 0, held_file(release, rows=2))
        sink.close(timeout=0.2)
        assert sink.closed is True and sink._thread.is_alive() and sink.written_files == 0
    finally:
        release.set()
    sink._thread.join(10)
    assert not sink._thread.is_alive() and (sink.written_files, sink.written_rows) == (1, 2)


def test_a_files_columns_are_cast_to_the_schema_it_was_submitted_with(tmp_path):
    """``submit(..., schema)`` writes the schema's types: float64 and int64 columns given for a float32 / int32
    schema come back float32 / int32 (the token files' compact columns); without a schema numpy's types stay."""
    schema = pa.schema([("step", pa.int64()), ("rank", pa.int64()), ("x", pa.float32()), ("n", pa.int32())])
    cols = {"step": np.array([3, 3]), "rank": np.array([0, 0]), "x": np.array([0.5, 1.5]), "n": np.array([7, 8])}
    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("tokens", 3, 0, cols, schema)
        sink.submit("tokens", 4, 0, {**cols, "step": np.array([4, 4])})
    finally:
        sink.close()
    t = pq.read_table(table_file(tmp_path, "tokens", 3, 0, 1))
    assert t.schema.equals(schema) and t.column("x").to_pylist() == [0.5, 1.5] and t.column("n").to_pylist() == [7, 8]
    assert pq.read_table(table_file(tmp_path, "tokens", 4, 0, 1)).schema.types == [
        pa.int64(), pa.int64(), pa.float64(), pa.int64()]


def test_a_write_error_is_warned_once_naming_table_step_and_reason_and_kept_as_last_error(tmp_path, caplog):
    """A file that cannot be written (a regular file where the table's directory goes) is warned once, with the
    table, the step and the OS error (text typed out here); its rows are dropped; the next failure is not warned
    again but becomes the last error."""
    (tmp_path / "steps").write_text("not a directory")
    caplog.set_level(logging.WARNING, logger="triage_monitor")
    sink = ParquetSink(tmp_path, attempt=1)
    try:
        sink.submit("steps", 2, 0, {"x": np.arange(3)})
        sink.flush()
        sink.submit("steps", 3, 0, {"x": np.arange(4)})
    finally:
        sink.close()
    first = f"[Errno 17] File exists: '{tmp_path / 'steps'}'"
    assert [r.getMessage() for r in caplog.records] == [
        f"triage-monitor could not write steps rows for step 2 ({first}); training continues, rows are counted as "
        "dropped"]
    assert sink.dropped_rows == 7 and sink.last_error == f"FileExistsError: {first}"


def test_removals_keep_the_queue_count_so_flush_still_waits_for_every_file(tmp_path):
    """Each queued removal counts one byte in the queue until it is done.  After 30 removals, a file queued
    behind them (or behind a slow file and a removal) is still waited for by flush; a removal that fails drops no
    row (it is reported as the last error)."""
    release = threading.Event()

    def slow_columns():
        release.wait(10)
        return {"x": np.arange(3)}

    sink = ParquetSink(tmp_path, attempt=1)
    try:
        for s in range(30):
            sink.submit_delete("tokens", s, 0, attempt=0)      # nothing to remove: no error
        sink.flush()
        assert (sink.last_error, sink.dropped_rows, sink.written_files) == (None, 0, 0)
        sink.submit("steps", 0, 0, DeferredColumns(slow_columns, 24, 3))
        threading.Timer(0.3, release.set).start()
        sink.flush()
        assert sink.written_files == 1
        release.clear()
        sink.submit("steps", 1, 0, DeferredColumns(slow_columns, 24, 3))
        sink.submit_delete("tokens", 0, 0, attempt=0)
        sink.submit("steps", 2, 0, DeferredColumns(slow_columns, 24, 3))
        threading.Timer(0.3, release.set).start()
        sink.flush()
        assert sink.written_files == 3 and sink.written_rows == 9
        table_file(tmp_path, "tokens", 5, 0, 0).mkdir(parents=True)     # a directory: unlink fails
        sink.submit_delete("tokens", 5, 0, attempt=0)
        sink.flush()
        assert sink.dropped_rows == 0 and sink.last_error.startswith(("IsADirectoryError", "PermissionError"))
    finally:
        release.set()
        sink.close()


def test_a_steps_file_starts_with_step_and_rank_and_holds_each_once(tmp_path):
    """The steps row of a step: int64 ``step`` and ``rank`` first, each column once, the step's value in it."""
    d = tmp_path / "run"
    with MismatchMonitor(d, MonitorConfig(window=2, tau_tail=-1.0), rank=1) as mon:
        mon.log_step(4, _batch(4))
    (f,) = (d / "steps").iterdir()
    t = pq.read_table(f)
    assert t.column_names[:2] == ["step", "rank"] and len(set(t.column_names)) == len(t.column_names)
    assert t.column("step").to_pylist() == [4] and t.column("rank").to_pylist() == [1]
    assert t.schema.field("step").type == pa.int64() and t.schema.field("rank").type == pa.int64()
