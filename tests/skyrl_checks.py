"""SkyRL checks, run by tests/test_hooks_skyrl.py inside the side environments ``.venv-fw/skyrl-0.3.0`` (Python 3.11;
SkyRL 0.3.0 pins transformers ≤ 5.8 and ray 2.56, which clash with the main venv) and ``.venv-fw/skyrl-0.4.0``
(Python 3.12, which SkyRL 0.4.0 requires; ray 2.57).  Not collected on its own.

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
import numpy as np
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
from triage_monitor.triage.controller import TriageConfig
from triage_monitor.hooks.worker_runtime import HookSettings, close_all
from triage_monitor.hooks.skyrl import SKYRL_LOSS_REDUCTIONS, SkyRLTriageLoss, batch_from_skyrl, register
from triage_monitor.monitor import MonitorConfig

OFF = TriageConfig(gate=False, repair=False, tis=False)
LENGTHS = [23, 9, 17, 4, 12, 30, 6, 15]          # 8 responses of 2 prompts × 4 samples (GRPO groups)
PROMPTS = [5, 5, 5, 5, 3, 3, 3, 3]
MICRO = 2                                         # micro_train_batch_size_per_gpu
MAX_SEQ_LEN = 64


def batch_tensors(prompts, responses, rewards, loss_masks, logprobs):
    """SkyRL's own ``convert_prompts_responses_to_batch_tensors``, the six tensors every release returns
    (sequences, attention_mask, action/response mask, rewards, loss_masks, logprobs).  0.3.0 takes the tokenizer
    first (for its ``pad_token_id``) and returns 7 values (+ rollout_expert_indices); 0.4.0 takes ``pad_token_id``
    itself and returns 8 (+ rollout_expert_indices, rollout_sample_support)."""
    import inspect

    first = next(iter(inspect.signature(convert_prompts_responses_to_batch_tensors).parameters))
    pad = 0 if first == "pad_token_id" else SimpleNamespace(pad_token_id=0)
    out = convert_prompts_responses_to_batch_tensors(pad, prompts, responses, rewards, loss_masks, logprobs=logprobs)
    assert len(out) == {"tokenizer": 7, "pad_token_id": 8}[first], (first, len(out))
    return out[:6]


def rollout(seed: int = 0, lengths=LENGTHS, prompts=PROMPTS, amplify: float = 0.0):
    """One mini-batch laid out by SkyRL's own preprocessing: (sequences, loss_mask, rollout_logprobs, the
    per-response lists, raw advantages (B, T), learner / old log-probs (B, T)).  The learner is the generator
    ± 0.3 nats of noise; with ``amplify`` > 0 it is ``amplify`` nats off in the amplifying direction instead
    (the generator above the learner on A < 0 responses, below on A > 0) ± 0.05 nats."""
    g = torch.Generator().manual_seed(seed)
    resp = [torch.randint(3, 50, (L,), generator=g).tolist() for L in lengths]
    prm = [torch.randint(3, 50, (P,), generator=g).tolist() for P in prompts]
    rl = [(-torch.rand(L, generator=g) * 2 - 0.01 - amplify) for L in lengths]
    masks = []
    for L in lengths:
        m = [1] * L
        if L > 12:
            m[8:11] = [0, 0, 0]                   # tool output inside the response
        masks.append(m)
    seqs, attn, action_mask, rewards, loss_mask, rollout_lp = batch_tensors(
        prm, resp, [[0.0] * L for L in lengths], masks, logprobs=[x.tolist() for x in rl])
    B, T = loss_mask.shape
    score = torch.randn(B, generator=g)
    adv = score[:, None] * action_mask                           # GRPO: one advantage per response
    noise = torch.randn(B, T, generator=g)
    delta = amplify * torch.sign(score)[:, None] + 0.05 * noise if amplify else 0.3 * noise
    learner = torch.where(action_mask > 0, rollout_lp + delta, torch.full((B, T), -3.0))
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


def test_gate_weights_renormalise_per_response_under_skyrls_sum():
    """docs/hooks.md#triage-weights-under-a-frameworks-normaliser through the registered loss: SkyRL's masked sum
    (normaliser 1, the reduction in the advantages).  Three 4-token responses, A = −1, −1, +1, the generator
    above the learner by δ: response a partly gated (one δ > 0 token, tier 0.3 on the others), b all gated.  The
    gradient per token over the Gate-off one is w · 4 / W: 4/1.9 and 0.3 · 4/1.9 on a, 1 on b and c."""
    delta = torch.tensor([[0.2, -0.8, -0.9, -1.0], [-0.8, -0.9, -1.0, -0.7], [-0.8, -0.9, -1.0, -0.7]])
    rollout_lp = torch.full_like(delta, -2.0)
    adv = torch.tensor([-1.0, -1.0, 1.0])[:, None].expand_as(delta).contiguous()
    cfg = AlgorithmConfig()
    grads = {}
    for name, triage in (("off", OFF), ("on", TriageConfig(tis=False, repair=False, gate_width=4))):
        lp = (rollout_lp + delta).requires_grad_()
        loss, _ = SkyRLTriageLoss(HookSettings(triage=triage))(lp, lp.detach(), adv, cfg, loss_mask=torch.ones_like(lp),
                                                               rollout_logprobs=rollout_lp)
        loss.backward()
        grads[name] = lp.grad
    s = 4 / 1.9
    want = torch.tensor([[s, .3 * s, .3 * s, .3 * s], [1.0] * 4, [1.0] * 4])
    assert torch.allclose(grads["on"] / grads["off"], want, rtol=1e-5)


def test_the_docs_lines_pass_validate_cfg_with_a_console_logger(monkeypatch):
    """The docs' SkyRL lines: register, then SkyRL's own validate_cfg.  SkyRL's default trainer.logger is wandb,
    which validate_cfg refuses without WANDB_API_KEY; with trainer.logger=console (the docs' line) it passes."""
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils.utils import validate_cfg

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    lines = ["trainer.algorithm.policy_loss_type=triage", "generator.sampling_params.logprobs=1"]
    try:
        for extra, ok in (([], False), (["trainer.logger=console"], True)):
            cfg = SkyRLTrainConfig.from_cli_overrides(lines + extra)
            register(run_dir=None, triage=TriageConfig(), algorithm=cfg.trainer.algorithm, trainer=cfg.trainer)
            if ok:
                validate_cfg(cfg)
            else:
                with pytest.raises(AssertionError, match="WANDB_API_KEY"):
                    validate_cfg(cfg)
            PolicyLossRegistry.reset()
    finally:
        PolicyLossRegistry.reset()


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


def test_register_takes_alerts_loggers_framework_keys_and_checks_them(tmp_path):
    """register(alerts=, loggers=, framework_keys=, trainer=) become the loss's settings (configuration only); a
    bad value fails on the driver, naming the argument and the value."""
    from skyrl.train.config import TrainerConfig
    from triage_monitor.alerting.trackers import TrackerSpec

    rules = tmp_path / "rules.toml"
    rules.write_text('[[rules]]\nname = "r"\nmetric = "window/rho_asym"\ncondition = "above"\nthreshold = 1.5\n')
    trainer = TrainerConfig()
    trainer.train_batch_size, trainer.policy_mini_batch_size, trainer.update_epochs_per_batch = 64, 16, 2
    try:
        fn = register(name="triage_opts", run_dir=str(tmp_path / "run"), alerts=str(rules), loggers="tensorboard",
                      framework_keys=["window/rho_asym", "k3_kl"], trainer=trainer)
        assert fn.settings.alerts == str(rules) and fn.settings.loggers == [TrackerSpec("tensorboard")]
        assert fn.settings.framework_keys == ("window/rho_asym", "k3_kl") and fn.steps_per_report == 8
        assert b"TrackerSpec" in cloudpickle.dumps(fn) and cloudpickle.loads(cloudpickle.dumps(fn)).steps_per_report == 8
        assert register(name="triage_opts_off", alerts=False).settings.alerts is False
        bad = [(dict(alerts=str(tmp_path / "none.toml")), r"register\(alerts=...\)='.*none.toml': .*not a file"),
               (dict(alerts=[{"name": "x", "metric": "rho_asym", "condition": "up", "threshold": 1}]),
                r"register\(alerts=...\)\[0\].*condition"),
               (dict(loggers=["comet"]), r"register\(loggers=...\)=\['comet'\]: tracker kind 'comet'"),
               (dict(loggers=[object()]), r"register\(loggers=...\)=.*give a kind"),
               (dict(framework_keys="most"), r"register\(framework_keys=...\)='most'"),
               (dict(trainer=SimpleNamespace(train_batch_size=8, policy_mini_batch_size=16, update_epochs_per_batch=1)),
                r"policy_mini_batch_size=16 exceeds trainer.train_batch_size=8")]
        for i, (kw, match) in enumerate(bad):
            with pytest.raises(ValueError, match=match):
                register(name=f"triage_bad_{i}", **kw)
    finally:
        PolicyLossRegistry.reset()


# ------------------------------------------------------------------------- registry → Ray workers (real)
#: SkyRL training steps; mini-batches (optimizer steps) per SkyRL step; micro-batches per mini-batch
STEPS, MINI_PER_STEP, MICRO_PER_STEP = 3, 2, 4
#: a generator this many nats off the learner in the amplifying direction (rollout's ``amplify``)
AMPLIFY = 0.5
#: one rule per monitored step (one per SkyRL step): the window's amplifying share above 0.9 held 1, 2, ... steps,
#: so the biased generator raises exactly one alert at each monitored step, for the job (register(alerts=...))
RULES = [dict(name=f"held_{h}", metric="window/amp_share", condition="above", threshold=0.9, window=25, hold=h,
              cooldown=100) for h in range(1, STEPS + 1)]


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
    """Stand-in for the FSDP strategy: plain backward and optimizer step; SkyRL's own ``all_reduce`` (the DP mean
    of the worker's metrics, on the gloo group)."""

    from skyrl.backends.skyrl_train.distributed.strategy import DistributedStrategy as _DS

    all_reduce = _DS.all_reduce

    def backward(self, loss, model, optimizer, **kw):
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kw):
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        return None


def run_worker(rank: int, world: int, loss_name: str, port: int):
    """One SkyRL policy worker in a gloo process group with the other (SkyRL's workers always have one): SkyRL's
    own ``__init__`` (registry lookup), ``forward_backward`` (micro-batching, the loss call site, the metric
    reduction over micro-batches and its DP all-reduce) and ``optim_step`` per mini-batch; returns, besides the
    run's facts, the metrics of every mini-batch as the trainer receives them (WorkerOutput.metrics, dp rank 0's)."""
    import torch.cuda
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
    from skyrl.train.config import TrainerConfig

    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"                # GPU piece: the worker moves batches to the device
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = TrainerConfig()
    cfg.algorithm.policy_loss_type = loss_name
    cfg.algorithm.use_kl_loss = False
    cfg.algorithm.temperature = 1.0
    cfg.micro_train_batch_size_per_gpu = len(LENGTHS) // MICRO_PER_STEP
    worker = PolicyWorkerBase(cfg=cfg, world_size=world, rank=rank, local_rank=0, master_addr="127.0.0.1",
                              master_port=port, sequence_parallel_size=1)
    # GPU piece: SkyRL's init_worker_process_group builds this mesh on "cuda"
    worker.device_mesh = init_device_mesh("cpu", mesh_shape=(world, 1), mesh_dim_names=("dp", "sp"))
    model = _Model()
    worker.model, worker.strategy = model, _Strategy()
    worker.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    worker.scheduler = torch.optim.lr_scheduler.ConstantLR(worker.optimizer, factor=1.0)
    worker.mesh_rank = SimpleNamespace(dp_size=world)
    minibatch_metrics = []
    for step in range(STEPS):
        for mini in range(MINI_PER_STEP):
            r = rollout(seed=1000 * rank + 10 * step + mini, amplify=AMPLIFY)
            B = len(LENGTHS)
            model.table = r["learner"]
            seqs = torch.arange(B)[:, None].expand(B, 3).contiguous()   # row id → its log-probs in the stand-in
            data = TrainingInputBatch({
                "sequences": seqs, "attention_mask": torch.ones(B, 3, dtype=torch.long),
                "action_log_probs": r["old"], "base_action_log_probs": None, "values": None, "returns": None,
                "advantages": scaled_advantages(r, cfg.algorithm.loss_reduction), "loss_mask": r["loss_mask"],
                "response_mask": r["action_mask"], "rollout_logprobs": r["rollout"]})
            # what SkyRL's trainer writes on the step's batch (its slices and chunks keep it): the global step
            # (train_critic_and_policy) and the mini-batch boundaries (convert_to_training_input)
            data.metadata = {"response_length": r["loss_mask"].shape[1], "global_step": step + 1,
                             "policy_mini_batch_boundaries": [(m * B, (m + 1) * B) for m in range(MINI_PER_STEP)]}
            out = worker.forward_backward(data)
            minibatch_metrics.append(dict(out.metrics))
            worker.optim_step()
    hook = worker.policy_loss_fn
    rt = hook.runtime
    mon = rt.monitor
    from triage_monitor.hooks.skyrl import _CLOCKS
    from triage_monitor.rundir.layout import RunLayout

    # written by the optimizer step that ended each SkyRL step, before anything closes the hook (Ray runs no atexit):
    # the steps of the open block are in their pending files
    on_disk = sorted(s for p in RunLayout(mon.run_dir).index("steps").parts if p.rank == mon.rank
                     for s in range(p.lo, p.hi + 1))
    result = {"pid": os.getpid(), "calls": rt.calls, "optimizer_steps": _CLOCKS[hook.settings.key].total,
              "rank": mon.rank, "on_disk_before_close": on_disk,
              "is_ours": type(hook).__name__, "controller_calls": rt.controller.calls, "metrics": minibatch_metrics,
              "rules": None if mon.alerts is None else [x.name for x in mon.alerts.rules],
              "loggers": [(type(lg).__name__, lg.keys) for lg in mon.loggers]}
    close_all()
    dist.destroy_process_group()
    return result


def skyrl_logged(minibatch_metrics) -> list:
    """What SkyRL's trainer logs per training step (trainer.py ``_execute_training_step`` and
    ``train_critic_and_policy``): the mini-batches' metrics reduced by SkyRL's ``reduce_metrics``, ``policy/``."""
    from collections import defaultdict

    from skyrl.backends.skyrl_train.workers.worker_utils import reduce_metrics

    out = []
    for s in range(STEPS):
        all_metrics = defaultdict(list)
        for m in minibatch_metrics[s * MINI_PER_STEP:(s + 1) * MINI_PER_STEP]:
            for k, v in m.items():
                all_metrics[k].append(v)
        out.append({f"policy/{k}": v for k, v in reduce_metrics(all_metrics, sum_loss_metrics=False).items()})
    return out


def test_registry_ships_the_loss_into_two_ray_workers(tmp_path):
    """A real local Ray cluster: the loss registered on the driver (with live state there; alerts, a tracker and
    the trainer's batch sizes as register's arguments), synced by SkyRL's ``sync_registries`` and looked up by two
    real ``PolicyWorkerBase`` workers in one gloo group: 3 SkyRL steps × 2 mini-batches × 4 micro-batches each → 3
    monitored steps numbered as SkyRL's global_step (1, 2, 3: read from the batch's metadata at the worker's call
    site), each written by the optimizer step that ended it (before anything closes the hook), every token of the
    step's two mini-batches once, rank files from both workers, one run.json, SkyRL's own status metrics next to
    ours.  The options reach the monitors (rank 0's only); a generator biased in the amplifying direction raises
    one alert per monitored step for the job, from rank 0; what SkyRL logs per step (its real reduction over
    micro-batches, DP ranks and mini-batches) holds the curated keys of the previous SkyRL step, equal to the steps
    table."""
    import ray

    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries
    from skyrl.train.config import TrainerConfig
    from triage_monitor.alerting.trackers import CURATED_KEYS

    run_dir = tmp_path / "run"
    trainer = TrainerConfig()
    trainer.train_batch_size, trainer.policy_mini_batch_size = 2 * MINI_PER_STEP, 2
    fn = register(name="triage_ray_test", run_dir=str(run_dir),
                  monitor=MonitorConfig(window=2, calibration_steps=1, per_rank_steps=True),   # rank 1's Gate share too
                  triage=TriageConfig(gate_width=4, repair_width=4), manifest={"framework": "skyrl"},
                  alerts=RULES, loggers=[{"kind": "wandb", "start": False}], trainer=trainer)
    assert fn.steps_per_report == MINI_PER_STEP
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
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        results = ray.get([h.run.remote(i, 2, "triage_ray_test", port) for i, h in enumerate(hosts)])
    finally:
        ray.shutdown()
        PolicyLossRegistry.reset()
        fn.close()
    n_calls = STEPS * MINI_PER_STEP * MICRO_PER_STEP
    assert len({r["pid"] for r in results}) == 2 and os.getpid() not in {r["pid"] for r in results}
    assert all(r["is_ours"] == "SkyRLTriageLoss" for r in results)
    by_rank = {r["rank"]: r for r in results}
    assert sorted(by_rank) == [0, 1]
    assert all(r["optimizer_steps"] == STEPS * MINI_PER_STEP and r["calls"] == n_calls for r in results)
    assert all(r["controller_calls"] == n_calls for r in results)
    assert all(r["on_disk_before_close"] == [1, 2, 3] for r in results)     # SkyRL's steps, the last one included
    keys = set(results[0]["metrics"][0])
    assert {"policy_loss", "final_loss", "loss_metrics/clip_ratio", "loss_metrics/triage/gate_weight_mean",
            "minibatch_rollout_logprobs_abs_diff_mean"} <= keys
    n_tokens = MINI_PER_STEP * sum(sum(m) for m in rollout()["mask_lists"])    # a step: its 2 mini-batches
    from runfiles import rows_of, step_keys
    keys = step_keys(run_dir, "tokens")
    steps = sorted({s for s, _, _ in keys})
    assert steps == list(range(1, STEPS + 1))                                  # SkyRL's global_step
    for s in steps:
        assert sorted(r for st, r, _ in keys if st == s) == [0, 1]            # one file per (step, rank)
        assert all(rows_of(run_dir, "tokens", s, r) == n_tokens for r in (0, 1))
    manifest = json.loads((run_dir / "run.json").read_text())
    assert len(manifest["attempts"]) == 1 and manifest["info"]["framework"] == "skyrl"

    # register's options reached the monitors: rules and tracker on rank 0 only
    assert by_rank[0]["rules"] == [r["name"] for r in RULES] and by_rank[0]["loggers"] == [("WandbLogger", "curated")]
    assert by_rank[1]["rules"] is None and by_rank[1]["loggers"] == []
    # one alert per monitored step for the job, raised by rank 0 on the all-reduced metrics; rank 1 raised none
    import pandas as pd
    alerts = pd.read_parquet(run_dir / "alerts")
    assert sorted(zip(alerts["step"].astype(int), alerts["rule"])) == [(s, f"held_{s}") for s in steps]
    assert set(alerts["rank"].astype(int)) == {0}
    table = pd.read_parquet(run_dir / "steps")
    rows = {(int(r["step"]), int(r["rank"])): r for _, r in table.iterrows()}
    assert sorted(rows) == [(s, r) for s in steps for r in (0, 1)]                     # one row per step and rank
    assert all(rows[(s, 1)]["delta_abs_mean"] > 0.3 for s in steps)                    # generator != learner

    # what SkyRL logs per training step: the metrics dp rank 0 returns, reduced over the step's mini-batches
    for a, b in zip(results[0]["metrics"], results[1]["metrics"]):          # all-reduced: the same on both ranks
        assert a == pytest.approx(b, nan_ok=True)
    logged = skyrl_logged(by_rank[0]["metrics"])
    assert not any(k.startswith("policy/loss_metrics/triage/window") for k in logged[0])
    for s in range(1, STEPS):
        got = logged[s]
        last = s                                      # the previous SkyRL step (logged[s] is SkyRL step s + 1)
        assert got["policy/loss_metrics/triage/metrics_step"] == last
        r0, r1 = rows[(last, 0)], rows[(last, 1)]
        want = [k for k in CURATED_KEYS if np.isfinite(r0[k])]
        assert {"window/rho_asym", "rho_asym", "window/k3_kl", "delta_abs_mean", "alerts_active",
                "gate_downweighted_frac"} <= set(want)
        for k in want:
            v = got[f"policy/loss_metrics/triage/{k}"]
            if k == "gate_downweighted_frac":           # each rank's own Gate: SkyRL's mean over the DP ranks
                assert v == pytest.approx((r0[k] + r1[k]) / 2, rel=1e-6, abs=1e-9), k
            elif k == "alerts_active":                  # rank 0's count
                assert v == pytest.approx(r0[k]) and r0[k] == last and np.isnan(r1[k])
            else:                                       # all-reduced by the monitors: the same on both ranks
                assert r1[k] == pytest.approx(r0[k], rel=1e-9, abs=1e-12), k
                assert v == pytest.approx(r0[k], rel=1e-6, abs=1e-9), k


def test_the_trainers_timers_reach_the_steps_table_through_a_training_callback(tmp_path):
    """The experiment class of the hook (SkyRL's BasePPOExp with TimingsExpMixin) builds SkyRL's real RayPPOTrainer
    through BasePPOExp.get_trainer and adds the callback; the trainer's own _fire("on_log", logs=...) — what
    RayPPOTrainer.train does before tracker.log (train/trainer.py L522-536) — with the payload train builds
    (metrics, timing/<all_timings>) at global_step 1..3: each step's row (written earlier by the workers) gets
    the phases, mapped as docs/hooks.md#phase-timings says, and the reward SkyRL's own postprocess_generator_output
    put in the payload; SkyRL's payload is left as it was."""
    import math

    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.entrypoints.main_base import BasePPOExp
    from skyrl.train.trainer import RayPPOTrainer
    from skyrl.train.utils.tracking import Tracking

    from triage_monitor.offline.analysis import open_run
    from triage_monitor.hooks.skyrl import TimingsExpMixin, experiment_class
    from triage_monitor.monitor import MismatchMonitor

    run_dir = tmp_path / "run"
    with MismatchMonitor(run_dir, MonitorConfig(), alerts=False) as mon:      # the workers' rows, no timings
        for s in (1, 2, 3):
            g = torch.Generator().manual_seed(s)
            lp = -torch.rand(2, 6, generator=g) - 0.01
            mon.log_step(s, TokenBatch.from_padded(lp, lp - 0.1, torch.ones(2, 6), torch.ones(2, 6, dtype=torch.bool)))
    cfg = SkyRLTrainConfig()
    cfg.trainer.logger = "console"
    cfg.generator.inference_engine.enable_ray_prometheus_stats = False     # they query a live Ray cluster
    cfg.trainer.enable_ray_gpu_monitor = False
    Exp = experiment_class(run_dir)
    assert issubclass(Exp, TimingsExpMixin) and issubclass(Exp, BasePPOExp)
    exp = object.__new__(Exp)                  # BasePPOExp.__init__ loads a tokenizer and datasets: not needed here
    exp.cfg = cfg
    tracker = Tracking("p", "r", backend="console", config=cfg)
    trainer = exp.get_trainer(cfg=cfg, tracker=tracker, tokenizer=None, train_dataset=None, eval_dataset=None,
                              inference_engine_client=None, generator=None, colocate_pg=None)
    assert type(trainer) is RayPPOTrainer
    payloads = []
    rewards = {1: [1.0, -1.0, 0.5, 0.5], 2: [0.0, -0.5, 0.0, 1.0], 3: [2.0, 1.0, 1.0, -1.0]}
    for s in (1, 2, 3):
        trainer.global_step = s
        trainer.all_metrics = {}
        # SkyRL's own postprocess_generator_output (what train runs after generation) puts the step's reward
        # metrics into all_metrics: reward/avg_raw_reward, the mean trajectory reward
        out = {"response_ids": [[5, 6, 7]] * 4, "rewards": list(rewards[s]), "loss_masks": [[1, 1, 1]] * 4}
        trainer.postprocess_generator_output(out, ["a", "a", "b", "b"])
        all_timings = {"generate": 6.0 * s, "postprocess_generator_output": 0.1, "convert_to_training_input": 0.2,
                       "fwd_logprobs_values_reward": 1.0, "compute_advantages_and_returns": 0.2,
                       "train_critic_and_policy": 2.0, "policy_train": 1.9, "sync_weights": 0.5, "step": 10.0 * s}
        log_payload = {**trainer.all_metrics, "trainer/global_step": s, "policy/policy_loss": 0.1,
                       **{f"timing/{k}": v for k, v in all_timings.items()}}
        before = dict(log_payload)
        trainer._fire("on_log", logs=log_payload)
        assert log_payload == before
        payloads.append(log_payload)
    trainer._fire("on_train_end")
    steps = open_run(run_dir).steps().set_index("step")
    assert steps["time/generation"].tolist() == [6.0, 12.0, 18.0] and steps["time/step"].tolist() == [10.0, 20.0, 30.0]
    assert steps["time/reward"].tolist() == pytest.approx([0.3] * 3) and steps["time/other"].tolist() == [0.2] * 3
    assert steps["time/update"].tolist() == [2.0] * 3 and steps["time/weight_sync"].tolist() == [0.5] * 3
    assert steps["time/logprob"].tolist() == [1.0] * 3 and all(math.isnan(v) for v in steps["time/quantize"])
    # the step's reward: SkyRL's reward/avg_raw_reward (0.25, 0.125, 0.75), not its pass@n (1, 0.5, 1) or its
    # positive-reward mean (0.5, 0.25, 1)
    assert [p["reward/avg_raw_reward"] for p in payloads] == [0.25, 0.125, 0.75]
    assert [p["reward/mean_positive_reward"] for p in payloads] == [0.5, 0.25, 1.0]
    assert steps["reward"].tolist() == [0.25, 0.125, 0.75]
    late = open_run(run_dir).timings()
    assert late["framework"].tolist() == ["skyrl"] * 3 and late["framework_step"].tolist() == [1, 2, 3]
    assert not [p for p in (run_dir / "timings").iterdir() if p.name.startswith(".")]     # sealed at train end


class _Host:
    def run(self, rank, world, loss_name, port):
        return run_worker(rank, world, loss_name, port)
