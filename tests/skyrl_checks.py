"""SkyRL 0.3.0 checks, run by tests/test_hooks_skyrl.py inside the side environment ``.venv-fw/skyrl-0.3.0``
(SkyRL pins transformers ≤ 5.8 and ray 2.56, which clash with the main venv).  Not collected on its own.

Everything SkyRL does here is SkyRL's own code: the batch layout (``convert_prompts_responses_to_batch_tensors``),
the advantage pre-scaling of each loss reduction (``apply_loss_reduction_to_advantages_minibatch``), the policy
losses from ``PolicyLossRegistry``, the registry sync into Ray (``sync_registries``), the worker's micro-batching
(``BatchIterator``, ``batch_to_experience``) and its loss call site (``PolicyWorkerBase.__init__`` /
``_forward_backward_micro`` / ``optim_step``).  Stand-ins replace only the GPU pieces of the worker: the FSDP
model (a tiny torch module producing the log-probs), the FSDP strategy (``backward`` / ``optimizer_step``) and
``torch.cuda.current_device``.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import cloudpickle
import pytest
import torch

from skyrl.backends.skyrl_train.utils.ppo_utils import (
    PolicyLossRegistry,
    apply_loss_reduction_to_advantages_minibatch,
    repopulate_all_registries,
)
from skyrl.train.config import AlgorithmConfig
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from triage_monitor.batch import TokenBatch
from triage_monitor.controller import TriageConfig
from triage_monitor.hooks._runtime import HookSettings, close_all
from triage_monitor.hooks.skyrl import SKYRL_LOSS_REDUCTIONS, SkyRLTriageLoss, batch_from_skyrl, register
from triage_monitor.monitor import MonitorConfig

OFF = TriageConfig(gate=False, repair=False, tis=False)
LENGTHS = [23, 9, 17, 4, 12, 30, 6, 15]          # 8 responses of 2 prompts × 4 samples (GRPO groups)
PROMPTS = [5, 5, 5, 5, 3, 3, 3, 3]
MICRO = 2                                         # micro_train_batch_size_per_gpu
MAX_SEQ_LEN = 64


def rollout(seed: int = 0, lengths=LENGTHS, prompts=PROMPTS):
    """One mini-batch laid out by SkyRL's own preprocessing: (sequences, loss_mask, rollout_logprobs, the
    per-response lists, raw advantages (B, T), learner / old log-probs (B, T))."""
    g = torch.Generator().manual_seed(seed)
    resp = [torch.randint(3, 50, (L,), generator=g).tolist() for L in lengths]
    prm = [torch.randint(3, 50, (P,), generator=g).tolist() for P in prompts]
    rl = [(-torch.rand(L, generator=g) * 2 - 0.01) for L in lengths]
    masks = []
    for L in lengths:
        m = [1] * L
        if L > 12:
            m[8:11] = [0, 0, 0]                   # tool output inside the response
        masks.append(m)
    seqs, attn, action_mask, rewards, loss_mask, rollout_lp, _ = convert_prompts_responses_to_batch_tensors(
        SimpleNamespace(pad_token_id=0), prm, resp, [[0.0] * L for L in lengths], masks,
        logprobs=[x.tolist() for x in rl])
    B, T = loss_mask.shape
    score = torch.randn(B, generator=g)
    adv = score[:, None] * action_mask                           # GRPO: one advantage per response
    learner = torch.where(action_mask > 0, rollout_lp + 0.3 * torch.randn(B, T, generator=g), torch.full((B, T), -3.0))
    old = torch.where(action_mask > 0, learner + 0.1 * torch.randn(B, T, generator=g), torch.zeros(B, T))
    return dict(sequences=seqs, attention_mask=attn, action_mask=action_mask, loss_mask=loss_mask,
                rollout=rollout_lp, rl_lists=rl, mask_lists=masks, adv=adv, score=score,
                learner=learner.clamp(max=-1e-4), old=old.clamp(max=-1e-4))


def prompt_boundaries(prompts=PROMPTS):
    out, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            out.append((start, i))
            start = i
    return out


def scaled_advantages(r, mode):
    return apply_loss_reduction_to_advantages_minibatch(
        r["adv"], r["loss_mask"], mode, micro_batch_size=MICRO, max_seq_len=MAX_SEQ_LEN,
        prompt_boundaries=prompt_boundaries())


def ppo_by_hand(logp, old, adv, lo=0.2, hi=0.2, c=None):
    r = torch.exp(logp - old)
    loss = -torch.min(r * adv, r.clamp(1 - lo, 1 + hi) * adv)
    if c is not None:
        loss = torch.where(adv < 0, torch.min(loss, -c * adv), loss)
    return loss


def skyrl_registry_fn(name):
    repopulate_all_registries()
    return PolicyLossRegistry.get(name)


# ------------------------------------------------------------------------------------------------ layout
def test_left_padded_responses_keep_their_positions():
    r = rollout()
    T = r["loss_mask"].shape[1]
    assert T == max(LENGTHS) and bool((r["loss_mask"][:, 0] == 0).any())       # SkyRL right-aligns responses
    batch = batch_from_skyrl(r["learner"], r["rollout"], r["adv"], r["loss_mask"])
    ref = TokenBatch.from_list([x for x in r["rl_lists"]], [x for x in r["rl_lists"]],
                               r["score"], [torch.tensor(m, dtype=torch.bool) for m in r["mask_lists"]])
    assert torch.equal(batch.position, ref.position)                   # 0 … L−1, tool tokens 8–10 absent
    assert torch.equal(batch.sampler_logp, ref.sampler_logp) and torch.equal(batch.num_valid, ref.num_valid)
    pos0 = batch.position[batch.sample_index == 0].tolist()
    assert pos0[:8] == list(range(8)) and 8 not in pos0 and pos0[8] == 11 and pos0[-1] == LENGTHS[0] - 1


# ------------------------------------------------------------------------------------------ loss values
@pytest.mark.parametrize("base", ["regular", "dual_clip"])
@pytest.mark.parametrize("mode", SKYRL_LOSS_REDUCTIONS)
def test_triage_off_equals_skyrl_default_loss(mode, base):
    """TRIAGE with Gate/Repair/TIS off = SkyRL's own policy loss (its function from the registry), per micro-batch
    and in gradient; the micro-batch sums give the reduction worked out by hand on the raw advantages."""
    r = rollout(seed=1)
    cfg = AlgorithmConfig(policy_loss_type=base, loss_reduction=mode, max_seq_len=MAX_SEQ_LEN, eps_clip_high=0.28)
    theirs_fn = skyrl_registry_fn(base)
    ours_fn = SkyRLTriageLoss(HookSettings(triage=OFF), base=base, algorithm=cfg)
    adv = scaled_advantages(r, mode)
    total = 0.0
    for s in range(0, len(LENGTHS), MICRO):
        rows = slice(s, s + MICRO)
        lp_a = r["learner"][rows].clone().requires_grad_(True)
        lp_b = r["learner"][rows].clone().requires_grad_(True)
        args = (r["old"][rows], adv[rows])
        kw = dict(loss_mask=r["loss_mask"][rows], rollout_logprobs=r["rollout"][rows])
        theirs, their_metrics = theirs_fn(lp_a, *args, config=cfg, **kw)
        ours, our_metrics = ours_fn(lp_b, *args, config=cfg, **kw)
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-9)
        theirs.backward()
        ours.backward()
        assert torch.allclose(lp_a.grad, lp_b.grad, rtol=1e-5, atol=1e-9)
        assert {k: our_metrics[k] for k in their_metrics} == their_metrics
        total += ours.item()
    # hand-worked reduction of the raw per-token PPO loss over the mini-batch
    c = 3.0 if base == "dual_clip" else None
    m = r["loss_mask"]
    ell = ppo_by_hand(r["learner"], r["old"], r["adv"], 0.2, 0.28, c) * m
    n_s = m.sum(1)
    B = len(LENGTHS)
    if mode == "token_mean":
        want = ell.sum() / m.sum()
    elif mode == "token_mean_legacy":
        want = sum(ell[s:s + MICRO].sum() / m[s:s + MICRO].sum() for s in range(0, B, MICRO)) / (B // MICRO)
    elif mode == "sequence_mean":
        want = (ell.sum(1) / n_s).mean()
    elif mode == "seq_mean_token_sum_norm":
        want = ell.sum() / (B * MAX_SEQ_LEN)
    else:
        want = sum(ell[a:b].sum() / m[a:b].sum() for a, b in prompt_boundaries()) / len(prompt_boundaries())
    assert total == pytest.approx(float(want), rel=1e-5)


def test_scale_is_a_masked_sum_not_a_mean():
    """One response of 23 tokens, token_mean: SkyRL divides the advantages by 23 and sums; the loss is the
    token mean of the 20 loss-mask tokens (the old adapter divided again and came out that many times too small)."""
    r = rollout(seed=2, lengths=[23], prompts=[5])
    cfg = AlgorithmConfig(loss_reduction="token_mean")
    adv = apply_loss_reduction_to_advantages_minibatch(r["adv"], r["loss_mask"], "token_mean", 1, MAX_SEQ_LEN)
    ours, _ = SkyRLTriageLoss()(r["learner"], r["old"], adv, cfg,                 # monitoring only: SkyRL's PPO
                                                          loss_mask=r["loss_mask"], rollout_logprobs=r["rollout"])
    m = r["loss_mask"]
    mean = (ppo_by_hand(r["learner"], r["old"], r["adv"]) * m).sum() / m.sum()
    assert int(m.sum()) == 20 and ours.item() == pytest.approx(mean.item(), rel=1e-6)


def test_skyrl_off_policy_correction_and_its_metrics_are_kept():
    """SkyRL's own TIS ratio and masks apply as in its loss; is_ratio_* / tis_* / mask metrics: SkyRL's values."""
    r = rollout(seed=3)
    opc = dict(tis_ratio_type="token", token_tis_ratio_clip_high=1.5, sequence_mask_metric="geometric",
               geo_mask_high=1.04, geo_mask_low=0.96, outlier_token_is_threshold_high=20.0)
    cfg = AlgorithmConfig(loss_reduction="sequence_mean")
    for k, v in opc.items():
        setattr(cfg.off_policy_correction, k, v)
    adv = scaled_advantages(r, "sequence_mean")
    kw = dict(config=cfg, loss_mask=r["loss_mask"], rollout_logprobs=r["rollout"])
    theirs, their_metrics = skyrl_registry_fn("regular")(r["learner"], r["old"], adv, **kw)
    ours, our_metrics = SkyRLTriageLoss(HookSettings(triage=OFF))(r["learner"], r["old"], adv, **kw)
    assert {"is_ratio_mean", "is_ratio_max", "tis_token_clip_high_ratio", "geo_sequence_mask_masked_ratio",
            "outlier_seq_masked_ratio", "clip_ratio"} <= set(their_metrics)
    assert 0 < their_metrics["geo_sequence_mask_masked_ratio"] < 1 and their_metrics["tis_token_clip_high_ratio"] > 0
    assert {k: our_metrics[k] for k in their_metrics} == their_metrics
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    # with TRIAGE on (its TIS off, SkyRL's TIS on): runs, reports ours under triage/, keeps SkyRL's metrics
    on = SkyRLTriageLoss(HookSettings(triage=TriageConfig(tis=False, gate_width=4, repair_width=4)), algorithm=cfg)
    loss, metrics = on(r["learner"], r["old"], adv, **kw)
    assert torch.isfinite(loss) and {k: metrics[k] for k in their_metrics} == their_metrics
    assert "triage/gate_weight_mean" in metrics and all(isinstance(v, float) for v in metrics.values())


def test_unsupported_configuration_raises_at_construction():
    with pytest.raises(ValueError, match="loss_reduction='seq_mean_token_mean' is not supported"):
        SkyRLTriageLoss(algorithm=AlgorithmConfig(loss_reduction="seq_mean_token_mean"))
    cfg = AlgorithmConfig()
    cfg.off_policy_correction.tis_ratio_type = "token"
    with pytest.raises(ValueError, match="both reweight"):
        SkyRLTriageLoss(HookSettings(triage=TriageConfig()), algorithm=cfg)
    with pytest.raises(ValueError, match="base must be one of"):
        SkyRLTriageLoss(base="gspo")
    with pytest.raises(ValueError, match="rollout_logprobs=None"):
        r = rollout()
        SkyRLTriageLoss()(r["learner"], r["old"], r["adv"], AlgorithmConfig(), loss_mask=r["loss_mask"])


# ------------------------------------------------------------------------- registry → Ray workers (real)
STEPS, MICRO_PER_STEP = 3, 4


class _Model(torch.nn.Module):
    """Stand-in for the FSDP policy: log-probs = rollout log-probs + a learnable shift (grad flows)."""

    def __init__(self):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.zeros(()))
        self.table = None

    def forward(self, sequences, num_actions, attention_mask=None, **kw):
        lp = (self.table[sequences[:, 0]] + self.shift).clamp(max=-1e-4)
        return lp, {"entropy": torch.zeros(lp.shape[0], num_actions + 1)}   # the worker slices [-A-1:-1]


class _Strategy:
    """Stand-in for the FSDP strategy: plain backward and optimizer step."""

    def backward(self, loss, model, optimizer, **kw):
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kw):
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        return None


def run_worker(rank: int, world: int, loss_name: str):
    """One SkyRL policy worker: SkyRL's own __init__ (registry lookup), micro-batching and loss call site."""
    import torch.cuda

    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
    from skyrl.backends.skyrl_train.workers.worker_utils import BaseBatchIterator, get_microbatch_iterator
    from skyrl.train.config import TrainerConfig

    torch.cuda.current_device = lambda: "cpu"                # GPU piece: the worker moves batches to the device
    cfg = TrainerConfig()
    cfg.algorithm.policy_loss_type = loss_name
    cfg.algorithm.use_kl_loss = False
    cfg.algorithm.temperature = 1.0
    cfg.micro_train_batch_size_per_gpu = len(LENGTHS) // MICRO_PER_STEP
    worker = PolicyWorkerBase(cfg=cfg, world_size=world, rank=rank, local_rank=0, master_addr="127.0.0.1",
                              master_port=29500, sequence_parallel_size=1)
    model = _Model()
    worker.model, worker.strategy = model, _Strategy()
    worker.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    worker.scheduler = torch.optim.lr_scheduler.ConstantLR(worker.optimizer, factor=1.0)
    worker.mesh_rank = SimpleNamespace(dp_size=world)
    statuses = []
    for step in range(STEPS):
        r = rollout(seed=100 * rank + step)
        B = len(LENGTHS)
        model.table = r["learner"]
        seqs = torch.arange(B)[:, None].expand(B, 3).contiguous()   # row id → its log-probs in the stand-in
        data = TrainingInputBatch({
            "sequences": seqs, "attention_mask": torch.ones(B, 3, dtype=torch.long),
            "action_log_probs": r["old"], "base_action_log_probs": None, "values": None, "returns": None,
            "advantages": scaled_advantages(r, cfg.algorithm.loss_reduction), "loss_mask": r["loss_mask"],
            "response_mask": r["action_mask"], "rollout_logprobs": r["rollout"]})
        data.metadata = {"response_length": r["loss_mask"].shape[1], "global_step": step + 1}
        # PolicyWorkerBase.forward_backward's loop (its DP all-reduce of the metrics needs a process group)
        for micro in get_microbatch_iterator(data, micro_batch_size=cfg.micro_train_batch_size_per_gpu,
                                             max_tokens_per_microbatch=cfg.max_tokens_per_microbatch):
            exp = BaseBatchIterator.batch_to_experience(micro)
            statuses.append(worker._forward_backward_micro(exp, microbatch_weight=len(micro) / len(data)))
        worker.optim_step()
    hook = worker.policy_loss_fn
    rt = hook.runtime
    out = {"pid": os.getpid(), "calls": rt.calls, "optimizer_steps": rt.optimizer_steps, "rank": rt.monitor.rank,
           "is_ours": type(hook).__name__, "status_keys": sorted(k for k in statuses[0] if k != "loss_fn_outputs"),
           "controller_calls": rt.controller.calls}
    close_all()
    return out


def test_registry_ships_the_loss_into_two_ray_workers(tmp_path):
    """A real local Ray cluster: the loss registered on the driver (with live state there), synced by SkyRL's
    ``sync_registries`` and looked up by two real ``PolicyWorkerBase`` workers: 3 optimizer steps × 4
    micro-batches each → 3 monitored steps, every token once, rank files from both workers, one run.json, SkyRL's
    own status metrics next to ours."""
    import pyarrow.parquet as pq
    import ray

    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries

    run_dir = tmp_path / "run"
    fn = register(name="triage_ray_test", run_dir=str(run_dir),
                  monitor=MonitorConfig(window=2, calibration_steps=1),
                  triage=TriageConfig(gate_width=4, repair_width=4), manifest={"framework": "skyrl"})
    assert fn.controller is not None                 # live objects (controller, locks) in the driver process ...
    data = cloudpickle.dumps(fn)                     # ... never travel: the object pickles as configuration
    assert b"TriageController" not in data and b"RLock" not in data
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
                                       "SKYRL_LOG_FILE": str(tmp_path / "infra.log")}})
    try:
        sync_registries()                            # what SkyRL's initialize_ray does right after ray.init
        Worker = ray.remote(num_cpus=1)(_Host)
        hosts = [Worker.remote() for _ in range(2)]
        results = ray.get([h.run.remote(i, 2, "triage_ray_test") for i, h in enumerate(hosts)])
    finally:
        ray.shutdown()
        PolicyLossRegistry.reset()
        fn.close()
    assert len({r["pid"] for r in results}) == 2 and os.getpid() not in {r["pid"] for r in results}
    assert all(r["is_ours"] == "SkyRLTriageLoss" for r in results)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["optimizer_steps"] == STEPS and r["calls"] == STEPS * MICRO_PER_STEP for r in results)
    assert all(r["controller_calls"] == STEPS * MICRO_PER_STEP for r in results)
    keys = set(results[0]["status_keys"])
    assert {"policy_loss", "final_loss", "loss_metrics/clip_ratio", "loss_metrics/triage/gate_weight_mean",
            "minibatch_rollout_logprobs_abs_diff_mean"} <= keys
    n_tokens = sum(sum(m) for m in rollout()["mask_lists"])
    from triage_monitor.layout import parse_table_file
    files = {parse_table_file(p.name): p for p in (run_dir / "tokens").iterdir()}
    steps = sorted({s for s, _, _ in files})
    assert steps == list(range(STEPS))
    for s in steps:
        assert sorted(r for st, r, _ in files if st == s) == [0, 1]           # one file per (step, rank)
        assert all(pq.read_table(f).num_rows == n_tokens for (st, _, _), f in files.items() if st == s)
    manifest = json.loads((run_dir / "run.json").read_text())
    assert len(manifest["attempts"]) == 1 and manifest["info"]["framework"] == "skyrl"


class _Host:
    def run(self, rank, world, loss_name):
        return run_worker(rank, world, loss_name)
