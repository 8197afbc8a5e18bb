"""Hook runtime: adapters pickle as configuration, each process builds its own monitor, steps come from the
optimizer; checked in this process and in a real local Ray cluster (2 worker processes)."""

import json
import os
import pickle

import cloudpickle
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageConfig
from triage_monitor.hooks._runtime import HookSettings, LossHook, close_all, runtime_for
from triage_monitor.monitor import MonitorConfig

STEPS, MICRO, B, T = 3, 4, 2, 5


def make_hook_class():
    """A minimal loss hook (defined in a function so cloudpickle ships it by value to Ray workers)."""

    class ToyHook(LossHook):
        def __init__(self, settings):
            self.settings = settings

        def __call__(self, learner, sampler, adv, mask, sample_offset=0):
            batch = TokenBatch.from_padded(learner, sampler, adv, mask)
            return self.compute_loss(batch, agg_mode="token_mean").loss

    return ToyHook


def micro_batch(worker: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * worker + 10 * step + micro)
    sampler = -torch.rand(B, T, generator=g) * 2 - 0.01
    learner = sampler + 0.1 * torch.randn(B, T, generator=g)
    return learner.clamp(max=-1e-4), sampler, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.int64)


def train(hook_bytes: bytes, worker: int, reship_every_call: bool = True, close: bool = True) -> dict:
    """3 optimizer steps of 4 micro-batches; the hook is unpickled again on every call (NeMo RL ships the loss
    object with every train call)."""
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.1)
    hook = pickle.loads(hook_bytes)
    for step in range(STEPS):
        for micro in range(MICRO):
            if reship_every_call:
                hook = pickle.loads(hook_bytes)
            learner, sampler, adv, mask = micro_batch(worker, step, micro)
            loss = hook((learner + w).clamp(max=-1e-4), sampler, adv, mask)
            loss.backward()
        opt.step()
        opt.zero_grad()
    rt = hook.runtime
    out = {"pid": os.getpid(), "calls": rt.calls, "controller_calls": rt.controller.calls,
           "optimizer_steps": rt.optimizer_steps, "rank": rt.monitor.rank, "state": rt.state_dict()}
    if close:
        close_all()
    return out


def _settings(tmp_path, **kw):
    return HookSettings(run_dir=str(tmp_path / "run"), monitor=MonitorConfig(window=2, calibration_steps=1),
                        triage=TriageConfig(gate_width=2, repair_width=2), manifest={"framework": "toy"}, **kw)


def _check_run(run_dir, ranks):
    from triage_monitor.records import parse_table_file
    files = {parse_table_file(p.name): p for p in (run_dir / "tokens").iterdir()}
    assert sorted({s for s, _, _ in files}) == list(range(STEPS))
    for s in range(STEPS):
        assert sorted(r for st, r, _ in files if st == s) == ranks      # one file per (step, rank)
        for (st, r, _), f in files.items():
            if st == s:                                                  # every token once, no duplicate
                assert pq.read_table(f).num_rows == MICRO * B * T
    manifest = json.loads((run_dir / "run.json").read_text())
    assert len(manifest["attempts"]) == 1 and manifest["info"]["framework"] == "toy"
    attempts = {int(pd.read_parquet(f).attempt.iloc[0]) for f in (run_dir / "tokens").rglob("*.parquet")}
    assert attempts == {manifest["attempts"][0]["attempt"]}


def test_adapter_pickles_to_configuration_only(tmp_path):
    hook = make_hook_class()(_settings(tmp_path))
    rt = hook.runtime                                 # live objects exist in this process ...
    assert rt.controller is not None
    data = cloudpickle.dumps(hook)                    # ... but never travel
    assert b"MismatchMonitor" not in data and b"TriageController" not in data
    copy = cloudpickle.loads(data)
    assert copy.runtime is rt                         # same key → same runtime in this process
    rt.close()


def test_optimizer_steps_make_the_monitored_steps_in_one_process(tmp_path):
    res = train(cloudpickle.dumps(make_hook_class()(_settings(tmp_path))), worker=0)
    assert res["calls"] == STEPS * MICRO and res["controller_calls"] == STEPS * MICRO
    assert res["optimizer_steps"] == STEPS
    _check_run(tmp_path / "run", [0])


def test_controller_state_survives_reshipping_and_resumes(tmp_path):
    settings = _settings(tmp_path)
    settings.triage = TriageConfig(gate_width=2, repair_width=2, calibration=dict(window=2))
    data = cloudpickle.dumps(make_hook_class()(settings))
    res = train(data, worker=0)
    assert res["controller_calls"] == STEPS * MICRO
    state = res["state"]
    assert state["controller"]["thresholds"] is not None      # calibrated after 2 steps, kept across re-pickling
    assert state["optimizer_steps"] == STEPS
    # resume: a new job (new hook) loads the state and continues at step 3 with the same thresholds
    resumed = make_hook_class()(_settings(tmp_path / "resumed"))
    resumed.settings.triage = settings.triage
    resumed.load_state_dict(state)
    assert resumed.controller.thresholds == state["controller"]["thresholds"]
    assert resumed.runtime.step_for_call() == STEPS
    resumed.close()


def test_without_optimizer_steps_it_says_so_loudly(tmp_path, caplog):
    hook = make_hook_class()(_settings(tmp_path))
    for micro in range(3):
        hook(*micro_batch(0, 0, micro))
    with caplog.at_level("WARNING", logger="triage_monitor"):
        hook.close()
    assert "no torch.optim optimizer step seen" in caplog.text and "set_step" in caplog.text


def test_ray_workers_write_one_run(tmp_path):
    """A real local Ray cluster: the adapter pickled into 2 worker processes, 3 optimizer steps × 4 micro-batches
    each → exactly 3 monitored steps, every token once, rank files from both workers, one run.json."""
    ray = pytest.importorskip("ray")
    tests_dir = os.path.dirname(os.path.abspath(__file__))      # workers import this module's helpers
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}})
    try:
        hook = make_hook_class()(_settings(tmp_path))
        data = cloudpickle.dumps(hook)

        @ray.remote(num_cpus=1)
        class Worker:
            def run(self, hook_bytes, worker):
                # no close(): Ray ends workers without atexit, so each optimizer step's records must already be on disk
                return train(hook_bytes, worker, close=False)

        workers = [Worker.remote() for _ in range(2)]
        results = ray.get([w.run.remote(data, i) for i, w in enumerate(workers)])
    finally:
        ray.shutdown()
    assert len({r["pid"] for r in results}) == 2 and os.getpid() not in {r["pid"] for r in results}
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["optimizer_steps"] == STEPS and r["controller_calls"] == STEPS * MICRO for r in results)
    _check_run(tmp_path / "run", [0, 1])
    assert runtime_for(hook.settings).calls == 0      # the driver never ran the loss
