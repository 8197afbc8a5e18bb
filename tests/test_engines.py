"""`analyze` engines: this process, local worker processes and a real local Ray cluster give bit-identical
per-step states and windows; the CLI drives them; the state cache is reused."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from triage_monitor.offline.analysis import compare_live, open_run, recompute, recompute_states
from triage_monitor.batch import TokenBatch
from triage_monitor.cli import main as cli_main
from triage_monitor.monitor import MismatchMonitor, MonitorConfig

STEPS, WORLD = 6, 2


def _shard(step, rank, world=WORLD):
    g = torch.Generator().manual_seed(100 + step)
    B, T = 16, 200
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.1 - (torch.rand(B, T, generator=g) < 0.05) * 4).clamp(max=0)
    mask = torch.arange(T)[None] < torch.randint(20, T + 1, (B, 1), generator=g)
    adv = torch.randn(B, generator=g)
    ids = torch.arange(B)
    return TokenBatch.from_padded(lp[rank::world], s[rank::world], adv[rank::world], mask[rank::world],
                                  sample_ids=ids[rank::world])


def _write(d, world):
    cfg = MonitorConfig(window=3, calibration_steps=2, metrics={"segment_width": 16})
    import triage_monitor.monitor as monitor_mod

    with pytest.MonkeyPatch.context() as mp:      # one attempt id shared by the two in-process "ranks"
        mp.setattr(monitor_mod, "new_attempt_id", lambda: 7)
        mons = [MismatchMonitor(d, cfg, rank=r, attempt=7) for r in range(world)]
    for step in range(STEPS):
        for r, m in enumerate(mons):
            m.log_step(step, _shard(step, r, world))
    for m in mons:
        m.close()
    return d


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """Two ranks' token files per step (two monitors of one attempt, not synced: the files are what matters)."""
    return _write(tmp_path_factory.mktemp("engines") / "run", WORLD)


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    """The same tokens from one rank, calibrating tau_tail live."""
    return _write(tmp_path_factory.mktemp("engines1") / "run", 1)


pytestmark = pytest.mark.usefixtures("plain_main")      # spawned workers (tests/conftest.py)


def _equal(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    return a.shape == b.shape and all(
        ((x == y) | (np.isnan(x) & np.isnan(y))).all() for x, y in zip(a.to_numpy(float).T, b.to_numpy(float).T))


@pytest.mark.multiprocess
def test_workers_and_ray_are_bit_identical_to_one_process(two_rank_run, one_rank_run, monkeypatch):
    """Agreement test: the three engines vs each other and vs live, all use ``recompute_states`` /
    ``MismatchStats``; independent check: tests/test_monitor.py
    test_live_metrics_equal_an_independent_computation_from_the_records.  (The worker processes are used on this
    small run by lowering the bytes a worker must have, ``analysis.WORKER_MIN_BYTES``.)"""
    import triage_monitor.offline.analysis as analysis

    ray = pytest.importorskip("ray")
    monkeypatch.setattr(analysis, "WORKER_MIN_BYTES", 1)
    monkeypatch.setattr(analysis, "WORKER_MIN_CORES", 1)
    run = open_run(two_rank_run)
    one = recompute_states(run)
    two = recompute_states(run, workers=2)
    assert np.array_equal(one.states, two.states) and one.taus == two.taus
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = recompute_states(run, engine="ray")
        live_mode = recompute(open_run(one_rank_run), engine="ray", tau_mode="live")
    finally:
        ray.shutdown()
    assert np.array_equal(one.states, on_ray.states) and one.taus == on_ray.taus
    assert _equal(one.frame(), on_ray.frame())
    # the live replay on Ray reproduces every live value, provisional steps included
    cmp = compare_live(open_run(one_rank_run), live_mode, rtol=1e-12)
    assert cmp["equal"].all(), cmp[~cmp["equal"]]


@pytest.mark.multiprocess
def test_one_tau_for_the_run_and_the_state_cache(one_rank_run, capsys, monkeypatch):
    import triage_monitor.offline.analysis as analysis

    run = open_run(one_rank_run)
    monkeypatch.setattr(analysis, "usable_cores", lambda: 2)
    assert cli_main(["analyze", str(one_rank_run), "--workers", "2"]) == 0       # two cores: said
    assert "--workers 2: 1 used — with 2 core(s) this process already keeps two busy (decode and update " \
           "overlapped); worker processes pay from 3 cores" in capsys.readouterr().err.replace("\n", " ")
    monkeypatch.setattr(analysis, "usable_cores", lambda: 4)
    assert cli_main(["analyze", str(one_rank_run), "--workers", "2"]) == 0       # too small for workers: said
    assert "--workers 2: 1 used — a worker process pays off its start-up only with 1 GiB of token records to map " \
           "(this process maps them)" in capsys.readouterr().err.replace("\n", " ")
    monkeypatch.setattr(analysis, "WORKER_MIN_BYTES", 1)
    assert cli_main(["analyze", str(one_rank_run), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "provisional tau_tail" in out and "metrics equal the live values" in out
    cached = list((one_rank_run / "analysis").glob("states-*.npz"))
    assert len(cached) == 1
    df = pd.read_csv(one_rank_run / "analysis" / "metrics.csv")
    assert df["tau_tail"].nunique() == 1
    assert df["tau_tail"].iloc[0] == run.manifest.calibration["tau_tail"]
    again = recompute_states(run, cache=True)                # read back, not recomputed
    assert np.array_equal(again.states, recompute_states(run).states)
    live = run.steps()
    assert (live["tau_tail_frozen"] == [0, 0, 1, 1, 1, 1]).all()
    assert live["tau_tail"].iloc[0] != live["tau_tail"].iloc[-1]   # a provisional value differs from the frozen one


def test_ray_engine_without_ray_says_how_to_install(monkeypatch, two_rank_run):
    import builtins

    real = builtins.__import__

    def no_ray(name, *a, **kw):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ImportError, match=r"triage-monitor\[ray\]"):
        recompute(open_run(two_rank_run), engine="ray")
    with pytest.raises(ValueError, match="engine"):
        recompute(open_run(two_rank_run), engine="spark")
    assert not math.isnan(recompute(open_run(two_rank_run))["tau_tail"].iloc[0])


def test_chunks_cut_the_items_into_contiguous_ranges_in_order():
    """Worker processes and Ray tasks take contiguous chunks: every item once, in order, near-equal lengths."""
    from triage_monitor.offline.engines import chunks

    assert chunks(10, 4) == [range(0, 2), range(2, 5), range(5, 7), range(7, 10)]
    assert chunks(3, 8) == [range(0, 1), range(1, 2), range(2, 3)] and chunks(0, 4) == [] and chunks(5, 1) == [range(5)]
    for n in range(0, 40):
        for k in range(1, 12):
            c = chunks(n, k)
            assert [i for r in c for i in r] == list(range(n)) and len(c) == min(n, k)
            assert not c or max(map(len, c)) - min(map(len, c)) <= 1
