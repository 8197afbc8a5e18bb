"""Many ranks for real: torch.distributed (gloo, file:// rendezvous) with 2 and 4 processes.

Each rank runs this file as a script (``python tests/test_distributed.py <rank> <world> <dir>``) on its
shard (rows ``rank::world``) of one global batch per step.  The parent process then checks, against a
single process on the concatenated batch:

* every rank wrote its own shard (a block of ``tokens/`` per rank), no collisions, the union is the global batch;
* the live global metrics (the fixed-size state all-reduced, never token values) equal the
  single-process metrics: allclose rel 1e-12 for the sums, exact for quantiles, δ_min and τ_tail, and the
  offline recomputation from the rank files equals them too;
* the controller's ``global_token`` loss, its denominator, the Repair loss and the gradient of the
  global loss (rank-local gradients put side by side) equal the single-process values.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from triage_monitor.batch import TokenBatch  # noqa: E402
from triage_monitor.triage.controller import TriageConfig, TriageController  # noqa: E402
from triage_monitor.triage.loss import policy_loss_denominator, weighted_policy_loss  # noqa: E402
from ranks import run_ranks  # noqa: E402
from triage_monitor.metrics.stats import METRIC_NAMES, MetricConfig, MetricTracker  # noqa: E402
from runfiles import parts  # noqa: E402

pytestmark = pytest.mark.multiprocess

B, T, STEPS = 12, 150, 3
MCFG = MetricConfig(segment_width=16)
WINDOW, CALIB = 2, 2


def global_batch(step):
    """Padded (B, T) tensors of one step: learner/sampler log-probs, per-response advantages, mask, ids."""
    g = torch.Generator().manual_seed(1000 + step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.1 - (torch.rand(B, T, generator=g) < 0.05) * 4).clamp(max=0)
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]) & (torch.rand(B, T, generator=g) < 0.95)
    if step == 2:
        mask[3::4] = False          # with 4 ranks, rank 3 has no valid token at step 2
    adv = torch.randn(B, generator=g)
    ids = torch.arange(B) * 7 + 3
    return lp, s, adv, mask, ids, torch.arange(B) // 4


def shard(step, rank, world):
    return tuple(t[rank::world] for t in global_batch(step))


def controller_loss(lp, s, adv, mask, ids, gids, group=None):
    """global_token weighted REINFORCE loss + Repair; returns (loss, denominator, controller output, leaf)."""
    leaf = lp.clone().requires_grad_(True)
    b = TokenBatch.from_padded(leaf, s, adv, mask, sample_ids=ids, group_ids=gids)
    out = TriageController(TriageConfig(normalization="global_token", repair_tau=-0.01), group=group)(b, step=0)
    per_token = -b.advantage * b.learner_logp
    loss = weighted_policy_loss(per_token, out.token_weights, b, "global_token", group=group)
    den = policy_loss_denominator(out.token_weights, b, "global_token", group=group)
    (loss + out.repair_loss).backward()
    return loss.detach(), den, out, leaf.grad


# ------------------------------------------------------------------------------------------- worker
def worker(rank, world, outdir):
    import torch.distributed as dist

    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    outdir = Path(outdir)
    dist.init_process_group("gloo", init_method=f"file://{outdir / 'rendezvous'}", rank=rank, world_size=world)
    res = {"metrics": []}
    cfg = MonitorConfig(metrics=MCFG, window=WINDOW, calibration_steps=CALIB)
    with MismatchMonitor(outdir / "run", cfg) as mon:
        for step in range(STEPS):
            lp, s, adv, mask, ids, gids = shard(step, rank, world)
            b = TokenBatch.from_padded(lp, s, adv, mask, sample_ids=ids, group_ids=gids)
            res["metrics"].append(mon.log_step(step, b))
    loss, den, out, grad = controller_loss(*shard(0, rank, world), group=dist.group.WORLD)
    res.update(loss=float(loss), den=float(den), repair=float(out.repair_loss), stats=out.stats, grad=grad)
    torch.save(res, outdir / f"rank{rank}.pt")
    dist.destroy_process_group()


def spawn(world, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0].decode())
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def close(a, b, rel=1e-12):
    return (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.parametrize("world", [2, 4])
def test_many_ranks_equal_single_process(world, tmp_path):
    """Agreement test: every rank's synced metrics vs one process on the concatenated batch (both
    ``MetricTracker``), and live vs offline; the single-process values are checked against the independent loop
    of tests/reference_metrics.py at the end."""
    from triage_monitor.offline.analysis import open_run

    results = spawn(world, tmp_path)

    # --- single process on the concatenated batch, same tracker settings
    tracker = MetricTracker(MCFG, WINDOW, None, CALIB)
    single = []
    for step in range(STEPS):
        lp, s, adv, mask, ids, gids = global_batch(step)
        st, win = tracker.step(step, TokenBatch.from_padded(lp, s, adv, mask, sample_ids=ids, group_ids=gids))
        single.append({**st.values, **{f"window/{k}": v for k, v in win.values.items()}})
    # independent check of the single-process reference itself: the plain loops of tests/reference_metrics.py
    from reference_metrics import reference_metrics
    for step in range(STEPS):
        lp, s, adv, mask, ids, gids = global_batch(step)
        resp = [((lp[b] - s[b])[mask[b]].double().numpy(), torch.nonzero(mask[b]).flatten().numpy(), float(adv[b]))
                for b in range(B) if mask[b].any()]
        ref = reference_metrics(resp, single[step]["tau_tail"], width=MCFG.segment_width)
        for name in ("small_gap_share", "delta_mean", "k3_kl", "rho_asym", "r_amp", "h_seg", "c_tok", "p_adj",
                     "dilution"):
            assert close(single[step][name], ref[name], 1e-9), (step, name, single[step][name], ref[name])
    exact = {"n_tokens", "n_samples", "delta_q01", "delta_q05", "delta_q50", "delta_min", "tau_tail",
             *(f"count_{r}" for r in ("amp_neg", "amp_pos", "con_neg", "con_pos"))}
    for res in results:                                   # every rank reports the global metrics
        for step in range(STEPS):
            live, ref = res["metrics"][step], single[step]
            assert not math.isnan(ref["c_tok"]) and not math.isnan(ref["rho_asym"])
            for name in [*METRIC_NAMES, *(f"window/{k}" for k in METRIC_NAMES)]:
                a, b = live[name], ref[name]
                if name.split("/")[-1] in exact:
                    assert a == b or (math.isnan(a) and math.isnan(b)), (world, step, name, a, b)
                else:
                    assert close(a, b), (world, step, name, a, b)

    # --- each rank wrote its own shard; the union is the global batch
    run = open_run(tmp_path / "run")
    assert run.manifest.attempts[0]["world_size"] == world
    attempt = run.manifest.attempts[0]["attempt"]                 # rank 0's id, shared by every rank
    assert set(run.steps(rank=None)["attempt"]) == {attempt}
    for step in range(STEPS):
        for table in ("tokens", "steps"):
            ranks = sorted(p.rank for p in parts(tmp_path / "run", table)
                           if p.lo <= step <= p.hi)            # one file per (step, rank), by its name
            empty = {3} if (table == "tokens" and step == 2 and world == 4) else set()   # no token file
            # tokens: every rank's shard; steps: the step's one row, rank 0's (the metrics are all-reduced)
            assert ranks == ([r for r in range(world) if r not in empty] if table == "tokens" else [0])
        df = run.tokens(step)
        assert set(df["attempt"]) == {attempt}
        lp, s, adv, mask, ids, gids = global_batch(step)
        assert len(df) == int(mask.sum())
        expect_rank = {int(i): r % world for r, i in enumerate(ids)}
        assert (df["sample_id"].map(expect_rank) == df["rank"]).all()
        assert df["learner_logp"].to_numpy().tolist() == lp[mask][_order(ids, mask)].tolist()
    assert len(run.steps(rank=None)) == STEPS                      # one steps row per step
    # its integrity counters are the group's: rank 3's empty response at step 2 (world 4) is counted there
    assert run.steps().set_index("step")["empty_response_count"].to_dict() == {
        st: float(sum(int((shard(st, r, world)[3].sum(1) == 0).sum()) for r in range(world))) for st in range(STEPS)}

    # --- offline from the rank files: live = offline on every metric (live tau replay), and the
    # post-mortem's one frozen tau_tail equals the live frozen value
    from triage_monitor.offline.analysis import compare_live, recompute
    cmp = compare_live(run, recompute(run, tau_mode="live"), rtol=1e-12)
    assert len(cmp) > 50 and cmp["equal"].all(), cmp[~cmp["equal"]]
    frozen = recompute(run)
    assert (frozen["tau_tail"] == results[0]["metrics"][STEPS - 1]["tau_tail"]).all()

    # --- controller: global_token loss, denominator, Repair and the gradient equal one process's
    loss, den, out, grad = controller_loss(*global_batch(0))
    assert out.repair_loss.item() > 0
    for r, res in enumerate(results):
        assert close(res["loss"], float(loss), 1e-6), (r, res["loss"], float(loss))
        assert close(res["den"], float(den), 1e-6)
        assert close(res["repair"], float(out.repair_loss.detach()), 1e-6)
        assert close(res["stats"]["repair_active_frac"], out.stats["repair_active_frac"], 1e-6)
    local = torch.zeros_like(grad)
    for r, res in enumerate(results):
        local[r::world] = res["grad"]
    torch.testing.assert_close(local, grad, rtol=1e-5, atol=1e-9)


def _order(ids, mask):
    """Flat order of the masked tokens sorted by (sample_id, position), as the records store them."""
    rows = torch.arange(B)[:, None].expand(B, T)[mask]
    pos = torch.arange(T)[None].expand(B, T)[mask]
    return torch.argsort(ids[rows] * T + pos, stable=True)


class RecordingTracker:
    """A tracker that appends what it receives to ``<dir>/tracker-rank<r>.txt`` (one line per call)."""

    def __init__(self, path):
        self.path = Path(path)

    def _write(self, line):
        with open(self.path, "a") as f:
            f.write(line + "\n")

    def log_metrics(self, step, metrics):
        self._write(f"metrics {step} {metrics['window/rho_asym']!r}")

    def emit(self, alert):
        self._write(f"alert {alert.step} {alert.rule}")

    def close(self):
        self._write("close")


def biased_shard(step, rank, world):
    """A shard whose sampler overrates the tokens: δ ~ N(−0.3, 0.3), so most A<0 mass is amplifying (A<0, δ<0)
    and little A>0 mass is (A>0, δ>0): window ρ_asym ≈ 3.7, far above the 1.8 of the ERROR rule."""
    lp, s, adv, mask, ids, gids = global_batch(step)
    g = torch.Generator().manual_seed(77 + step)
    lp = (s - 0.3 + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-1e-6)
    return tuple(t[rank::world] for t in (lp, s, adv, mask, ids, gids))


def alert_worker(rank, world, outdir):
    """Every rank builds the same monitor with the default rules and a tracker; rank 0 alone may report."""
    import logging

    import torch.distributed as dist

    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    outdir = Path(outdir)
    dist.init_process_group("gloo", init_method=f"file://{outdir / 'rendezvous'}", rank=rank, world_size=world)
    tracker = RecordingTracker(outdir / f"tracker-rank{rank}.txt")
    active, rho = [], []
    with MismatchMonitor(outdir / "run", MonitorConfig(metrics=MCFG, window=WINDOW, calibration_steps=CALIB),
                         loggers=[tracker]) as mon:
        for step in range(6):
            b = TokenBatch.from_padded(*biased_shard(step, rank, world)[:4], sample_ids=biased_shard(step, rank,
                                                                                                  world)[4])
            m = mon.log_step(step, b)
            active.append(m["alerts_active"])
            rho.append(m["window/rho_asym"])
    torch.save({"active": active, "rho": rho}, outdir / f"alerts-rank{rank}.pt")
    dist.destroy_process_group()


def test_an_alert_fires_once_per_job_not_once_per_rank(tmp_path):
    """2 gloo ranks, the default rules, a sampler biased towards amplification: window ρ_asym (the all-reduced
    one) exceeds 1.8 from step 0, so rho_asym_critical (hold 3) fires at step 2 and rho_asym_high (hold 5) at step
    4 — once each in the job: one log line, one alerts/ row (rank 0's), one tracker call (rank 0's); rank 1
    evaluates no rule (alerts_active NaN) and its tracker is never called."""
    import pandas as pd

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "alerts", str(r), "2", str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = [p.communicate(timeout=300)[0].decode() for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o
    lines = [ln for o in outs for ln in o.splitlines() if ln.startswith("triage_monitor.alerts ")]
    assert [ln.split(":")[0] for ln in lines] == ["triage_monitor.alerts ERROR triage ERROR (mismatch)",
                                                  "triage_monitor.alerts WARNING triage WARN (mismatch)"]
    assert "rho_asym_critical" in lines[0] and "at step 2" in lines[0] and "rho_asym_high" in lines[1]
    rows = pd.read_parquet(tmp_path / "run" / "alerts")
    assert sorted(zip(rows["step"], rows["rule"], rows["rank"])) == [(2, "rho_asym_critical", 0),
                                                                     (4, "rho_asym_high", 0)]
    calls = (tmp_path / "tracker-rank0.txt").read_text().splitlines()
    assert [c for c in calls if c.startswith("alert")] == ["alert 2 rho_asym_critical", "alert 4 rho_asym_high"]
    assert len([c for c in calls if c.startswith("metrics")]) == 6 and calls[-1] == "close"
    assert not (tmp_path / "tracker-rank1.txt").exists()
    r0 = torch.load(tmp_path / "alerts-rank0.pt")["active"]
    r1 = torch.load(tmp_path / "alerts-rank1.pt")["active"]
    assert r0 == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0] and all(math.isnan(v) for v in r1)
    # the synced window rho_asym that rank 0 judged and wrote in the step's one row is rank 1's too
    steps = pd.read_parquet(tmp_path / "run" / "steps")
    assert sorted(steps["rank"]) == [0] * 6
    w = steps.set_index("step")["window/rho_asym"].sort_index().tolist()
    assert w == torch.load(tmp_path / "alerts-rank1.pt")["rho"] and min(w) > 1.8



def per_rank_worker(rank, world, outdir):
    """Every rank logs 3 steps of its shard with ``per_rank_steps=True``; rank r's shard holds r + 1 padding
    sentinels (−1e10) inside its mask at every step, quarantined: a different count on every rank, so the group's
    sum (3) differs from the maximum (2) and from either rank's own count (docs/testing.md#test-data)."""
    import torch.distributed as dist

    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    outdir = Path(outdir)
    dist.init_process_group("gloo", init_method=f"file://{outdir / 'rendezvous'}", rank=rank, world_size=world)
    with MismatchMonitor(outdir / "run", MonitorConfig(tau_tail=-1.0, per_rank_steps=True)) as mon:
        for step in range(STEPS):
            lp, s, adv, mask, ids, _ = shard(step, rank, world)
            lp, mask = lp.clone(), mask.clone()
            lp[0, : rank + 1] = -1e10
            mask[0, : rank + 1] = True
            mon.log_step(step, TokenBatch.from_padded(lp, s, adv, mask, sample_ids=ids, on_invalid="quarantine"))
    dist.destroy_process_group()


def test_per_rank_steps_rows_and_counters_summed_over_the_group(tmp_path):
    """``MonitorConfig(per_rank_steps=True)`` in a 2-rank synchronised job: both ranks write a steps row of every
    step, with the same (all-reduced) metrics, and the integrity counters summed over the group — rank 0's one and
    rank 1's two quarantined sentinels per step make 3 in both rows (a maximum would give 2, a rank's own count 1
    or 2)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run_ranks(__file__, lambda r: ["perrank", r, 2, tmp_path], 2, env, "per-rank steps job")
    from triage_monitor.offline.analysis import open_run

    steps = open_run(tmp_path / "run").steps(rank=None)
    assert sorted(zip(steps["step"], steps["rank"])) == [(s, r) for s in range(STEPS) for r in range(2)]
    assert (steps["sentinel_logp_count"] == 3.0).all() and (steps["quarantined_count"] == 3.0).all()
    by_rank = steps.set_index(["rank", "step"])
    for col in ("k3_kl", "rho_asym", "n_tokens", "window/rho_asym"):
        assert by_rank.loc[0, col].tolist() == by_rank.loc[1, col].tolist(), col

SUBGROUP = [1, 3]                      # the ranks that monitor; ranks 0 and 2 never call the monitor


def subgroup_worker(rank, world, outdir):
    """A 4-rank job whose monitoring ranks are SUBGROUP: each builds a monitor syncing over that group, with the
    default rules and a tracker; ranks 0 and 2 build none and never join the monitor's collectives (a collective
    they would have to join fails after 60 s).  ``run``: files numbered by the rank in the group; ``numbered-
    globally``: the default (global) ranks."""
    import datetime
    import logging

    import torch.distributed as dist

    from triage_monitor.rundir import manifest as manifest_mod
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    outdir = Path(outdir)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{outdir / 'rendezvous'}", rank=rank, world_size=world,
                            timeout=timeout)
    sub = dist.new_group(SUBGROUP, timeout=timeout)          # every rank creates the group
    write = manifest_mod.RunManifest.write

    def counted_write(self, run_dir):                          # which processes write which run.json
        with open(outdir / "manifest-writes.txt", "a") as f:
            f.write(f"{rank} {Path(getattr(run_dir, 'display', run_dir)).name}\n")   # a location or its RunLayout
        return write(self, run_dir)

    manifest_mod.RunManifest.write = counted_write
    res = {"pid": os.getpid()}
    if rank in SUBGROUP:
        cfg = MonitorConfig(metrics=MCFG, window=WINDOW, calibration_steps=CALIB)
        tracker = RecordingTracker(outdir / f"tracker-rank{rank}.txt")
        with MismatchMonitor(outdir / "run", cfg, loggers=[tracker], group=sub, rank=dist.get_rank(sub)) as mon:
            res.update(rank=mon.rank, reports=mon.reports, world_size=mon.world_size, attempt=mon.attempt,
                       metrics=[mon.log_step(step, TokenBatch.from_padded(*biased_shard(step, rank, world)[:4],
                                                                          sample_ids=biased_shard(step, rank,
                                                                                                  world)[4]))
                                for step in range(6)])
        with MismatchMonitor(outdir / "numbered-globally", cfg, group=sub, alerts=False) as mon:
            res["global"] = (mon.rank, mon.reports)
            mon.log_step(0, TokenBatch.from_padded(*biased_shard(0, rank, world)[:4]))
    torch.save(res, outdir / f"sub-rank{rank}.pt")
    dist.barrier()                                             # after the monitoring: every rank joins this one
    dist.destroy_process_group()


def test_a_monitor_on_a_subgroup_syncs_and_reports_there(tmp_path):
    """4 gloo processes; the monitor syncs over the 2-rank subgroup [1, 3] (ranks 0 and 2 never call it): the job
    runs through, the metrics on both monitoring ranks are those of one process on their two shards, the
    reporting rank is the subgroup's rank 0 (global rank 1): the rules fire once (one log line, one alerts/ row,
    one tracker call, all its), its tracker alone is fed, the attempt id is the group's, ``world_size`` the group's
    size, and run.json is written by that process alone (the files numbered by the rank in the group, as the
    framework hooks do).  With the default, global numbering, global rank 1 still reports, and says once that no
    process of rank 0 writes that run's run.json."""
    import pandas as pd

    world = 4
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    outs = run_ranks(__file__, lambda r: ["subgroup", r, world, tmp_path], world, env, "subgroup job")
    res = {r: torch.load(tmp_path / f"sub-rank{r}.pt") for r in range(world)}
    assert all("metrics" not in res[r] for r in (0, 2))
    assert [(res[r]["rank"], res[r]["reports"], res[r]["world_size"]) for r in SUBGROUP] == [(0, True, 2),
                                                                                           (1, False, 2)]
    assert res[1]["attempt"] == res[3]["attempt"]
    # the metrics: one process on the two shards of the subgroup, the same on both ranks
    tracker = MetricTracker(MCFG, WINDOW, None, CALIB)
    for step in range(6):
        parts = [biased_shard(step, r, world) for r in SUBGROUP]
        lp, s, adv, mask, ids = (torch.cat([p[i] for p in parts]) for i in range(5))
        st, win = tracker.step(step, TokenBatch.from_padded(lp, s, adv, mask, sample_ids=ids))
        ref = {**st.values, **{f"window/{k}": v for k, v in win.values.items()}}
        for r in SUBGROUP:
            live = res[r]["metrics"][step]
            for name in [*METRIC_NAMES, *(f"window/{k}" for k in METRIC_NAMES)]:
                assert close(live[name], ref[name], 1e-9), (r, step, name, live[name], ref[name])
    # the alerts: once, from the subgroup's rank 0 (global rank 1)
    lines = {r: [ln for ln in outs[r].splitlines() if ln.startswith("triage_monitor.alerts ")] for r in range(world)}
    assert [len(lines[r]) for r in range(world)] == [0, 2, 0, 0]
    assert "rho_asym_critical" in lines[1][0] and "rho_asym_high" in lines[1][1]
    rows = pd.read_parquet(tmp_path / "run" / "alerts")
    assert sorted(zip(rows["step"], rows["rule"], rows["rank"])) == [(2, "rho_asym_critical", 0),
                                                                     (4, "rho_asym_high", 0)]
    calls = (tmp_path / "tracker-rank1.txt").read_text().splitlines()
    assert [c for c in calls if c.startswith("alert")] == ["alert 2 rho_asym_critical", "alert 4 rho_asym_high"]
    assert not (tmp_path / "tracker-rank3.txt").exists()
    assert [m["alerts_active"] for m in res[1]["metrics"]] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert all(math.isnan(m["alerts_active"]) for m in res[3]["metrics"])
    # run.json: written by global rank 1 alone, attempt and world size the group's
    writes = (tmp_path / "manifest-writes.txt").read_text().splitlines()
    assert {w for w in writes if w.endswith(" run")} == {"1 run"}
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [(a["attempt"], a["pid"], a["world_size"]) for a in manifest["attempts"]] == [
        (res[1]["attempt"], res[1]["pid"], 2)]
    # numbered by global rank: rank 1 reports all the same, and says that no process of rank 0 writes run.json
    assert [res[r]["global"] for r in SUBGROUP] == [(1, True), (3, False)]
    assert [sum("writes the run's files as rank 1" in ln for ln in outs[r].splitlines()) for r in range(world)] == \
        [0, 1, 0, 0]
    assert not any(w.endswith(" numbered-globally") for w in writes)


if __name__ == "__main__":
    if sys.argv[1] == "alerts":
        alert_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "perrank":
        per_rank_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "subgroup":
        subgroup_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


def test_resume_with_fewer_ranks_drops_the_old_attempts_extra_shards(tmp_path, monkeypatch):
    """A 4-rank job resumed on 2 ranks: a step redone by the new attempt must not mix in ranks 2-3 of the old one.

    One attempt id per process start is shared by all ranks (broadcast from rank 0); in-process, the shared
    id is pinned with monkeypatch so that four monitors act as the four ranks of one attempt.
    """
    import triage_monitor.monitor as monitor_mod
    from triage_monitor.offline.analysis import open_run

    def log(attempt, world, step):
        monkeypatch.setattr(monitor_mod, "new_attempt_id", lambda: attempt)
        for r in range(world):
            with monitor_mod.MismatchMonitor(tmp_path / "run", rank=r, attempt=attempt) as mon:
                lp, s, adv, mask, ids, gids = shard(step, r, world)
                mon.log_step(step, TokenBatch.from_padded(lp, s, adv, mask, sample_ids=ids))

    log(1, 4, 0)
    log(2, 2, 0)                                     # the same step, redone by the resumed 2-rank attempt
    df = open_run(tmp_path / "run").tokens(0)
    assert set(df["attempt"]) == {2}
    assert len(df) == int(global_batch(0)[3].sum())


def test_resume_with_more_ranks_reads_every_rank_of_the_new_attempt_only(tmp_path, monkeypatch):
    """A 2-rank job resumed on 4 ranks, redoing step 0 and going on to step 1: step 0 is read from the four shards
    of the new attempt only (not the old attempt's two as well), and the recomputed metrics of both steps equal one
    process on the whole batch."""
    import triage_monitor.monitor as monitor_mod
    from triage_monitor.offline.analysis import open_run, recompute
    from triage_monitor.metrics.stats import compute_step_metrics

    def log(attempt, world, steps):
        monkeypatch.setattr(monitor_mod, "new_attempt_id", lambda: attempt)
        for r in range(world):
            with monitor_mod.MismatchMonitor(tmp_path / "run", monitor_mod.MonitorConfig(tau_tail=-1.0), rank=r,
                                              attempt=attempt) as mon:
                for step in steps:
                    lp, s, adv, mask, ids, gids = shard(step, r, world)
                    mon.log_step(step, TokenBatch.from_padded(lp, s, adv, mask, sample_ids=ids))

    log(1, 2, [0])
    log(2, 4, [0, 1])
    run = open_run(tmp_path / "run")
    for step in (0, 1):
        df = run.tokens(step)
        assert set(df["attempt"]) == {2} and sorted(set(df["rank"])) == [0, 1, 2, 3]
        assert len(df) == int(global_batch(step)[3].sum())
    table = recompute(run).set_index("step")
    for step in (0, 1):
        lp, s, adv, mask, ids, _ = global_batch(step)
        whole = compute_step_metrics(TokenBatch.from_padded(lp, s, adv, mask, sample_ids=ids)).values
        for k in ("n_tokens", "k3_kl", "rho_asym", "small_gap_share"):
            assert table.loc[step, k] == pytest.approx(whole[k], rel=1e-12, nan_ok=True), (step, k)
