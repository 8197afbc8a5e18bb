"""Check the slime hook and importer against slime's OWN code (a source checkout), on CPU.  Not run by CI:
slime is not on PyPI.  Prints the figures quoted in docs/hooks.md#slime.

    python scripts/check_slime_source.py --slime SLIME_CHECKOUT --megatron MEGATRON_CORE_SITE [--out DIR]

SLIME_CHECKOUT: a tree of THUDM/slime (e.g. ``git archive 624b824a | tar -x -C /tmp/slime``; the tag v0.3.1
works too).  MEGATRON_CORE_SITE: a directory holding ``megatron`` (``pip install --target DIR --no-deps
megatron-core==0.16.1``; 0.17+ needs Python 3.12).  Runs on a gloo world of 4 CPU processes (DP 2 × TP 2, real
``megatron.core.parallel_state``): slime's ``save_debug_train_data`` writes the dumps of tests/test_hooks_slime.py's
two rollouts, which are compared with the transcription in tests/slime_contract.py and imported; then
``SlimeTriageLoss`` is compared with slime's ``policy_loss_function`` on the same logits; last, a gloo world of 2
processes (DP 2) trains 6 steps of tests/test_hooks_slime.py's amplifying data through slime's own
``loss_function`` (``--loss-type custom_loss --custom-loss-function-path``) and ``reduce_train_step_metrics``, and
the reduced log is compared with rank 0's steps table (per-rollout mean and ``--calculate-per-token-loss``);
then the tensor- and pipeline-parallel jobs of tests/test_hooks_slime.py (4 gloo processes each, DP 2 × TP 2 and
DP 2 × PP 2, and 8 for DP 2 × TP 2 × PP 2) with the real ``initialize_model_parallel`` and slime's own
``loss_function`` (vocabulary-parallel log-probs over the TP group) and ``reduce_train_step_metrics``, checked as
that test checks its stand-in jobs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _paths(opts):
    sys.path[:0] = [opts.slime, opts.megatron, str(ROOT / "tests")]


def _writer(rank, world, opts, port):
    _paths(opts)
    from argparse import Namespace

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        from slime.observability.train_data_utils import save_debug_train_data
        head = True
    except ImportError:
        from slime.utils.train_dump_utils import save_debug_train_data
        head = False
    from test_hooks_slime import dp_shard, rollout
    for rid in (0, 1):
        save_debug_train_data(Namespace(save_debug_train_data=f"{opts.out}/real/{{rollout_id}}_{{rank}}.pt"),
                              rollout_id=rid, rollout_data=dp_shard(rollout(rid), ps.get_data_parallel_rank(),
                                                                    head=head))
    dist.barrier()
    dist.destroy_process_group()


def _same(a, b):
    import torch
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def check_writers(opts):
    import torch
    import torch.multiprocessing as mp
    mp.spawn(_writer, args=(4, opts, 29500 + os.getpid() % 400), nprocs=4, join=True)
    _paths(opts)
    import pandas as pd
    from test_hooks_slime import rollout, valid_tokens, write_v031, write_v2
    real = sorted(Path(opts.out, "real").glob("*.pt"))
    rollouts = {0: rollout(0), 1: rollout(1)}
    tmp = Path(tempfile.mkdtemp(dir=opts.out))
    head = len(real) == 2
    mine = write_v2(tmp, rollouts) if head else write_v031(tmp, rollouts)
    same = len(mine) == len(real) and all(
        _same(torch.load(r, weights_only=True), torch.load(m, weights_only=True)) for r, m in zip(real, sorted(mine)))
    print(f"writer: {len(real)} file(s) ({'format_version 2' if head else 'per-rank'}); "
          f"identical to tests/slime_contract.py's: {same}")
    out = Path(opts.out, "imported")
    r = subprocess.run([sys.executable, "-m", "triage_monitor", "import", "slime", *map(str, real), "--out", str(out),
                        "--calibration-steps", "1"], capture_output=True, text=True)
    got = pd.read_parquet(out / "steps").set_index("step")["n_tokens"].to_dict() if r.returncode == 0 else r.stderr
    print(f"import: n_tokens {got}; valid tokens {({k: valid_tokens(v) for k, v in rollouts.items()})}")


def check_loss(opts):
    _paths(opts)
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29900 + os.getpid() % 90))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy, policy_loss_function
    from test_hooks_slime import micro_batch, rollout, slime_args

    from triage_monitor.triage.controller import TriageConfig
    from triage_monitor.hooks.slime import SlimeTriageLoss

    has_dual = "eps_clip_c" in Path(opts.slime, "slime/backends/megatron_utils/loss.py").read_text()
    extra = dict(rollout_temperature=1.0, log_probs_chunk_size=-1, rollout_top_p=1.0, kl_loss_coef=0.0,
                 use_unbiased_kl=False, custom_pg_loss_reducer_function_path=None, tis_clip=2.0, tis_clip_low=0.0)

    def args_of(**kw):
        a = slime_args(**kw)
        for k, v in extra.items():
            setattr(a, k, v)
        if not has_dual:
            del a.eps_clip_c
        return a

    mb = micro_batch(rollout(6), [0, 2, 3, 5])
    g = torch.Generator().manual_seed(1)
    mb["unconcat_tokens"] = [torch.randint(0, 50, (t,), generator=g) for t in mb["total_lengths"]]
    mb["loss_masks"] = [m.to(torch.int) for m in mb["loss_masks"]]
    logits = torch.randn(1, sum(mb["total_lengths"]), 50, generator=g)
    _, out = get_log_probs_and_entropy(logits.clone(), args=args_of(), unconcat_tokens=mb["unconcat_tokens"],
                                       total_lengths=mb["total_lengths"], response_lengths=mb["response_lengths"])
    mb["log_probs"] = [lp.detach() + 0.3 * torch.randn(len(lp), generator=g) for lp in out["log_probs"]]
    mb["rollout_log_probs"] = [lp + 0.1 * torch.randn(len(lp), generator=g) for lp in mb["log_probs"]]
    cases = [{}, {"calculate_per_token_loss": True}, {"entropy_coef": 0.01}, {"get_mismatch_metrics": True}]
    if has_dual:
        cases.insert(1, {"eps_clip_c": 1.05})
    print(f"logits {tuple(logits.shape)}, {len(mb['response_lengths'])} samples")
    for kw in cases:
        args = args_of(**kw)
        ssm = get_sum_of_sample_mean(mb["total_lengths"], mb["response_lengths"], mb["loss_masks"],
                                     mb["rollout_mask_sums"], args.calculate_per_token_loss)
        l1, l2 = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        ref, ref_log = policy_loss_function(args, mb, l1, ssm)
        ours, log = SlimeTriageLoss()(args, mb, l2, ssm)
        ref.backward()
        ours.backward()
        diff = {k: abs(float(ref_log[k]) - float(log[k])) for k in ref_log}
        print(f"{kw or 'default'}: loss slime {float(ref):.9g} ours {float(ours):.9g}; "
              f"max|dgrad| {float((l1.grad - l2.grad).abs().max()):.2g}; metrics missing "
              f"{sorted(set(ref_log) - set(log))}; metrics differing > 1e-6 "
              f"{ {k: round(v, 6) for k, v in diff.items() if v > 1e-6} }")
    loss, log = SlimeTriageLoss(tempfile.mkdtemp(dir=opts.out), triage=TriageConfig())(
        args_of(), mb, logits.clone().requires_grad_(True), ssm)
    vals = torch.tensor([0] + list(log.values()))          # what slime's loss_function does with the log
    print(f"TriageConfig(): loss {float(loss):.6g}, keys {sorted(log)}, all finite {bool(torch.isfinite(vals).all())}")
    from triage_monitor.hooks.worker_runtime import close_all
    close_all()                  # before its group goes: a later optimizer step in this process must not log it
    dist.destroy_process_group()


FW_STEPS = 6
FW_MODULE = """
from triage_monitor.controller import TriageConfig
from triage_monitor.hooks.slime import SlimeTriageLoss
from triage_monitor.monitor import MonitorConfig
triage_loss = SlimeTriageLoss({run!r}, triage=TriageConfig(gate_width=4, calibration=dict(window=1)),
                              monitor=MonitorConfig(window=4, calibration_steps=2, per_rank_steps=True),
                              loggers=[{{"kind": "recorder", "path": {rec!r}}}])
# per_rank_steps: rank 1's own row too (its Gate share is compared below; by default the step has rank 0's row only)
"""


def _framework_worker(rank, world, opts, out, per_token):
    """One DP rank: the hook module imported by slime's load_function (built at import, as in every Megatron
    rank), FW_STEPS train steps of slime's loss_function on this rank's micro-batches, an optimizer step, slime's
    reduce_train_step_metrics over the DP group; rank 0 keeps the reduced logs."""
    _paths(opts)
    import json
    from argparse import Namespace

    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{out}/rdv", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    import recording_tracker
    recording_tracker.register()
    lines = recording_tracker.AlertLines()
    sys.path.insert(0, str(out))
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy, loss_function
    try:
        from slime.observability.train_metric_utils import reduce_train_step_metrics
    except ImportError:                                   # v0.3.1: the same function in cp_utils
        from slime.backends.megatron_utils.cp_utils import reduce_train_step_metrics
    import slime_contract
    from test_hooks_slime import GBS, PARTITION, amplifying_step, slime_args, slime_micro_batch

    from triage_monitor.hooks.worker_runtime import close_all
    args = Namespace(**{**vars(slime_args(calculate_per_token_loss=per_token)), "loss_type": "custom_loss",
                        "custom_loss_function_path": "triage_slime_check.triage_loss",
                        "recompute_loss_function": False, "log_probs_chunk_size": -1, "global_batch_size": GBS})
    param = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD([param], lr=0.0)
    logged, stand_in = [], 0.0
    part, schedule = PARTITION[rank], [[0, 1], [2]]
    for step in range(FW_STEPS):
        samples = amplifying_step(step)
        losses_reduced = []
        for idx in schedule:
            mb, logits = slime_micro_batch(samples, [part[j] for j in idx], param)
            kw = dict(args=args, unconcat_tokens=mb["unconcat_tokens"], total_lengths=mb["total_lengths"],
                      response_lengths=mb["response_lengths"], with_entropy=True)
            real = get_log_probs_and_entropy(logits.detach(), **kw)[1]["log_probs"]
            ours = slime_contract.get_log_probs_and_entropy(logits.detach(), **kw)[1]["log_probs"]
            stand_in = max(stand_in, max(float((a - b).abs().max()) for a, b in zip(real, ours)))
            loss, _, log = loss_function(args, mb, len(schedule), GBS, logits)
            loss.backward()
            losses_reduced.append(log)
        opt.step()
        opt.zero_grad()
        reduced = reduce_train_step_metrics(losses_reduced, calculate_per_token_loss=per_token,
                                            step_global_batch_size=GBS, cp_size=1,
                                            dp_with_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
        tokens = sum(max(int(samples[part[j]]["loss_masks"].sum()), 1) for mb_idx in schedule for j in mb_idx)
        logged.append({"log": reduced, "tokens": tokens})
        # the end of the actor's train: slime's own Timer readings of the rollout, logged by its own log_perf_data
        # (TP 0, last stage, DP 0 only) through logging_utils.log (W&B and TensorBoard off)
        from slime.observability import train_metric_utils
        from slime.observability.timer import Timer
        for name, seconds in (("train_wait", 6.0 + step), ("train", 4.0), ("data_preprocess", 0.25),
                              ("log_probs", 1.0), ("update_weights", 0.5)):
            Timer().add(name, seconds)
        train_metric_utils.log_perf_data(step, Namespace(**{**vars(args), "use_wandb": False,
                                                            "use_tensorboard": False,
                                                            "wandb_always_use_train_step": False}))
    close_all()
    dist.destroy_process_group()
    lines.remove()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "logged": logged, "alerts": lines.lines,
                                                         "stand_in_max_diff": stand_in}))


def check_framework_log(opts):
    import json
    import math

    import torch.multiprocessing as mp
    _paths(opts)
    import recording_tracker

    from triage_monitor.alerting.trackers import CURATED_KEYS
    for per_token in (False, True):
        out = Path(tempfile.mkdtemp(dir=opts.out))
        Path(out, "triage_slime_check.py").write_text(FW_MODULE.format(run=str(out / "run"),
                                                                       rec=str(out / "rec.jsonl")))
        mp.spawn(_framework_worker, args=(2, opts, str(out), per_token), nprocs=2, join=True)
        res = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
        r0, r1 = (recording_tracker.steps_table(out / "run", rank=r) for r in (0, 1))
        exact, worst, weighted = 0, 0.0, []
        for s in range(1, FW_STEPS):
            log = res[0]["logged"][s]["log"]
            assert log["triage/metrics_step"] == s - 1 or abs(log["triage/metrics_step"] - (s - 1)) < 1e-5
            t0, t1 = res[0]["logged"][s]["tokens"], res[1]["logged"][s]["tokens"]
            for k in CURATED_KEYS:
                key, v = f"triage/{k}", r0.loc[s - 1, k]
                if per_token and k == "alerts_active":
                    assert key not in log
                    continue
                if per_token and k == "gate_downweighted_frac":      # per rank: the ranks' token-weighted mean
                    want = (v * t0 + r1.loc[s - 1, k] * t1) / (t0 + t1)
                    weighted.append(abs(log[key] - want))
                    continue
                if math.isnan(v):
                    assert math.isnan(log[key]), (s, k)
                    continue
                worst = max(worst, abs(log[key] - v) / max(1.0, abs(v)))
                exact += 1
        alerts = recording_tracker.alerts_table(out / "run")
        rows = recording_tracker.read(out / "rec.jsonl")
        from triage_monitor.offline.analysis import open_run
        timed = open_run(out / "run").steps()
        want = [10.0 + s for s in range(FW_STEPS)]
        print(f"phase timings through slime's log_perf_data: time/step {timed['time/step'].tolist()} (want {want}), "
              f"time/logprob {sorted(set(timed['time/logprob']))}, time/weight_sync "
              f"{sorted(set(timed['time/weight_sync']))}, time/other {sorted(set(timed['time/other']))}: "
              f"{'equal' if timed['time/step'].tolist() == want else 'DIFFERENT'}")
        print(f"{'--calculate-per-token-loss' if per_token else 'per-rollout mean'}: {exact} curated values of "
              f"steps 1-{FW_STEPS - 1} vs rank 0's steps table, max rel diff {worst:.2g}"
              + (f"; gate_downweighted_frac vs the ranks' token-weighted mean: max diff {max(weighted):.2g}; "
                 "alerts_active not logged" if per_token else "")
              + f"; window/rho_asym rank 0 == rank 1: {bool((r0['window/rho_asym'] == r1['window/rho_asym']).all())}"
              f"; alerts {list(zip(alerts['step'], alerts['rule'], alerts['rank']))}, log lines per rank "
              f"{[len(r['alerts']) for r in res]}, recorder pids == rank 0's: "
              f"{sorted({r['pid'] for r in rows}) == [res[0]['pid']]}; attempts in the tokens "
              f"{sorted(set(pd_tokens(out)))}; stand-in get_log_probs_and_entropy vs slime's: max diff "
              f"{max(r['stand_in_max_diff'] for r in res):.2g}")


def pd_tokens(out):
    import pandas as pd
    return pd.read_parquet(Path(out) / "run" / "tokens")["attempt"].tolist()


def check_parallel(opts):
    """tests/test_hooks_slime.py's DP × TP × PP jobs on the real Megatron parallel state and slime's own loss path."""
    import time

    _paths(opts)
    import slime_contract
    from test_hooks_slime import check_parallel_job, run_parallel_job

    saved = slime_contract.install_slime_modules()     # the single-process reference of the checks: the stand-ins
    env = {"TRIAGE_SLIME_SOURCE": opts.slime, "PYTHONPATH": os.pathsep.join([str(ROOT), opts.slime, opts.megatron])}
    try:
        for tp, pp in ((2, 1), (1, 2), (2, 2)):
            out = Path(tempfile.mkdtemp(dir=opts.out))
            start = time.time()
            results = run_parallel_job(out, tp, pp, world=2 * tp * pp, env=env)
            wall = time.time() - start
            worst = check_parallel_job(out, tp, pp, results, rtol=1e-5, atol=1e-6)
            reporter = [r["rank"] for r in results if r["reports"]]
            print(f"DP 2 x TP {tp} x PP {pp} ({2 * tp * pp} processes, {wall:.0f} s): ran through; files of DP ranks "
                  f"0-1 only, every token once; metrics vs one process on both shards (stand-in log-probs): max abs "
                  f"diff {worst:.2g}; reporting (alert, tracker, run.json) global rank {reporter}; slime's step log = "
                  f"its steps table")
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slime", required=True)
    p.add_argument("--megatron", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--only", choices=("writers", "loss", "framework-log", "parallel"), default=None,
                   help="run one of the checks (default: all)")
    opts = p.parse_args()
    opts.out = opts.out or tempfile.mkdtemp(prefix="slime-check-")
    p_only = opts.only
    if p_only in (None, "writers"):
        check_writers(opts)
    if p_only in (None, "loss"):
        check_loss(opts)
    if p_only in (None, "framework-log"):
        check_framework_log(opts)
    if p_only in (None, "parallel"):
        check_parallel(opts)


if __name__ == "__main__":
    main()
