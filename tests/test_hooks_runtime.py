"""Hook runtime: adapters pickle as configuration, each process builds its own monitor, steps come from the
optimizer; checked in this process and in a real local Ray cluster (2 worker processes)."""

import json
import math
import os
import pickle

import cloudpickle
import pyarrow.parquet as pq
import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import TriageConfig
from triage_monitor.hooks.worker_runtime import HookSettings, LossHook, close_all, runtime_for
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
    from runfiles import parts, rows_of

    files = parts(run_dir, "tokens")
    assert sorted({s for p in files for s in range(p.lo, p.hi + 1)}) == list(range(STEPS))
    for s in range(STEPS):
        holding = [p for p in files if p.lo <= s <= p.hi]
        assert sorted(p.rank for p in holding) == ranks                 # one file per (step, rank)
        for p in holding:                                                # every token once, no duplicate
            assert rows_of(run_dir, "tokens", s, p.rank) == MICRO * B * T
    manifest = json.loads((run_dir / "run.json").read_text())
    assert len(manifest["attempts"]) == 1 and manifest["info"]["framework"] == "toy"
    attempts = {p.attempt for p in files}
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


@pytest.mark.multiprocess
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


# ---------------------------------------------------------------- rank, steps, warnings, state (one process)
def test_resolve_rank_fixed_then_env_then_atomic_claims(tmp_path, monkeypatch):
    """A fixed rank wins, then ``$RANK`` (digits only), then the smallest free claim in ``.ranks/<attempt>/``: three
    processes of attempt 5 get 0, 1, 2 (each claim file holds the claimant's pid); attempt 6 starts at 0 again."""
    from triage_monitor.hooks.worker_runtime import resolve_rank
    monkeypatch.setenv("RANK", "7")
    assert resolve_rank(tmp_path, 5, fixed=3) == 3
    assert resolve_rank(tmp_path, 5) == 7
    monkeypatch.setenv("RANK", "x7")
    assert [resolve_rank(tmp_path, 5) for _ in range(3)] == [0, 1, 2]
    monkeypatch.delenv("RANK")
    assert resolve_rank(tmp_path, 5) == 3 and resolve_rank(tmp_path, 6) == 0
    claims = tmp_path / ".ranks" / "5"
    assert sorted(p.name for p in claims.iterdir()) == ["0", "1", "2", "3"]
    assert (claims / "2").read_text() == f"{os.getpid()}\n"


def _bare_runtime(**kw):
    from triage_monitor.hooks.worker_runtime import WorkerRuntime
    return WorkerRuntime(HookSettings(run_dir=None, **kw))


def test_step_sources():
    """auto: the framework's step when given (and then optimizer steps no longer close steps); optimizer: the
    framework's step is ignored; framework: a call without one is refused with the fix."""
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.1)
    rt = _bare_runtime()
    assert rt.step_for_call(41) == 41
    rt.record(41, None)
    rt.on_optimizer_step(opt)
    assert rt.optimizer_steps == 0 and rt.step_for_call() == 0
    rt = _bare_runtime(step_source="optimizer")
    assert rt.step_for_call(41) == 0
    rt.record(0, None)
    rt.on_optimizer_step(opt)
    assert rt.step_for_call(41) == 1
    with pytest.raises(ValueError, match=r"^triage-monitor: step_source='framework' but this framework call carries "
                                         r"no step metadata; use step_source='auto' \(count optimizer steps\)$"):
        _bare_runtime(step_source="framework").step_for_call()
    assert _bare_runtime(step_source="framework").step_for_call(3) == 3


def test_set_step_counts_on_from_the_given_step():
    """set_step(7) after one optimizer step: the next calls are step 7, and the next optimizer step makes them 8."""
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.1)
    hook = make_hook_class()(HookSettings(run_dir=None))
    rt = hook.runtime
    rt.record(0, None)
    rt.on_optimizer_step(opt)
    hook.set_step(7)
    assert rt.step_for_call() == 7
    rt.record(7, None)
    rt.on_optimizer_step(opt)
    assert rt.step_for_call() == 8


def test_warns_once_after_10000_calls_without_an_optimizer_step(caplog):
    """9,999 loss calls without an optimizer step: silent; the 10,000th: one warning naming the count and the step
    all of them are logged as (set_step(10) after one optimizer step → 10); more calls do not repeat it."""
    from triage_monitor.hooks.worker_runtime import CALLS_WITHOUT_OPTIMIZER_WARNING
    assert CALLS_WITHOUT_OPTIMIZER_WARNING == 10_000
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.1)
    rt = _bare_runtime()
    rt.record(0, None)
    rt.on_optimizer_step(opt)
    rt.set_step(10)
    with caplog.at_level("WARNING", logger="triage_monitor"):
        for _ in range(9_999):
            rt.record(10, None)
        assert rt.step_for_call() == 10 and not caplog.records
        rt.record(10, None)
        rt.step_for_call()
        for _ in range(5):
            rt.record(10, None)
            rt.step_for_call()
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert msg.startswith(f"triage-monitor: 10000 loss calls and no torch.optim optimizer step seen in this process "
                          f"(pid {os.getpid()}): all of them are being logged as ONE step (10). Fix: pass the step "
                          f"yourself (hook.set_step(step) before each update, or step_source='framework' where the "
                          f"hook reads the framework's step), or make sure the optimizer is a torch.optim.Optimizer "
                          f"stepping in this process (docs/hooks.md#how-a-hook-runs-inside-the-frameworks-workers)")


def test_gate_weights_are_recorded_per_token_only_with_a_controller(tmp_path):
    """A TRIAGE hook writes each token's Gate weight next to the token; a monitoring-only hook (plain PPO) has no
    such column."""
    for triage, has in ((TriageConfig(gate_width=2, repair_width=2), True), (None, False)):
        settings = HookSettings(run_dir=str(tmp_path / f"run-{has}"), monitor=MonitorConfig(window=2,
                                calibration_steps=1), triage=triage)
        hook = make_hook_class()(settings)
        res = hook.compute_loss(TokenBatch.from_padded(*micro_batch(0, 0, 0)), agg_mode="token_mean")
        hook.close()
        from runfiles import files

        (f,) = files(tmp_path / f"run-{has}", "tokens")
        table = pq.read_table(f)
        assert ("gate_weight" in table.column_names) is has
        if has:
            assert table.column("gate_weight").to_pylist() == pytest.approx(res.output.gate_weights.tolist())


def test_state_dict_without_controller_or_monitor_and_loading_into_a_runtime_that_stepped(tmp_path):
    """A monitoring-only runtime has no controller state; one without run_dir no monitor state.  Loading a state
    into a runtime that already took optimizer steps continues at the saved step; the monitor's τ_tail and the call
    count come back."""
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.1)
    bare = _bare_runtime()
    sd = bare.state_dict()
    assert sd["controller"] is None and sd["monitor"] is None
    mon_settings = HookSettings(run_dir=str(tmp_path / "run"), monitor=MonitorConfig(window=2, calibration_steps=1))
    src = make_hook_class()(mon_settings).runtime
    state = src.state_dict()
    assert state["controller"] is None and state["monitor"]["tracker"]["tau_frozen"] is False
    state["monitor"]["tracker"].update(tau_tail=-0.7, tau_frozen=True)
    state.update(optimizer_steps=5, step_offset=2, calls=40, controller={"ignored": True})
    src.close()
    dst = make_hook_class()(HookSettings(run_dir=str(tmp_path / "run2"), monitor=MonitorConfig(window=2,
                                         calibration_steps=1))).runtime
    dst.record(0, TokenBatch.from_padded(*micro_batch(0, 0, 0)))
    dst.on_optimizer_step(opt)
    dst.load_state_dict(state)                      # a monitoring-only runtime ignores a controller state
    assert dst.step_for_call() == 7 and dst.calls == 40
    assert dst.monitor.tracker.tau_tail == -0.7 and dst.monitor.tracker.tau_frozen
    dst.close()
    bare.load_state_dict(state)                     # no monitor here: its state is ignored
    assert bare.step_for_call() == 7


def test_failures_in_the_optimizer_hook_and_at_close_are_reported_not_raised(tmp_path, monkeypatch, caplog):
    """The global optimizer post-hook and close_all() never raise into training: a failing runtime is reported
    (once per process for the optimizer hook) and the others go on."""
    hook = make_hook_class()(HookSettings(run_dir=None))
    rt = hook.runtime

    def boom(*a, **k):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(rt, "on_optimizer_step", boom)
    monkeypatch.setattr(rt, "close", boom)
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.1)
    with caplog.at_level("WARNING", logger="triage_monitor"):
        opt.step()
        opt.step()
        close_all()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs.count("triage-monitor: logging the step failed (RuntimeError: disk gone); training continues") == 1
    assert "triage-monitor: closing a hook failed (RuntimeError: disk gone)" in msgs
    monkeypatch.undo()
    rt.close()


def test_live_attributes_are_not_pickled_and_attempt_is_drawn_in_the_worker(tmp_path):
    """Attributes named ``_live*`` stay in the process; a hook built with ``attempt=None`` draws its attempt id
    where the monitor starts (no process group here: a new id, recorded in run.json)."""
    hook = make_hook_class()(HookSettings(run_dir=str(tmp_path / "run"), attempt=None))
    hook._live_cache = object()
    hook.note = "kept"
    copy = cloudpickle.loads(cloudpickle.dumps(hook))
    assert not hasattr(copy, "_live_cache") and copy.note == "kept"
    mon = hook.monitor
    assert isinstance(mon.attempt, int)
    hook.close()
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [a["attempt"] for a in manifest["attempts"]] == [mon.attempt]


def test_hook_settings_validate_and_normalise():
    with pytest.raises(ValueError, match=r"^HookSettings.step_source must be one of \('auto', 'framework', "
                                         r"'optimizer'\), got 'epoch'$"):
        HookSettings(step_source="epoch")
    with pytest.raises(ValueError, match=r"^HookSettings.on_invalid must be 'raise' or 'quarantine', got 'drop'$"):
        HookSettings(on_invalid="drop")
    from pathlib import Path
    s = HookSettings(run_dir=Path("/tmp/x"), on_invalid="quarantine", monitor={"window": 3},
                     triage={"gate_width": 4})
    assert s.run_dir == "/tmp/x" and s.on_invalid == "quarantine"
    assert isinstance(s.monitor, MonitorConfig) and s.monitor.window == 3
    assert isinstance(s.triage, TriageConfig) and s.triage.gate_width == 4
    assert HookSettings().run_dir is None


def test_in_ray_worker_is_false_in_a_plain_process():
    from triage_monitor.hooks.worker_runtime import in_ray_worker
    assert in_ray_worker() is False


def test_monitoring_only_hook_is_the_plain_ppo_loss_and_records_the_framework_step(tmp_path):
    """No TriageConfig: no controller, the loss is the framework's own PPO loss — with old = learner − 0.1 the ratio is
    e^0.1 (inside [0.8, 1.28]), ℓ = −e^0.1·A, token_sum = −e^0.1·ΣA — and no controller statistics are logged; the
    framework's step metadata names the step."""
    hook = make_hook_class()(HookSettings(run_dir=str(tmp_path / "run"), monitor=MonitorConfig(window=2,
                                          calibration_steps=1)))
    assert hook.controller is None
    lp, s, a, m = micro_batch(0, 0, 0)
    b = TokenBatch.from_padded(lp, s, a, m)
    res = hook.compute_loss(b, old_logp=b.learner_logp.detach() - 0.1, framework_step=12, agg_mode="token_sum")
    assert res.loss.item() == pytest.approx(-math.exp(0.1) * b.advantage.sum().item(), rel=1e-5)
    metrics = hook.flush()
    assert metrics["step"] == 12 and "gate_weight_mean" not in metrics
    hook.close()


def test_triage_hook_logs_its_controller_statistics_and_config(tmp_path):
    hook = make_hook_class()(_settings(tmp_path))
    res = hook.compute_loss(TokenBatch.from_padded(*micro_batch(0, 0, 0)), agg_mode="token_mean")
    metrics = hook.flush()
    assert metrics["gate_weight_mean"] == pytest.approx(res.output.stats["gate_weight_mean"])
    hook.close()
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["info"]["triage"]["gate_width"] == 2 and manifest["info"]["triage"]["repair_width"] == 2


def test_only_the_optimizer_that_steps_after_a_loss_call_counts():
    """An optimizer stepping before any loss call is not bound; the first one stepping after a loss call is, and
    another optimizer's steps are ignored from then on."""
    p = torch.nn.Parameter(torch.zeros(()))
    other, ours = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1)
    rt = _bare_runtime()
    rt.on_optimizer_step(other)
    assert rt.optimizer_steps == 0
    rt.record(0, None)
    rt.on_optimizer_step(ours)
    rt.record(1, None)
    rt.on_optimizer_step(other)
    assert rt.optimizer_steps == 1
    rt.on_optimizer_step(ours)
    assert rt.optimizer_steps == 2


def test_close_after_optimizer_steps_is_quiet_and_a_closed_runtime_is_replaced(tmp_path, caplog):
    hook = make_hook_class()(_settings(tmp_path))
    rt = hook.runtime
    with caplog.at_level("WARNING", logger="triage_monitor"):
        train(cloudpickle.dumps(hook), worker=0, close=False)
        hook.close()
    assert rt.closed and not [r for r in caplog.records if "optimizer step" in r.getMessage()]
    assert hook.runtime is not rt and not hook.runtime.closed
    hook.runtime.close()


def test_run_json_records_the_triage_config_as_plain_fields(tmp_path):
    """A TRIAGE hook's run.json carries the controller's config under ``info.triage`` as plain JSON fields (the
    values given, the defaults for the rest); a monitoring-only hook's has none."""
    import dataclasses
    cfg = TriageConfig(gate_width=2, repair_width=2)
    for triage in (cfg, None):
        run = tmp_path / f"run-{triage is not None}"
        hook = make_hook_class()(HookSettings(run_dir=str(run), monitor=MonitorConfig(window=2, calibration_steps=1),
                                              triage=triage))
        hook.compute_loss(TokenBatch.from_padded(*micro_batch(0, 0, 0)), agg_mode="token_mean")
        hook.close()
        manifest = json.loads((run / "run.json").read_text())["info"]
        if triage is None:
            assert "triage" not in manifest
        else:
            assert manifest["triage"]["gate_width"] == 2 and manifest["triage"]["repair_width"] == 2
            assert manifest["triage"] == json.loads(json.dumps(dataclasses.asdict(cfg)))


def test_the_first_runtime_of_a_process_registers_one_global_optimizer_step_hook(monkeypatch):
    """A process whose first hook runtime starts registers torch's global optimizer-step hook once: every optimizer
    of the process then reaches the runtimes (optimizer-counted steps need it); a second runtime adds no second
    hook.  (The process-wide hook is already registered by earlier tests: it is set aside here, and the one this
    test registers is removed at its end.)"""
    from triage_monitor.hooks import _runtime

    seen = []
    monkeypatch.setattr(_runtime, "_HOOK_HANDLE", None)
    monkeypatch.setattr(_runtime, "_RUNTIMES", {})
    monkeypatch.setattr(_runtime, "_on_optimizer_step", lambda opt, args, kwargs: seen.append(opt))
    runtime_for(HookSettings(run_dir=None))
    handle = _runtime._HOOK_HANDLE
    try:
        assert handle is not None
        runtime_for(HookSettings(run_dir=None))
        assert _runtime._HOOK_HANDLE is handle
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        opt.step()
        assert seen == [opt]
    finally:
        handle.remove()
        close_all()


def test_the_hook_hands_its_process_group_to_the_monitor(tmp_path):
    """``set_group`` (in-process: a live group does not pickle): the monitor is built on that group — its rank in
    it numbers the files, its rank 0 reports — while the settings stay picklable; the same group again is a no-op,
    another one after the monitor was built is refused (a gloo world of one process here; the multi-process jobs
    run in tests/test_hooks_slime.py and tests/test_distributed.py)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        group, other = dist.new_group([0]), dist.new_group([0])
        hook = make_hook_class()(_settings(tmp_path, attempt=None))
        hook.set_group(group)
        assert cloudpickle.loads(cloudpickle.dumps(hook)).runtime is hook.runtime    # same key, same runtime
        mon = hook.monitor
        assert (mon.group, mon.rank, mon.world_size, mon.reports) == (group, 0, 1, True)
        hook.set_group(group)
        with pytest.raises(ValueError, match="set_group after this process's monitor was built"):
            hook.set_group(other)
        hook.close()
        assert json.loads((tmp_path / "run" / "run.json").read_text())["attempts"][0]["world_size"] == 1
    finally:
        close_all()
        dist.destroy_process_group()


def test_a_hooks_timers_reach_the_row_of_their_step(tmp_path, caplog):
    """add_timings maps the framework's names and adds a step's readings (verl's reward + adv = 0.75 s); the
    timings source fills the phases they lack; an unknown timer is said once and left out; readings for a step
    whose row is written go to the timings table, and fill only the phases the row lacks."""
    import logging

    from triage_monitor.offline.analysis import open_run

    rt = runtime_for(HookSettings(run_dir=str(tmp_path / "run"), monitor=MonitorConfig(), alerts=False))
    rt.timings_source = lambda step: {"update": 2.0, "generation": 99.0, "weight_sync": 0.5} if step == 1 else None
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(2, 8, generator=g) - 0.01
    batch = TokenBatch.from_padded(lp, lp - 0.1, torch.tensor([[1.0], [-1.0]]).expand(2, 8),
                                   torch.ones(2, 8, dtype=torch.bool))
    with caplog.at_level(logging.WARNING, logger="triage_monitor"):
        rt.record(1, batch)
        rt.add_timings(1, {"gen": 6.0, "reward": 0.25, "adv": 0.5, "step": 10.5, "my_timer": 1.0}, "verl")
        rt.add_timings(1, {"update_actor": 1.0, "testing": 5.0}, "verl")
        rt.record(2, batch)                            # step 1's row is written now
        rt.add_timings(1, {"gen": 1.0, "save_checkpoint": 3.0}, "verl")   # late: to the timings table
        rt.add_timings(2, {"generation": -1.0})        # not a duration
        rt.close()
    row = open_run(tmp_path / "run").steps().set_index("step").loc[1]
    assert (row["time/generation"], row["time/reward"], row["time/update"], row["time/step"]) == (6.0, 0.75, 1.0, 10.5)
    assert row["time/weight_sync"] == 0.5                 # from the source: a phase the hook's readings lacked
    assert row["time/other"] == 3.0                       # late, a phase the row lacked (verl's testing: no phase)
    late = open_run(tmp_path / "run").timings()
    assert late["step"].tolist() == [1] and late.loc[0, "time/generation"] == 1.0 and late.loc[0, "rank"] == 0
    said = [r.getMessage() for r in caplog.records]
    assert sum("['my_timer']" in m for m in said) == 1
    assert sum("not recorded" in m and "-1.0" in m for m in said) == 1
    assert math.isnan(open_run(tmp_path / "run").steps().set_index("step").loc[2, "time/generation"])
