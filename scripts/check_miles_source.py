"""Check the Miles hook and importer against Miles' OWN code (a source checkout), on CPU.  Not run by CI: Miles is
not on PyPI.  Prints the figures quoted in docs/hooks.md#miles.

    python scripts/check_miles_source.py --miles MILES_CHECKOUT --megatron MEGATRON_CORE_SITE [--only ...]

MILES_CHECKOUT: a tree of radixark/miles (``git archive 31f1ca96 | tar -x -C /tmp/miles``).  MEGATRON_CORE_SITE: a
directory holding ``megatron`` (``pip install --target DIR --no-deps megatron-core==0.16.1``: Miles' log-probs use
its ``fused_vocab_parallel_cross_entropy``).  Checks, each with Miles' own functions and tests/test_hooks_miles.py's
data:

* ``loss``: Miles' ``loss_function`` (``training_utils/loss.py``) with ``--loss-type policy_loss`` against the same
  call with ``--loss-type custom_loss --custom-loss-function-path`` naming a ``MilesTriageLoss()`` (TRIAGE off), on
  the same logits, for every case of ``test_triage_off_equals_miles_policy_loss``: loss, logits gradient, metrics;
* ``log``: 2 gloo processes (DP 2, Miles' ``ParallelState`` of real groups) train 5 steps through Miles'
  ``loss_function`` and ``aggregate_train_losses`` (``log_utils.py``) as the Megatron backend (÷ the rollout count),
  the FSDP backend (÷ the sample count) and ``--calculate-per-token-loss`` call it; the reduced ``triage/*`` against
  rank 0's steps table;
* ``dumps``: Miles' ``save_debug_train_data_for_rank`` writes the test's shards (TP 2, and CP 2 with each rank's
  slice cut by Miles' ``slice_log_prob_with_cp``); the files against tests/miles_contract.py's, and both imported;
  ``cp_response_slices`` against Miles' ``get_logits_and_tokens_offset_with_cp`` for every length up to 40, 4 CP sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _paths(opts):
    sys.path[:0] = [opts.miles, opts.megatron, str(ROOT / "tests")]


def _state(rank: int, world: int):
    """Miles' ParallelState of a DP ``world`` job (TP = CP = PP = 1) on the initialised gloo world."""
    import torch.distributed as dist
    from miles.backends.training_utils.parallel import ParallelState, set_parallel_state
    from miles.utils.ft_utils.process_group_utils import GroupInfo

    singles = [dist.new_group([r]) for r in range(world)]
    one = GroupInfo(rank=0, size=1, group=singles[rank])
    dp = GroupInfo(rank=rank, size=world, group=dist.group.WORLD)
    state = ParallelState(intra_dp=dp, intra_dp_cp=dp, cp=one, tp=one, pp=one, ep=one, etp=one,
                          indep_dp=GroupInfo(rank=0, size=1, group=None))
    set_parallel_state(state)
    return state


def _args(**kw):
    from test_hooks_miles import miles_args
    a = miles_args(**kw)
    for k, v in dict(recompute_loss_function=False, use_dynamic_global_batch_size=False, true_on_policy_mode=False,
                     log_probs_chunk_size=-1, kl_loss_coef=0.0, use_unbiased_kl=False).items():
        setattr(a, k, v)
    return a


HOOK = """
from triage_monitor.hooks.miles import MilesTriageLoss
from triage_monitor.controller import TriageConfig
from triage_monitor.alert_rules import Rule
triage_off = MilesTriageLoss()
triage_on = MilesTriageLoss({run!r}, triage=TriageConfig(gate_width=4, calibration=dict(window=1)),
                            alerts=[Rule(name="rho_asym_above_2", metric="window/rho_asym", condition="above",
                                         threshold=2.0, hold=2)])
"""


def _init(rank, world, port):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def check_loss(opts):
    _paths(opts)
    import torch
    _init(0, 1, 29600 + os.getpid() % 300)
    _state(0, 1)
    from miles.backends.training_utils.loss import loss_function
    from test_hooks_miles import GBS, ICEPOP, amplifying_step, slime_micro_batch

    out = Path(opts.out)
    (out / "triage_miles_check.py").write_text(HOOK.format(run=str(out / "loss_run")))
    sys.path.insert(0, str(out))
    cases = [{}, {"eps_clip_c": 1.05}, {"calculate_per_token_loss": True}, {"use_rollout_logprobs": True},
             {"entropy_coef": 0.01}, {"observe_training_entropy": True}, {"use_tis": True, "tis_clip": 1.2},
             {"get_mismatch_metrics": True, "tis_clip": 1.3, "tis_clip_low": 0.8},
             {"use_tis": True, "custom_tis_function_path": ICEPOP, "tis_clip": 1.4, "tis_clip_low": 0.7},
             {"skip_actor_forward_only": True}]
    samples = amplifying_step(3)
    for kw in cases:
        worst = {"loss": 0.0, "grad": 0.0, "metric": 0.0}
        missing = set()
        for idx in ([0, 2, 3], [1, 4, 5]):
            mb, logits = slime_micro_batch(samples, idx, torch.zeros(()))
            res = []
            for loss_type in ("policy_loss", "custom_loss"):
                a = _args(**kw, loss_type=loss_type, custom_loss_function_path="triage_miles_check.triage_off")
                lg = logits.clone().requires_grad_(True)
                loss, _, log = loss_function(a, dict(mb), 2, lg, apply_megatron_loss_scaling=True, num_rollouts=GBS)
                loss.backward()
                res.append((loss.detach(), lg.grad, dict(zip(log["keys"], log["values"][1:].tolist()))))
            (l1, g1, m1), (l2, g2, m2) = res
            worst["loss"] = max(worst["loss"], abs(float(l1 - l2)))
            worst["grad"] = max(worst["grad"], float((g1 - g2).abs().max()))
            missing |= set(m1) - set(m2)
            worst["metric"] = max([worst["metric"]] + [abs(m1[k] - m2[k]) for k in m1 if k in m2])
        print(f"loss {kw or 'default'}: max |Δloss| {worst['loss']:.2g}, |Δgrad| {worst['grad']:.2g}, "
              f"|Δmetric| {worst['metric']:.2g}; Miles' metrics missing: {sorted(missing) or 'none'}")


def _miles_function(module_file: str, name: str, namespace: dict):
    """Miles' own function ``name``, compiled from its source file with the names it uses: ``log_utils`` imports
    ``data`` → the chat templates → SGLang (the rollout engine, which does not install on a CPU), so the module itself
    is not imported; the function's code is Miles' as it is in the checkout."""
    import ast

    path = Path(sys.modules["miles"].__path__[0]).parent / module_file
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
    exec(code, namespace)
    return namespace[name]


def _log_worker(rank, world, opts, port, out, results):
    _paths(opts)
    import torch
    import torch.distributed as dist
    _init(rank, world, port)
    _state(rank, world)
    import miles
    from miles.backends.training_utils.loss import loss_function
    from miles.backends.training_utils.parallel import get_parallel_state
    from miles.utils.ft_utils.process_group_utils import MultiPGUtil
    aggregate_train_losses = _miles_function("miles/backends/training_utils/log_utils.py", "aggregate_train_losses",
                                             {"torch": torch, "dist": dist, "get_parallel_state": get_parallel_state,
                                              "MultiPGUtil": MultiPGUtil, "miles": miles})
    from test_hooks_miles import GBS
    from test_hooks_slime import PARTITION, amplifying_step, slime_micro_batch
    from triage_monitor.hooks.worker_runtime import close_all

    sys.path.insert(0, out)
    for mode in ("megatron", "fsdp", "per-token"):
        run = Path(out) / f"log_{mode}"
        (Path(out) / f"triage_miles_log_{mode.replace('-', '_')}.py").write_text(HOOK.format(run=str(run)))
        a = _args(train_backend="fsdp" if mode == "fsdp" else "megatron", calculate_per_token_loss=mode == "per-token",
                  loss_type="custom_loss",
                  custom_loss_function_path=f"triage_miles_log_{mode.replace('-', '_')}.triage_on")
        param = torch.zeros((), requires_grad=True)
        opt = torch.optim.SGD([param], lr=0.0)
        logged = []
        for step in range(5):
            samples = amplifying_step(step)
            losses = []
            for mb_idx in ([0, 1], [2]):
                mb, logits = slime_micro_batch(samples, [PARTITION[rank][j] for j in mb_idx], param)
                loss, _, log = loss_function(a, mb, 2, logits, apply_megatron_loss_scaling=mode != "fsdp",
                                             num_rollouts=GBS)
                loss.backward()
                losses.append(log)
            opt.step()
            opt.zero_grad()
            logged.append(aggregate_train_losses(losses, GBS if mode == "megatron" else None))
        close_all()
        if rank == 0:
            (Path(out) / f"logged_{mode}.json").write_text(json.dumps(logged))
    dist.barrier()
    dist.destroy_process_group()


def check_log(opts):
    _paths(opts)
    import torch.multiprocessing as mp
    out = str(Path(opts.out))
    mp.spawn(_log_worker, args=(2, opts, 29950 + os.getpid() % 40, out, None), nprocs=2, join=True)
    import recording_tracker
    from triage_monitor.alerting.trackers import CURATED_KEYS
    for mode in ("megatron", "fsdp", "per-token"):
        logged = json.loads((Path(out) / f"logged_{mode}.json").read_text())
        steps = recording_tracker.steps_table(Path(out) / f"log_{mode}")
        worst, n = 0.0, 0
        for s in range(1, 5):
            assert round(logged[s]["triage/metrics_step"]) == s - 1
            for k in CURATED_KEYS:
                if k in ("gate_downweighted_frac", "alerts_active"):     # each rank's own / rank 0's only
                    continue
                v, got = steps.loc[s - 1, k], logged[s].get(f"triage/{k}")
                if got is None or not math.isfinite(v):
                    continue
                worst, n = max(worst, abs(got - v) / max(abs(v), 1e-12)), n + 1
        alerts = recording_tracker.alerts_table(Path(out) / f"log_{mode}")
        print(f"log {mode} (DP 2): {n} all-reduced curated values of steps 1-4 vs rank 0's steps table, max rel. diff "
              f"{worst:.2g}; "
              f"triage/alerts_active in the log: {'triage/alerts_active' in logged[1]}; alerts {alerts['rule'].tolist()} "
              f"at steps {alerts['step'].tolist()}; Miles' keys: {sorted(k for k in logged[1] if '/' not in k)}")


def check_dumps(opts):
    _paths(opts)
    import torch
    from miles.backends.training_utils import cp_utils
    from miles.utils.train_dump_utils import save_debug_train_data_for_rank

    from test_hooks_miles import miles_shard, rollout, write_dumps
    from triage_monitor.hooks.slime_dumps import cp_response_slices, miles_steps

    out = Path(opts.out)
    rollouts = {0: rollout(20), 1: rollout(21)}
    same = True
    for name, cp in (("tp2", 1), ("cp2", 2)):
        mine = write_dumps(out, rollouts, f"contract_{name}", tp=2, cp=cp)
        real = []
        for path in mine:
            obj = torch.load(path, weights_only=True)
            rd = miles_shard(rollouts[obj["rollout_id"]], (obj["rank"] // (2 * cp)) % 2)
            if cp > 1:                                             # Miles' own slicing, with this rank's cp state
                state = cp_utils.get_parallel_state()
                object.__setattr__(state.cp, "rank", obj["cp_rank"])
                object.__setattr__(state.cp, "size", cp)
                for key in ("log_probs", "rollout_log_probs", "advantages"):
                    rd[key] = [cp_utils.slice_log_prob_with_cp(v, t, r) for v, t, r in
                               zip(rd[key], rd["total_lengths"], rd["response_lengths"])]
                object.__setattr__(state.cp, "rank", 0)
                object.__setattr__(state.cp, "size", 1)
            a = argparse.Namespace(save_debug_train_data=str(out / f"real_{name}" / "{rollout_id}_{rank}.pt"),
                                   qkv_format="thd")
            save_debug_train_data_for_rank(a, rollout_id=obj["rollout_id"], rollout_data=rd, rank=obj["rank"],
                                           cp_rank=obj["cp_rank"], cp_size=obj["cp_size"])
            real.append(out / f"real_{name}" / path.name)
        sys.path.insert(0, str(ROOT / "scripts"))
        from check_slime_source import _same
        for a, b in zip(real, mine):
            x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
            same &= _same(x, y)
        info: dict = {}
        tokens = {step: int(b.num_tokens) for step, b in miles_steps(map(str, real), info=info)}
        print(f"dumps {name}: {len(real)} files written by Miles' writer, identical to tests/miles_contract.py's: "
              f"{same}; imported tokens per rollout {tokens} (valid: "
              f"{ {k: sum(int(m.sum()) for m in v['loss_masks']) for k, v in rollouts.items()} }), "
              f"replica files dropped {info['replica_files_dropped']}")
    bad = 0
    for cp in (2, 3, 4, 8):
        for total in range(2, 41):
            for resp in range(1, total):
                for r in range(cp):
                    _, _, logits_offset, _ = cp_utils.get_logits_and_tokens_offset_with_cp(
                        total, resp, "thd", None, cp_rank=r, cp_size=cp)
                    theirs = [(lo - (total - resp - 1), hi - (total - resp - 1)) for lo, hi in logits_offset if hi > lo]
                    bad += theirs != cp_response_slices(total, resp, r, cp)
    print(f"cp_response_slices vs Miles' get_logits_and_tokens_offset_with_cp: {bad} differences over all lengths "
          "up to 40, CP 2/3/4/8")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--miles", required=True)
    p.add_argument("--megatron", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--only", choices=("loss", "log", "dumps"))
    opts = p.parse_args()
    opts.out = opts.out or tempfile.mkdtemp(prefix="miles-check-")
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    commit = Path(opts.miles, ".git").exists() and os.popen(f"git -C {opts.miles} rev-parse HEAD").read().strip()
    print(f"Miles source {opts.miles} {commit or ''}; output in {opts.out}")
    if opts.only in (None, "dumps"):
        import torch.multiprocessing as mp
        mp.spawn(_in_process, args=(check_dumps, opts), nprocs=1, join=True)
    if opts.only in (None, "loss"):
        import torch.multiprocessing as mp
        mp.spawn(_in_process, args=(check_loss, opts), nprocs=1, join=True)
    if opts.only in (None, "log"):
        check_log(opts)


def _in_process(_, fn, opts):
    if fn is check_dumps:
        _paths(opts)
        _init(0, 1, 29500 + os.getpid() % 90)
        _state(0, 1)
    fn(opts)


if __name__ == "__main__":
    main()
