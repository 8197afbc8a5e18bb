"""The run directory's names (triage_monitor.layout.RunLayout): every path of a run, listing a table, the latest
attempt, and that the writer, the reader and the hooks take their names from it alone."""

import re
from pathlib import Path

import pytest
import torch

from triage_monitor import layout as layout_module
from triage_monitor.analysis import open_run
from triage_monitor.batch import TokenBatch
from triage_monitor.layout import MANIFEST, TABLES, RunLayout, TableFile, parse_table_file, temp_path
from triage_monitor.monitor import MismatchMonitor, MonitorConfig


def _batch(step, B=2, T=8):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.1).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool))


def test_every_path_of_a_run_directory(tmp_path):
    r = RunLayout(tmp_path / "run")
    root = tmp_path / "run"
    assert r.root == root and repr(r) == f"RunLayout({str(root)!r})"
    assert r.manifest == root / "run.json" and MANIFEST == "run.json"
    assert TABLES == ("tokens", "steps", "quarantine", "alerts") and r.table_dir("alerts") == root / "alerts"
    assert r.table_file("tokens", 3, 2, 17) == root / "tokens" / "step-00000003-rank-0002-attempt-17.parquet"
    assert r.table_file("steps", 123456789, 12345, 1).name == "step-123456789-rank-12345-attempt-1.parquet"
    assert r.lock_file(3) == root / ".writer-rank-3.lock"
    assert r.rank_claims(1700000000123456789) == root / ".ranks" / "1700000000123456789"
    assert r.framework_dir("verl", "raysubmit_1") == root / ".verl" / "raysubmit_1"
    assert r.analysis_dir == root / "analysis" and r.states_cache("abc") == root / "analysis" / "states-abc.npz"
    assert r.replaced("20260102T030405Z") == tmp_path / "run.replaced-20260102T030405Z"
    assert r.replaced("20260102T030405Z", 2) == tmp_path / "run.replaced-20260102T030405Z-2"
    assert r.relative(root / "tokens" / "x.parquet") == "tokens/x.parquet"
    with pytest.raises(ValueError):
        r.relative(tmp_path / "elsewhere" / "x.parquet")


def test_a_table_file_name_parses_back_and_nothing_else_does():
    r = RunLayout("/runs/a")
    for key in ((0, 0, 1), (-1, 3, 5), (12, 10, 1700000000123456789)):
        assert parse_table_file(r.table_file("tokens", *key).name) == key == RunLayout.parse(r.table_file("steps", *key).name)
    for name in (".tmp-0123.parquet", "step-1-rank-0-attempt-1.parquet.tmp", "step=3", "part-5.parquet",
                 "step-1-rank-0.parquet", "step-x-rank-0-attempt-1.parquet", "notes.txt"):
        assert parse_table_file(name) is None, name


def test_listing_a_table_keeps_complete_files_and_reads_the_latest_attempt_by_rank(tmp_path):
    """``files``: every complete table file by step (hidden temporary files, a directory named like a file and
    other names are skipped); ``latest``: the step's newest attempt only, ordered by rank as a number (10 after
    2); a table without a directory lists nothing."""
    r = RunLayout(tmp_path)
    keys = [(3, 10, 5), (3, 2, 5), (3, 2, 4), (3, 0, 4), (4, 1, 4)]
    for key in keys:
        r.table_file("tokens", *key).parent.mkdir(exist_ok=True)
        r.table_file("tokens", *key).write_bytes(b"")
    r.table_file("tokens", 3, 11, 5).mkdir()                           # a directory named like a file
    temp_path(r.table_dir("tokens"), ".parquet").write_bytes(b"")     # a write under way
    (r.table_dir("tokens") / "README").write_text("")
    files = r.files("tokens")
    assert sorted(files) == [3, 4]
    assert sorted((f.step, f.rank, f.attempt) for f in files[3]) == sorted(k for k in keys if k[0] == 3)
    assert all(isinstance(f, TableFile) and f.path == r.table_file("tokens", f.step, f.rank, f.attempt)
               for fs in files.values() for f in fs)
    latest = r.latest_files("tokens")
    assert list(latest) == [3, 4]
    assert [(f.rank, f.attempt) for f in latest[3]] == [(2, 5), (10, 5)]
    assert [(f.rank, f.attempt) for f in latest[4]] == [(1, 4)]
    assert RunLayout.latest([]) == [] and r.files("alerts") == {} and RunLayout(tmp_path / "none").files("steps") == {}


def test_lock_files_and_whether_a_directory_holds_a_run(tmp_path):
    r = RunLayout(tmp_path / "run")
    assert r.lock_files() == [] and not r.holds_run()
    r.root.mkdir()
    for name in (".writer-rank-10.lock", ".writer-rank-2.lock", ".writer-rank-x.lock", "writer-rank-1.lock"):
        (r.root / name).write_text("")
    assert [p.name for p in r.lock_files()] == [".writer-rank-10.lock", ".writer-rank-2.lock"]
    assert [RunLayout.lock_rank(p) for p in r.lock_files()] == [10, 2] and RunLayout.lock_rank("run.json") is None
    assert not r.holds_run()
    r.table_dir("quarantine").mkdir()
    assert r.holds_run()
    r.table_dir("quarantine").rmdir()
    r.manifest.write_text("{}")
    assert r.holds_run()


def test_temporary_paths_are_hidden_and_new_each_time(tmp_path):
    a, b = temp_path(tmp_path, ".json"), temp_path(tmp_path, kind="probe-")
    assert re.fullmatch(r"\.tmp-[0-9a-f]{32}\.json", a.name) and re.fullmatch(r"\.tmp-probe-[0-9a-f]{32}", b.name)
    assert a.parent == tmp_path and temp_path(tmp_path, ".json") != a


def test_changing_the_naming_is_this_module_alone(tmp_path, monkeypatch):
    """Another file naming, set in RunLayout alone, is what the monitor writes and what open_run reads back (every
    table, the latest attempt of a resumed step): no other module builds or parses a table file's name."""
    pattern = re.compile(r"^s(-?\d+)_r(\d+)_a(\d+)\.pq$")

    def table_file(self, table, step, rank, attempt):
        return self.table_dir(table) / f"s{int(step)}_r{int(rank)}_a{int(attempt)}.pq"

    def parse(name):
        m = pattern.match(name)
        return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None

    monkeypatch.setattr(RunLayout, "table_file", table_file)
    monkeypatch.setattr(layout_module, "parse_table_file", parse)
    d = tmp_path / "run"
    cfg = MonitorConfig(window=2, calibration_steps=2)
    with MismatchMonitor(d, cfg, attempt=1) as mon:
        for s in range(3):
            mon.log_step(s, _batch(s), extra={"reward": float(s)})
    with MismatchMonitor(d, cfg, attempt=2) as mon:                 # a resumed job redoes step 2
        mon.log_step(2, _batch(7), extra={"reward": 20.0})
    assert sorted(p.name for p in (d / "steps").iterdir()) == ["s0_r0_a1.pq", "s1_r0_a1.pq", "s2_r0_a2.pq"]
    assert sorted(p.name for p in (d / "tokens").iterdir()) == ["s0_r0_a1.pq", "s1_r0_a1.pq", "s2_r0_a2.pq"]
    run = open_run(d)
    assert run.step_numbers() == [0, 1, 2] and run.steps()["reward"].tolist() == [0.0, 1.0, 20.0]
    assert run.token_files(2) == [str(d / "tokens" / "s2_r0_a2.pq")] and len(run.tokens(2)) == 16


def test_the_hooks_side_folders_come_from_the_layout(tmp_path, monkeypatch):
    """The rank claims of hooks/_runtime.py and verl's job folder are RunLayout's paths (moved there, they follow)."""
    from triage_monitor.hooks import _runtime
    from triage_monitor.hooks import verl as verl_hook

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(RunLayout, "rank_claims", lambda self, attempt: self.root / "claims" / f"a{attempt}")
    monkeypatch.setattr(RunLayout, "framework_dir", lambda self, fw, job: self.root / f"fw-{fw}" / job)
    assert [_runtime.resolve_rank(tmp_path, 9) for _ in range(2)] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "claims" / "a9").iterdir()) == ["0", "1"]
    assert verl_hook._job_dir(str(tmp_path), "job7") == Path(tmp_path) / "fw-verl" / "job7"
