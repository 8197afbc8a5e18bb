"""The run directory's names and index (triage_monitor.layout.RunLayout): every name of a run, what a file name
says, which file a reader takes for a step and rank, and that the writer, the reader and the hooks take their
names from it alone."""

from pathlib import Path

import pytest
import torch

from triage_monitor.rundir import layout as layout_module
from triage_monitor.offline.analysis import open_run
from triage_monitor.batch import TokenBatch
from triage_monitor.rundir.layout import (MANIFEST, TABLES, Part, RunLayout, TableIndex, block_name, parse_part,
                                   pending_name)
from triage_monitor.monitor import MismatchMonitor, MonitorConfig


def _batch(step, B=2, T=8):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.1).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool))


def test_every_name_of_a_run_directory(tmp_path):
    r = RunLayout(tmp_path / "run")
    root = tmp_path / "run"
    assert r.root == root and repr(r) == f"RunLayout({str(root)!r})" and r.is_local
    assert r.manifest == MANIFEST == "run.json"
    assert TABLES == ("tokens", "steps", "quarantine", "alerts", "timings") and r.table_dir("alerts") == "alerts"
    assert r.block("tokens", 0, 49, 2, 17, 0) == "tokens/steps-00000000-00000049-rank-0002-attempt-17-part-0.parquet"
    assert r.pending("steps", 3, 12345, 1, 4) == "steps/.pending-00000003-rank-12345-attempt-1-part-4.arrow"
    assert r.lock_name(3) == ".writer-rank-3.lock" and r.lock_file(3) == root / ".writer-rank-3.lock"
    assert r.rank_claims(1700000000123456789) == ".ranks/1700000000123456789"
    assert r.framework_dir("verl", "raysubmit_1") == ".verl/raysubmit_1"
    assert r.analysis_dir == "analysis" and r.states_cache("abc") == "analysis/states-abc.npz"
    assert r.replaced("20260102T030405Z") == tmp_path / "run.replaced-20260102T030405Z"
    assert r.replaced("20260102T030405Z", 2) == tmp_path / "run.replaced-20260102T030405Z-2"


def test_a_file_name_says_its_steps_rank_attempt_and_part_and_nothing_else_parses():
    for lo, hi, rank, attempt, part in ((0, 49, 0, 1, 0), (-5, 3, 3, 5, 2), (100, 100, 10, 1700000000123456789, 7)):
        p = parse_part("tokens", block_name(lo, hi, rank, attempt, part), 12)
        assert p == Part("tokens", lo, hi, rank, attempt, part, True, f"tokens/{block_name(lo, hi, rank, attempt, part)}",
                         12)
        q = parse_part("steps", pending_name(hi, rank, attempt, part))
        assert (q.lo, q.hi, q.rank, q.attempt, q.part, q.sealed) == (hi, hi, rank, attempt, part, False)
    old = parse_part("tokens", "step-00000007-rank-0002-attempt-9.parquet")   # the one-step files before blocks
    assert (old.lo, old.hi, old.rank, old.attempt, old.part, old.sealed) == (7, 7, 2, 9, 0, True)
    for name in (".tmp-0123.parquet", "steps-1-2-rank-0-attempt-1-part-0.parquet.tmp", "step=3", "part-5.parquet",
                 "steps-5-3-rank-0-attempt-1-part-0.parquet", "steps-x-3-rank-0-attempt-1-part-0.parquet",
                 ".pending-1-rank-0-attempt-1.arrow", "notes.txt"):
        assert parse_part("tokens", name) is None, name


def _part(lo, hi, rank, attempt, part, sealed=True):
    name = block_name(lo, hi, rank, attempt, part) if sealed else pending_name(lo, rank, attempt, part)
    return Part("tokens", lo, hi, rank, attempt, part, sealed, f"tokens/{name}")


def test_the_index_says_which_file_a_reader_takes_for_each_step_and_rank():
    """For a step: its latest attempt only (ranks the newer attempt lacks are not read), per rank the highest part
    (the step logged again), a sealed block before the pending file of the same part (the same records)."""
    a0 = [_part(0, 49, r, 1, 0) for r in (0, 1, 10)]                       # attempt 1: steps 0..49 on 3 ranks
    a1 = [_part(30, 30, 0, 2, 0, sealed=False), _part(30, 30, 1, 2, 0)]    # attempt 2 redid step 30 on 2 ranks
    again = [_part(31, 31, 0, 2, 1, sealed=False), _part(31, 32, 0, 2, 0)]  # step 31 logged twice: part 1 wins
    same = [_part(40, 40, 2, 3, 5, sealed=False), _part(40, 41, 2, 3, 5)]  # sealing under way: the block
    idx = TableIndex("tokens", a0 + a1 + again + same)
    assert idx.steps() == list(range(50)) and idx.ranks() == [0, 1, 2, 10] and len(idx) == 9
    assert [(p.rank, p.attempt) for p in idx.for_step(5)] == [(0, 1), (1, 1), (10, 1)]     # by rank as a number
    assert [(p.rank, p.attempt, p.sealed) for p in idx.for_step(30)] == [(0, 2, False), (1, 2, True)]
    assert [(p.rank, p.part) for p in idx.for_step(31)] == [(0, 1)]
    assert [(p.rank, p.part, p.sealed) for p in idx.for_step(40)] == [(2, 5, True)]
    assert [p.attempt for p in idx.for_step(30, attempt=1)] == [1, 1, 1]                    # an attempt asked for
    assert idx.for_step(60) == [] and idx.attempts()[30] == 2 and idx.attempts()[29] == 1 and idx.attempts()[40] == 3
    assert len(idx.covering(30)) == 5


def test_listing_a_table_keeps_its_files_and_skips_everything_else(tmp_path):
    r = RunLayout(tmp_path)
    (tmp_path / "tokens").mkdir()
    for name in (block_name(0, 9, 0, 5, 0), pending_name(10, 0, 5, 1), ".tmp-0123abcd.parquet", "README"):
        (tmp_path / "tokens" / name).write_bytes(b"xyz")
    (tmp_path / "tokens" / block_name(0, 9, 1, 5, 0)).mkdir()              # a directory named like a file
    idx = r.index("tokens")
    assert sorted((p.lo, p.hi, p.sealed, p.size) for p in idx.parts) == [(0, 9, True, 3), (10, 10, False, 3)]
    assert r.index("alerts").parts == [] and RunLayout(tmp_path / "none").index("steps").parts == []
    assert r.step_attempts() == {s: 5 for s in range(11)}


def test_a_steps_attempt_is_the_latest_over_the_tokens_and_the_steps_table(tmp_path):
    """A resume that redid steps 1 and 2 wrote each to one table only (its token file of step 1 failed; its steps
    row of step 2 failed): the step's attempt, whose alert and quarantine rows a reader takes, is the latest over
    both tables whichever table holds it; part and step numbers are reused by the resume, as the default layout
    does (part 0 of each attempt, the same steps)."""
    for table, files in {"tokens": [block_name(0, 1, 0, 1, 0), pending_name(2, 0, 2, 0)],
                         "steps": [block_name(0, 1, 0, 1, 0), pending_name(1, 0, 2, 0), block_name(2, 2, 0, 1, 0)]
                         }.items():
        (tmp_path / table).mkdir()
        for name in files:
            (tmp_path / table / name).write_bytes(b"xyz")
    assert RunLayout(tmp_path).step_attempts() == {0: 1, 1: 2, 2: 2}


def test_lock_files_and_whether_a_directory_holds_a_run(tmp_path):
    r = RunLayout(tmp_path / "run")
    assert r.lock_files() == [] and not r.holds_run()
    r.root.mkdir()
    for name in (".writer-rank-10.lock", ".writer-rank-2.lock", ".writer-rank-x.lock", "writer-rank-1.lock"):
        (r.root / name).write_text("")
    assert r.lock_files() == [".writer-rank-10.lock", ".writer-rank-2.lock"]
    assert [RunLayout.lock_rank(p) for p in r.lock_files()] == [10, 2] and RunLayout.lock_rank("run.json") is None
    assert not r.holds_run()
    (r.root / "quarantine").mkdir()
    assert r.holds_run()
    (r.root / "quarantine").rmdir()
    (r.root / MANIFEST).write_text("{}")
    assert r.holds_run()


def test_changing_the_naming_is_this_module_alone(tmp_path, monkeypatch):
    """Another file naming, set in the layout module alone, is what the monitor writes and what open_run reads
    back (every table, the latest attempt of a resumed step): no other module builds or parses a file's name."""
    import re

    block_re = re.compile(r"^b(-?\d+)_(-?\d+)_r(\d+)_a(\d+)_p(\d+)\.pq$")
    pending_re = re.compile(r"^\.p(-?\d+)_r(\d+)_a(\d+)_p(\d+)\.ipc$")

    def parse(table, name, size=0, mtime_ns=0):
        m = block_re.match(name)
        if m:
            lo, hi, rank, attempt, part = map(int, m.groups())
            return Part(table, lo, hi, rank, attempt, part, True, f"{table}/{name}", size, mtime_ns)
        m = pending_re.match(name)
        if m:
            s, rank, attempt, part = map(int, m.groups())
            return Part(table, s, s, rank, attempt, part, False, f"{table}/{name}", size, mtime_ns)
        return None

    monkeypatch.setattr(layout_module, "block_name", lambda lo, hi, r, a, p: f"b{lo}_{hi}_r{r}_a{a}_p{p}.pq")
    monkeypatch.setattr(layout_module, "pending_name", lambda s, r, a, p: f".p{s}_r{r}_a{a}_p{p}.ipc")
    monkeypatch.setattr(layout_module, "parse_part", parse)
    d = tmp_path / "run"
    cfg = MonitorConfig(window=2, calibration_steps=2, roll_steps=2)
    with MismatchMonitor(d, cfg, attempt=1) as mon:
        for s in range(3):
            mon.log_step(s, _batch(s), extra={"reward": float(s)})
    with MismatchMonitor(d, cfg, attempt=2) as mon:                 # a resumed job redoes step 2
        mon.log_step(2, _batch(7), extra={"reward": 20.0})
    for table in ("steps", "tokens"):
        assert sorted(p.name for p in (d / table).iterdir()) == ["b0_1_r0_a1_p0.pq", "b2_2_r0_a1_p1.pq",
                                                                 "b2_2_r0_a2_p0.pq"]
    run = open_run(d)
    assert run.step_numbers() == [0, 1, 2] and run.steps()["reward"].tolist() == [0.0, 1.0, 20.0]
    assert run.token_files(2) == [str(d / "tokens" / "b2_2_r0_a2_p0.pq")] and len(run.tokens(2)) == 16


def test_the_hooks_side_folders_come_from_the_layout(tmp_path, monkeypatch):
    """The rank claims of hooks/worker_runtime.py and verl's job folder are RunLayout's names (moved there, they follow)."""
    from triage_monitor.hooks import _runtime
    from triage_monitor.hooks import verl as verl_hook

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(RunLayout, "rank_claims", staticmethod(lambda attempt: f"claims/a{attempt}"))
    monkeypatch.setattr(RunLayout, "framework_dir", staticmethod(lambda fw, job: f"fw-{fw}/{job}"))
    assert [_runtime.resolve_rank(tmp_path, 9) for _ in range(2)] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "claims" / "a9").iterdir()) == ["0", "1"]
    assert verl_hook._job_dir(str(tmp_path), "job7") == "fw-verl/job7"
    verl_hook.publish_step(str(tmp_path), 12, "job7")
    assert (Path(tmp_path) / "fw-verl" / "job7" / "global_steps").read_text() == "12"


@pytest.mark.parametrize("location", ["s3://bucket/runs/a", "S3://bucket/runs/a?endpoint_override=h:9"])
def test_an_s3_location_is_an_object_store_named_as_given(location):
    r = RunLayout(location)
    assert not r.is_local and r.location == location and r.display == "s3://bucket/runs/a"
    with pytest.raises(ValueError, match="'s3' scheme is not supported; it must be a local path"):
        r.root
