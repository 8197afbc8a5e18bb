"""Reading back a run whose ranks reuse sample ids: two ``MismatchMonitor`` processes in one gloo group, each
building its batch with ``TokenBatch.from_padded`` **without** ``sample_ids=`` (the README's multi-rank pattern:
the default ids 0 … B−1 on every rank), with different values on each rank.

``Run.token_batch`` / ``Run.iter_batches`` must key the responses by (rank, sample_id): every response of every rank
is its own response of the batch, holding exactly that rank's tokens; the dashboard's drill-down shows every step.

Each rank runs this file as a script (``python tests/test_rank_reader.py <rank> <world> <dir>``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from triage_monitor.batch import TokenBatch  # noqa: E402

pytestmark = pytest.mark.multiprocess

B, T, STEPS, WORLD = 5, 24, 4, 2


def rank_batch(step: int, rank: int):
    """(learner, sampler, advantages, mask) of one rank at one step: values differ on every rank and step (the
    seed holds both), response lengths differ, so a response of rank 0 and the same row of rank 1 differ in their
    token count as well as their values."""
    g = torch.Generator().manual_seed(100 * step + 17 * rank + 1)
    s = -torch.rand(B, T, generator=g) * 3 - rank
    lp = (s + torch.randn(B, T, generator=g) * 0.3).clamp(max=0)
    lengths = torch.tensor([T - 3 * i - 2 * rank for i in range(B)])
    mask = torch.arange(T)[None] < lengths[:, None]
    adv = torch.randn(B, generator=g) + rank
    return lp, s, adv, mask


def worker(rank: int, world: int, outdir: str) -> None:
    import torch.distributed as dist

    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    out = Path(outdir)
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=world)
    with MismatchMonitor(out / "run", MonitorConfig(window=2, calibration_steps=2, metrics={"segment_width": 8})) as mon:
        for step in range(STEPS):
            mon.log_step(step, TokenBatch.from_padded(*rank_batch(step, rank)))   # default ids 0 … B−1
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    from ranks import run_ranks

    d = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run_ranks(__file__, lambda r: (r, WORLD, d), WORLD, env, what="two ranks reusing sample ids")
    return d / "run"


def test_token_batch_keeps_ranks_that_reuse_sample_ids_apart(two_rank_run):
    from triage_monitor.offline.analysis import open_run

    run = open_run(two_rank_run)
    seen = []
    for step, batch in run.iter_batches():
        seen.append(step)
        who = run.responses(step)
        assert batch.num_samples == WORLD * B == len(who)
        # renumbered 0 … S−1 in (sample_id, rank) order: the ids collide, so the recorded ones cannot key the batch
        assert batch.sample_id.tolist() == who["batch_id"].tolist() == list(range(WORLD * B))
        assert list(zip(who["sample_id"], who["rank"])) == [(i, r) for i in range(B) for r in range(WORLD)]
        assert batch.num_valid.tolist() == who["n_tokens"].tolist()
        for k, (r, i) in enumerate(zip(who["rank"], who["sample_id"])):
            lp, s, adv, mask = rank_batch(step, int(r))
            mine = batch.sample_index == k
            assert torch.equal(batch.learner_logp[mine], lp[i][mask[i]]), (step, r, i)
            assert torch.equal(batch.sampler_logp[mine], s[i][mask[i]]), (step, r, i)
            assert torch.equal(batch.advantage[mine], adv[i].expand(int(mask[i].sum()))), (step, r, i)
            assert batch.position[mine].tolist() == torch.nonzero(mask[i]).flatten().tolist()
        # one rank alone: its recorded ids and exactly its tokens
        for r in range(WORLD):
            one = run.token_batch(step, rank=r)
            lp, s, adv, mask = rank_batch(step, r)
            ref = TokenBatch.from_padded(lp, s, adv, mask)
            assert one.sample_id.tolist() == list(range(B))
            for k in ("learner_logp", "sampler_logp", "advantage", "position", "sample_index"):
                assert torch.equal(getattr(one, k), getattr(ref, k)), (step, r, k)
            assert run.responses(step, rank=r)["batch_id"].tolist() == list(range(B))
    assert seen == list(range(STEPS))
    with pytest.raises(KeyError, match="no token records of rank 5"):
        run.token_batch(0, rank=5)


def test_token_batch_keeps_recorded_ids_that_are_unique_over_the_ranks(tmp_path):
    """Hooks that pass global ids (rank r holds ids r, r + 2, …): the batch keeps the recorded ids."""
    from triage_monitor.offline.analysis import open_run
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    for r in range(WORLD):
        with MismatchMonitor(tmp_path / "run", MonitorConfig(tau_tail=-1.0), rank=r, attempt=1) as mon:
            mon.log_step(0, TokenBatch.from_padded(*rank_batch(0, r), sample_ids=torch.arange(B) * WORLD + r))
    run = open_run(tmp_path / "run")
    batch, who = run.token_batch(0), run.responses(0)
    assert batch.sample_id.tolist() == list(range(WORLD * B)) == who["sample_id"].tolist()
    assert who["rank"].tolist() == [i % WORLD for i in range(WORLD * B)]
    lp, s, adv, mask = rank_batch(0, 1)
    assert torch.equal(batch.learner_logp[batch.sample_index == 3], lp[1][mask[1]])      # id 3 = rank 1, row 1


def test_dashboard_drill_down_shows_every_step_of_the_two_rank_run(monkeypatch, two_rank_run):
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from triage_monitor.offline.analysis import open_run
    from triage_monitor.dashboards import launch

    run = open_run(two_rank_run)
    monkeypatch.setenv("TRIAGE_MONITOR_RUNS", str(two_rank_run))
    at = AppTest.from_file(str(launch.app_path()), default_timeout=180).run()
    assert not at.exception, [e.message for e in at.exception]
    for step in range(STEPS):
        at.select_slider(key="step").set_value(step).run()
        assert not at.exception, [e.message for e in at.exception]
        assert not any("not readable" in w.value for w in at.warning), [w.value for w in at.warning]
        picker = at.selectbox(key="response")
        assert len(picker.options) == WORLD * B
        who = run.responses(step)
        # pick rank 1's response 2: its own tokens, not rank 0's response 2
        k = int(who.index[(who["rank"] == 1) & (who["sample_id"] == 2)][0])
        picker.set_value(int(who.at[k, "batch_id"])).run()
        assert not at.exception, [e.message for e in at.exception]
        assert "rank 1 · id 2" in at.selectbox(key="response").format_func(int(who.at[k, "batch_id"]))
        import json
        figs = [json.loads(el.proto.spec) for el in at.get("plotly_chart")]
        resp = [f for f in figs if f["layout"]["title"]["text"].startswith("Response ")]
        assert len(resp) == 1
        delta = next(d for d in resp[0]["data"] if d.get("meta", {}).get("column") == "delta")
        lp, s, adv, mask = rank_batch(step, 1)
        assert delta["x"] == torch.nonzero(mask[2]).flatten().tolist()
        np.testing.assert_allclose(delta["y"], (lp[2][mask[2]].double() - s[2][mask[2]].double()).numpy())


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
