"""NeMo RL contract test: our LossFunction driven through NeMo RL's own call sites, transcribed.

NeMo RL does not install on a CPU machine (its PyPI entry is a placeholder; the workers need CUDA, Megatron /
nemo_automodel), so the calling code is reproduced here from its public repository at commit
7ea279abfbeb698b092856d0dab61e7cf39bc909 (NVIDIA-NeMo/RL):

- ``nemo_rl/algorithms/loss/interfaces.py`` L23-57: ``LossType``, ``MetricNormalizer``, ``LossInputType`` (the
  enums our loss must expose as ``loss_type`` / ``input_type``; registered below under their real module name,
  as the hook reads them from there inside NeMo);
- ``nemo_rl/algorithms/utils.py`` L42-101 ``calculate_kl``, L212-224 ``masked_mean``;
- ``nemo_rl/algorithms/loss/loss_functions.py`` L374-788 ``ClippedPGLossFn.__call__`` (NeMo's default GRPO loss;
  the branches of options our hook refuses at construction are left out: CISPO, sequence-level IS ratios,
  disable_ppo_ratio, importance-sampling correction / TIS, on-policy KL approximation, positive-example NLL);
- ``nemo_rl/algorithms/loss/utils.py`` L71-120 ``prepare_loss_input`` (LOGPROB branch) with
  ``nemo_rl/distributed/model_utils.py`` L1677-1693 (next-token log-probs, no vocab parallelism);
- ``nemo_rl/models/automodel/data.py`` L404-420 ``process_global_batch`` (global valid seqs / tokens,
  all-reduced over data-parallel ranks);
- ``nemo_rl/models/automodel/train.py`` L525-548 (metrics ÷ num_global_batches, ``loss * dp_size * cp_size``,
  backward per micro-batch) and L642-651 (``LossPostProcessor``: ``prepare_loss_input`` then
  ``loss_fn(data=, global_valid_seqs=, global_valid_toks=, **loss_input)``);
- ``nemo_rl/models/policy/workers/dtensor_policy_worker_v2.py`` L478-566 (per global batch: zero_grad, the
  micro-batches, ``loss_metrics["num_valid_samples"]``, ``optimizer.step()``);
- ``nemo_rl/models/policy/lm_policy.py`` L779-816 (``policy.train``: the data sharded over data-parallel workers,
  ``loss_fn`` passed in ``common_kwargs`` to every worker on every call, i.e. re-pickled each time);
- ``nemo_rl/algorithms/grpo.py`` L3466-3492 (the micro-batch metric lists summed, extrema min/max'd), with
  ``automodel/train.py`` L1122-1134 (``aggregate_training_statistics``: each worker's micro-batch dicts listed per
  key) and ``lm_policy.py`` L853-858 (the workers' lists concatenated): together what GRPO logs as its train
  metrics.
"""

import enum
import json
import os
import socket
import sys
import types

import math
from pathlib import Path

import cloudpickle
import numpy as np
import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recording_tracker  # noqa: E402
from triage_monitor.triage.controller import TriageConfig  # noqa: E402
from triage_monitor.hooks import nemo_rl  # noqa: E402
from triage_monitor.hooks.worker_runtime import close_all, runtime_for  # noqa: E402
from triage_monitor.monitor import MonitorConfig  # noqa: E402
from triage_monitor.alerting.trackers import CURATED_KEYS  # noqa: E402
from runfiles import shown  # noqa: E402

pytestmark = pytest.mark.framework

COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
assert nemo_rl.NEMO_RL_COMMIT == COMMIT


# ------------------------------------------------------------------ transcription of NeMo RL @ 7ea279ab
class LossType(enum.Enum):                                          # interfaces.py L23-25
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class MetricNormalizer(enum.Enum):                                  # interfaces.py L28-49
    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


class LossInputType(enum.Enum):                                     # interfaces.py L52-57
    LOGIT = "logit"
    LOGPROB = "logprob"
    DISTILLATION = "distillation"
    DISTILLATION_CROSS_TOKENIZER = "distillation_cross_tokenizer"
    DRAFT = "draft"


def install_nemo_interfaces():
    """Make ``nemo_rl.algorithms.loss.interfaces`` resolve to the transcription above (as in a NeMo worker)."""
    mods = {}
    for name in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.loss", "nemo_rl.algorithms.loss.interfaces"):
        mods[name] = sys.modules.get(name)
        sys.modules[name] = types.ModuleType(name)
    iface = sys.modules["nemo_rl.algorithms.loss.interfaces"]
    iface.LossType, iface.MetricNormalizer, iface.LossInputType = LossType, MetricNormalizer, LossInputType
    return mods


@pytest.fixture
def nemo_interfaces():
    saved = install_nemo_interfaces()
    yield
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


def calculate_kl(logprobs, logprobs_reference, kl_type="k3", input_clamp_value=20.0, output_clamp_value=10.0,
                 importance_sampling_weights=None):                 # algorithms/utils.py L42-101
    logr = logprobs_reference - logprobs
    if input_clamp_value is not None:
        logr_clamped = logr.clamp(min=-input_clamp_value, max=input_clamp_value)
        if importance_sampling_weights is not None:
            importance_sampling_weights = torch.where(
                logr == logr_clamped, importance_sampling_weights, importance_sampling_weights.detach())
        logr = logr_clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = torch.square(logr) / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"Invalid KL type: {kl_type}")
    if importance_sampling_weights is not None:
        kl = importance_sampling_weights * kl
    if output_clamp_value is not None:
        kl = kl.clamp(min=-output_clamp_value, max=output_clamp_value)
    return kl


def masked_mean(values, mask, dim=None, global_normalization_factor=None):   # algorithms/utils.py L212-224
    normalization_factor = (torch.sum(mask, dim=dim) if global_normalization_factor is None
                            else global_normalization_factor)
    return torch.sum(values * mask, dim=dim) / (normalization_factor + 1e-8)


class ClippedPGLossFn:                                              # loss_functions.py L180-788 (default path)
    input_type = LossInputType.LOGPROB

    def __init__(self, cfg: dict):
        cfg = {**nemo_rl.CLIPPED_PG_DEFAULTS, **cfg}
        self.use_fused_linear_logprobs = False
        self.ratio_clip_min, self.ratio_clip_max = cfg["ratio_clip_min"], cfg["ratio_clip_max"]
        self.ratio_clip_c = cfg["ratio_clip_c"]
        self.reference_policy_kl_penalty = cfg["reference_policy_kl_penalty"] if not cfg["use_kl_in_reward"] else 0
        self.reference_policy_kl_type = cfg["reference_policy_kl_type"]
        self.kl_input_clamp_value, self.kl_output_clamp_value = cfg["kl_input_clamp_value"], cfg["kl_output_clamp_value"]
        self.force_on_policy_ratio = cfg["force_on_policy_ratio"]
        self.loss_type = LossType.TOKEN_LEVEL if cfg["token_level_loss"] else LossType.SEQUENCE_LEVEL

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        curr_logprobs = next_token_logprobs
        token_mask = data["token_mask"][:, 1:]
        sample_mask = data["sample_mask"]
        advantages = data["advantages"][:, 1:]
        prev_logprobs = None if self.force_on_policy_ratio else data["prev_logprobs"][:, 1:]
        generation_logprobs = data["generation_logprobs"][:, 1:]
        if self.reference_policy_kl_penalty != 0:
            reference_policy_logprobs = data["reference_policy_logprobs"][:, 1:]
            curr_logprobs_unfiltered = data.get("curr_logprobs_unfiltered", curr_logprobs)
        mask = token_mask * sample_mask.unsqueeze(-1)
        if self.force_on_policy_ratio:
            prev_logprobs = curr_logprobs.detach()
        lp_error = torch.abs(generation_logprobs - prev_logprobs)
        mult_prob_error = masked_mean(torch.exp(lp_error * mask), mask,
                                      global_normalization_factor=global_valid_toks).item()
        gen_kl_error = calculate_kl(logprobs=generation_logprobs, logprobs_reference=prev_logprobs,
                                    kl_type=self.reference_policy_kl_type, input_clamp_value=None,
                                    output_clamp_value=None)
        gen_kl_error = masked_mean(gen_kl_error, mask, global_normalization_factor=global_valid_toks).item()
        policy_kl_error = calculate_kl(logprobs=prev_logprobs, logprobs_reference=generation_logprobs,
                                       kl_type=self.reference_policy_kl_type, input_clamp_value=None,
                                       output_clamp_value=None)
        policy_kl_error = masked_mean(policy_kl_error, mask, global_normalization_factor=global_valid_toks).item()
        log_mixture = torch.log(0.5 * torch.exp(prev_logprobs) + 0.5 * torch.exp(generation_logprobs))
        kl_prev_to_mixture = torch.exp(prev_logprobs - log_mixture) - (prev_logprobs - log_mixture) - 1
        kl_gen_to_mixture = (torch.exp(generation_logprobs - log_mixture) - (generation_logprobs - log_mixture) - 1)
        js_divergence_error = masked_mean(0.5 * kl_prev_to_mixture + 0.5 * kl_gen_to_mixture, mask,
                                          global_normalization_factor=global_valid_toks).item()
        if self.reference_policy_kl_penalty != 0:
            kl_importance_weights = torch.exp(curr_logprobs_unfiltered - curr_logprobs_unfiltered.detach())
            kl_importance_weights = torch.nan_to_num(kl_importance_weights, nan=0.0, posinf=0.0, neginf=0.0)
            kl = self.reference_policy_kl_penalty * calculate_kl(
                logprobs=curr_logprobs_unfiltered, logprobs_reference=reference_policy_logprobs,
                kl_type=self.reference_policy_kl_type, input_clamp_value=self.kl_input_clamp_value,
                output_clamp_value=self.kl_output_clamp_value, importance_sampling_weights=kl_importance_weights)
            if self.loss_type == LossType.TOKEN_LEVEL:
                kl = masked_mean(kl, mask, global_normalization_factor=global_valid_toks)
            else:
                kl = masked_mean(masked_mean(kl, token_mask, dim=-1), sample_mask,
                                 global_normalization_factor=global_valid_seqs)
        else:
            kl = torch.tensor(0.0)
        if self.force_on_policy_ratio:
            log_ratios = curr_logprobs - curr_logprobs.detach()
            ratios = log_ratios.exp()
            ratios_clamped = ratios
        else:
            log_ratios = curr_logprobs - prev_logprobs
            ratios = log_ratios.exp()
            ratios_clamped = ratios.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)
        loss1 = -advantages * ratios
        loss2 = -advantages * ratios_clamped
        clip_loss = torch.max(loss1, loss2)
        if self.ratio_clip_c is not None:
            loss3 = -advantages * self.ratio_clip_c
            clip_loss = torch.where(advantages < 0, torch.min(clip_loss, loss3), clip_loss)
        actor_importance_weights = torch.nan_to_num(torch.exp(prev_logprobs - generation_logprobs),
                                                    nan=0.0, posinf=0.0, neginf=0.0)
        importance_weights_to_use = torch.ones_like(prev_logprobs)
        if self.loss_type == LossType.TOKEN_LEVEL:
            actor_loss = masked_mean(importance_weights_to_use * clip_loss, mask,
                                     global_normalization_factor=global_valid_toks)
        else:
            actor_loss = masked_mean(masked_mean(importance_weights_to_use * clip_loss, token_mask, dim=-1),
                                     sample_mask, global_normalization_factor=global_valid_seqs)
        sample_importance_ratio = masked_mean(actor_importance_weights, mask,
                                              global_normalization_factor=global_valid_toks)
        with torch.no_grad():
            seq_entropy_approx = -masked_mean(torch.exp(curr_logprobs - generation_logprobs) * curr_logprobs, mask,
                                              global_normalization_factor=global_valid_toks)
        nll_loss = torch.tensor(0.0, device=mask.device)
        loss = actor_loss + kl + 0.0 * nll_loss
        with torch.no_grad():
            probs_ratio = masked_mean(ratios.detach(), mask, global_normalization_factor=global_valid_toks).item()
            probs_ratio_clamped = masked_mean(ratios_clamped.detach(), mask,
                                              global_normalization_factor=global_valid_toks).item()
            masked_ratios = ratios.detach()[mask.bool()]
            masked_ratios_clamped = ratios_clamped.detach()[mask.bool()]
            probs_ratio_min, probs_ratio_max = masked_ratios.min().item(), masked_ratios.max().item()
            probs_ratio_clamped_min = masked_ratios_clamped.min().item()
            probs_ratio_clamped_max = masked_ratios_clamped.max().item()
        return (loss, {
            "loss": loss.item(), "probs_ratio": probs_ratio, "probs_ratio_clamped": probs_ratio_clamped,
            "probs_ratio_min": probs_ratio_min, "probs_ratio_max": probs_ratio_max,
            "probs_ratio_clamped_min": probs_ratio_clamped_min, "probs_ratio_clamped_max": probs_ratio_clamped_max,
            "kl_penalty": kl.item() / self.reference_policy_kl_penalty if kl else 0,
            "token_mult_prob_error": mult_prob_error, "gen_kl_error": gen_kl_error,
            "policy_kl_error": policy_kl_error, "js_divergence_error": js_divergence_error,
            "sampling_importance_ratio": sample_importance_ratio.item(),
            "num_valid_samples": sample_mask.sum().item(), "approx_entropy": seq_entropy_approx.item(),
            "positive_nll_loss": nll_loss.item()})


def get_next_token_logprobs_from_logits(input_ids, next_token_logits):   # model_utils.py L1649, L1677-1693
    next_token_logits = next_token_logits.to(torch.float32)
    next_token_logits_wo_last = next_token_logits[:, :-1]
    next_token_logprobs = torch.nn.functional.log_softmax(next_token_logits_wo_last, dim=-1)
    next_tokens = input_ids[:, 1:]
    return next_token_logprobs.gather(dim=-1, index=next_tokens.unsqueeze(-1)).squeeze(-1)


def prepare_loss_input(logits, data, loss_fn):                      # loss/utils.py L71-120 (LOGPROB, unfused)
    if loss_fn.input_type == LossInputType.LOGIT:
        loss_input = {"logits": logits}
    elif loss_fn.input_type == LossInputType.LOGPROB:
        if hasattr(loss_fn, "use_fused_linear_logprobs") and loss_fn.use_fused_linear_logprobs:
            logprobs = logits.to(torch.float32)[:, : data["input_ids"].shape[1] - 1]
        else:
            logprobs = get_next_token_logprobs_from_logits(input_ids=data["input_ids"], next_token_logits=logits)
        loss_input = {"next_token_logprobs": logprobs}
    else:
        raise ValueError(f"Unknown loss function input type: {loss_fn.input_type}")
    return loss_input, data


def process_global_batch(batch, loss_fn, all_reduce=None):          # automodel/data.py L404-431
    assert "sample_mask" in batch, "sample_mask must be present in the data!"
    local_valid_seqs = torch.sum(batch["sample_mask"])
    local_valid_toks = torch.sum(batch["token_mask"][:, 1:] * batch["sample_mask"].unsqueeze(-1))
    to_reduce = torch.tensor([local_valid_seqs, local_valid_toks])
    if all_reduce is not None:
        all_reduce(to_reduce)                                       # torch.distributed.all_reduce(dp_group)
    if hasattr(loss_fn, "loss_type") and loss_fn.loss_type == LossType.TOKEN_LEVEL:
        assert "token_mask" in batch, "token_mask must be present in the data when using token-level loss"
    return {"batch": batch, "global_valid_seqs": to_reduce[0], "global_valid_toks": to_reduce[1]}


def worker_train(model, optimizer, data, loss_fn, gbs, mbs, dp_size=1, all_reduce=None):
    """dtensor_policy_worker_v2.py L478-566 with automodel/train.py L505-548 and L642-651 (num_global_batches
    from the local data, cp_size = 1)."""
    num_global_batches = data["input_ids"].shape[0] * dp_size // gbs
    local_gbs = gbs // dp_size
    all_mb_metrics, losses = [], []
    for gb_idx in range(num_global_batches):
        batch = {k: v[gb_idx * local_gbs:(gb_idx + 1) * local_gbs] for k, v in data.items()}
        gb = process_global_batch(batch, loss_fn, all_reduce)
        optimizer.zero_grad()
        mb_losses = []
        for start in range(0, local_gbs, mbs):
            mb = {k: v[start:start + mbs] for k, v in gb["batch"].items()}
            logits = model(mb["input_ids"])
            loss_input, mb = prepare_loss_input(logits, mb, loss_fn)           # LossPostProcessor L642-651
            result, metrics = loss_fn(data=mb, global_valid_seqs=gb["global_valid_seqs"],
                                      global_valid_toks=gb["global_valid_toks"], **loss_input)
            for k in metrics.keys():                                         # train.py L525-533
                if "_min" in k or "_max" in k:
                    continue
                metrics[k] /= num_global_batches
            loss = result * dp_size * 1                                      # L547: dp_size * cp_size
            loss.backward()
            if metrics["num_valid_samples"] > 0:                             # worker L527-537
                mb_losses.append(loss.item())
                all_mb_metrics.append(metrics)
        optimizer.step()                                                     # worker L563
        losses.append(sum(mb_losses))
    return losses, all_mb_metrics


def grpo_aggregate(all_mb_metrics):                                 # grpo.py L3466-3492 (train metrics part)
    lists = {}
    for m in all_mb_metrics:
        for k, v in m.items():
            lists.setdefault(k, []).append(v)
    out = {}
    for k, v in lists.items():
        if k in {"probs_ratio_min", "probs_ratio_clamped_min"}:
            out[k] = min(x for x in v if abs(x) != float("inf"))
        elif k in {"probs_ratio_max", "probs_ratio_clamped_max"}:
            out[k] = max(x for x in v if abs(x) != float("inf"))
        else:
            out[k] = sum(v)
    return out


# ----------------------------------------------------------------------------------------- data
V, S, PROMPT = 16, 24, 5


class TinyLM(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(V, V)

    def forward(self, input_ids):
        return self.emb(input_ids) * 2.0


def make_data(seed: int, rows: int = 8, model=None, amplify: bool = False):
    """GRPO-shaped data: prompt (token_mask 0), right-padded responses of different lengths, an environment span
    (token_mask 0) inside row 1; prev / reference log-probs around the model's (PPO ratios well outside the clip
    range, some beyond the dual clip), generation log-probs below prev.

    ``amplify``: the sampler biased in the amplifying direction instead — advantages −1.5 (even rows) / +0.5 (odd
    rows) × U(1, 1.2), generation log-probs 0.5 nats (± 0.1 noise) above the model's on A<0 rows and 0.5 below
    on A>0 rows (δ = learner − generation ≈ ∓0.5 on every token, A⁻ mass about three times A⁺'s: window ρ_asym
    ≈ 3, the shipped rules fire)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (rows, S), generator=g)
    lengths = torch.randint(S - 8, S + 1, (rows,), generator=g)
    token_mask = torch.zeros(rows, S)
    for r in range(rows):
        token_mask[r, PROMPT:int(lengths[r])] = 1
    token_mask[1, 12:15] = 0
    model = model or TinyLM()
    with torch.no_grad():
        live = get_next_token_logprobs_from_logits(ids, model(ids))
    prev = torch.zeros(rows, S)
    prev[:, 1:] = (live + 0.7 * torch.randn(rows, S - 1, generator=g)).clamp(max=-1e-3)   # ratios far from 1
    gen = torch.where(token_mask > 0, (prev - 0.3 * torch.rand(rows, S, generator=g)).clamp(max=-1e-3),
                      torch.zeros(()))
    ref = torch.zeros(rows, S)
    ref[:, 1:] = live + 0.2 * torch.randn(rows, S - 1, generator=g)
    adv = (torch.randn(rows, 1, generator=g) * token_mask).expand(rows, S).contiguous()
    if amplify:
        neg = (torch.arange(rows) % 2 == 0)[:, None]                 # A<0 on the even rows
        scale = 1 + 0.2 * torch.rand(rows, 1, generator=g)
        adv = (torch.where(neg, -1.5, 0.5) * scale * token_mask).expand(rows, S).contiguous()
        biased = torch.zeros(rows, S)
        biased[:, 1:] = (live + torch.where(neg, 0.5, -0.5) + 0.1 * torch.randn(rows, S - 1, generator=g)).clamp(
            max=-1e-3)
        gen = torch.where(token_mask > 0, biased, torch.zeros(()))
    sample_mask = torch.ones(rows)
    sample_mask[-1] = 0                                             # one invalid sample
    return {"input_ids": ids, "prev_logprobs": prev, "generation_logprobs": gen, "reference_policy_logprobs": ref,
            "advantages": adv, "token_mask": token_mask, "sample_mask": sample_mask}


OFF = TriageConfig(gate=False, tis=False, repair=False)
NEMO_KEYS = ("loss", "probs_ratio", "probs_ratio_clamped", "probs_ratio_min", "probs_ratio_max",
             "probs_ratio_clamped_min", "probs_ratio_clamped_max", "kl_penalty", "token_mult_prob_error",
             "gen_kl_error", "policy_kl_error", "js_divergence_error", "sampling_importance_ratio",
             "num_valid_samples", "approx_entropy", "positive_nll_loss")


def run(loss_fn, cfg_seed=0, data=None):
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    losses, mb = worker_train(model, opt, data or make_data(cfg_seed), loss_fn, gbs=8, mbs=2)
    return losses, mb, model.emb.weight.grad.clone()


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("cfg", [{}, {"ratio_clip_c": 3.0, "ratio_clip_max": 0.28},
                                 {"token_level_loss": False, "reference_policy_kl_type": "k2"},
                                 {"force_on_policy_ratio": True, "reference_policy_kl_penalty": 0.0}],
                         ids=["default", "dual-clip", "sequence-level", "on-policy-no-kl"])
@pytest.mark.parametrize("triage", [None, OFF], ids=["monitor-only", "triage-off"])
def test_triage_off_equals_clipped_pg_loss_through_the_worker(cfg, triage, nemo_interfaces):
    """Through prepare_loss_input → loss_fn(...) → backward per micro-batch → optimizer step: the loss, the
    gradient and every metric NeMo's ClippedPGLossFn reports agree on the same tensors."""
    data = make_data(1)
    ours = nemo_rl.NemoRLTriageLoss(cfg, triage=triage)
    assert ours.input_type is LossInputType.LOGPROB
    assert ours.loss_type is (LossType.TOKEN_LEVEL if cfg.get("token_level_loss", True) else LossType.SEQUENCE_LEVEL)
    lo, mo, go = run(ours, data=data)
    lr, mr, gr = run(ClippedPGLossFn(cfg), data=data)
    assert len(mo) == len(mr) == 4
    assert lo == pytest.approx(lr, rel=1e-6, abs=1e-7)
    assert torch.allclose(go, gr, atol=1e-6) and float(gr.abs().sum()) > 0
    for a, b in zip(mo, mr):
        for k in NEMO_KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    assert bool([k for k in mo[0] if k.startswith("triage/")]) == (triage is not None)
    close_all()


def test_triage_on_keeps_nemos_metrics_and_sums_ours_to_step_means(nemo_interfaces, tmp_path):
    """With the controller on: NeMo's mismatch metrics are unchanged (they describe prev vs generation); our
    statistics are token-normalised like NeMo's, so grpo.py's sum over micro-batches is the step's token mean
    (checked against the gate weights the monitor recorded per token)."""
    data = make_data(2)
    late = torch.where(torch.arange(S) > 15, 2.0, 0.05)              # learner far below the sampler late on
    data["generation_logprobs"] = torch.where(data["token_mask"] > 0,
                                              (data["prev_logprobs"] + late).clamp(max=-1e-3), torch.zeros(()))
    ours = nemo_rl.NemoRLTriageLoss({}, triage=TriageConfig(gate_width=4), run_dir=str(tmp_path / "run"))
    _, mo, _ = run(ours, data=data)
    _, mr, _ = run(ClippedPGLossFn({}), data=data)
    for k in ("token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error"):
        assert [m[k] for m in mo] == pytest.approx([m[k] for m in mr], rel=1e-6), k
    agg = grpo_aggregate(mo)
    close_all()
    tokens = pd.read_parquet(tmp_path / "run" / "tokens")
    assert len(tokens) == int((data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)).sum())
    assert agg["triage/gate_weight_mean"] == pytest.approx(float(tokens.gate_weight.mean()), rel=1e-5)
    assert agg["triage/gate_weight_mean"] < 1
    assert ours.metric_normalizations["triage/gate_weight_mean"] is MetricNormalizer.TOKENS
    assert ours.metric_normalizations["token_mult_prob_error"] is MetricNormalizer.TOKENS


def test_unsupported_options_raise_at_construction():
    with pytest.raises(ValueError, match=r"loss_fn.use_cispo=True .*set it to False"):
        nemo_rl.NemoRLTriageLoss({"use_cispo": True})
    with pytest.raises(ValueError, match=r"use_importance_sampling_correction=True.*TRIAGE's TIS"):
        nemo_rl.NemoRLTriageLoss({"use_importance_sampling_correction": True})
    with pytest.raises(ValueError, match="ratio_clip_c must be > 1"):
        nemo_rl.NemoRLTriageLoss({"ratio_clip_c": 1.0})
    nemo_rl.NemoRLTriageLoss({"use_kl_in_reward": True, "truncated_importance_sampling_type": None})


def test_global_token_normalization_is_refused_at_construction():
    """NeMo divides by global_valid_toks / global_valid_seqs: the weights are renormalised per response, so a
    TriageConfig asking for the global token mean is refused at construction, naming the setting."""
    with pytest.raises(ValueError, match=r"NemoRLTriageLoss: TriageConfig.normalization='global_token' cannot be "
                                         r"honoured: NeMo RL divides the loss by global_valid_toks"):
        nemo_rl.NemoRLTriageLoss({}, triage=TriageConfig(normalization="global_token"))
    with pytest.raises(ValueError, match=r"normalization='global_token'"):
        nemo_rl.NemoRLTriageLoss({}, triage={"normalization": "global_token"})
    nemo_rl.NemoRLTriageLoss({}, triage=TriageConfig())


@pytest.mark.parametrize("token_level", [True, False], ids=["token-level", "sequence-level"])
def test_gate_weights_renormalise_per_response_under_nemos_normaliser(token_level, nemo_interfaces):
    """docs/hooks.md#triage-weights-under-a-frameworks-normaliser as NeMo calls the loss (÷ global_valid_toks, or
    per-sequence means ÷ global_valid_seqs): three 4-token responses after a prompt token, A = −1, −1, +1, the
    generation log-probs above the live ones by −δ, prev = live (ratio 1): response a partly gated (δ = +0.2
    ungated, tier 0.3 on the rest), b all gated.  Gradient per token over the Gate-off one: w · 4 / W."""
    delta = torch.tensor([[0.2, -0.8, -0.9, -1.0], [-0.8, -0.9, -1.0, -0.7], [-0.8, -0.9, -1.0, -0.7]])
    gen = torch.full((3, 5), -2.0)
    token_mask = torch.ones(3, 5)
    token_mask[:, 0] = 0                                              # the prompt token
    adv = torch.tensor([-1.0, -1.0, 1.0])[:, None].expand(3, 5).contiguous()
    cfg = {"reference_policy_kl_penalty": 0.0, "token_level_loss": token_level}
    grads = {}
    for name, triage in (("off", OFF), ("on", TriageConfig(tis=False, repair=False, gate_width=4))):
        live = (gen[:, 1:] + delta).requires_grad_()
        prev = torch.zeros(3, 5)
        prev[:, 1:] = live.detach()
        data = {"prev_logprobs": prev, "generation_logprobs": gen * token_mask, "advantages": adv * token_mask,
                "reference_policy_logprobs": prev.clone(), "token_mask": token_mask, "sample_mask": torch.ones(3)}
        loss, _ = nemo_rl.NemoRLTriageLoss(cfg, triage=triage)(live, data, torch.tensor(3.0), torch.tensor(12.0))
        loss.backward()
        grads[name] = live.grad
    s = 4 / 1.9
    want = torch.tensor([[s, .3 * s, .3 * s, .3 * s], [1.0] * 4, [1.0] * 4])
    assert (grads["off"] != 0).all()
    assert torch.allclose(grads["on"] / grads["off"], want, rtol=1e-5)
    close_all()


def test_pickles_to_configuration_only(tmp_path):
    hook = nemo_rl.NemoRLTriageLoss({}, triage=TriageConfig(), run_dir=str(tmp_path / "run"))
    rt = hook.runtime
    assert rt.controller is not None
    data = cloudpickle.dumps(hook)
    assert b"MismatchMonitor" not in data and b"TriageController" not in data
    assert cloudpickle.loads(data).runtime is rt
    rt.close()


def test_hook_options_are_validated_naming_the_option():
    with pytest.raises(ValueError, match=r"NemoRLTriageLoss: alerts=3"):
        nemo_rl.NemoRLTriageLoss({}, alerts=3)
    with pytest.raises(ValueError, match=r"NemoRLTriageLoss: loggers: tracker kind 'nope'"):
        nemo_rl.NemoRLTriageLoss({}, loggers=["nope"])
    with pytest.raises(ValueError, match=r"NemoRLTriageLoss: loggers: .* is a live object"):
        nemo_rl.NemoRLTriageLoss({}, loggers=[recording_tracker.RecordingTracker.__new__(
            recording_tracker.RecordingTracker)])
    with pytest.raises(ValueError, match=r"NemoRLTriageLoss: framework_keys=\[\]"):
        nemo_rl.NemoRLTriageLoss({}, framework_keys=[])
    hook = nemo_rl.NemoRLTriageLoss({}, run_dir="r", alerts="rules.toml", loggers="tensorboard",
                                    framework_keys="all")
    assert (hook.settings.alerts, [t.kind for t in hook.settings.loggers], hook.settings.framework_keys) == \
        ("rules.toml", ["tensorboard"], "all")


RULES = """
[[rules]]
name = "test_rho_asym_above_2"
metric = "window/rho_asym"
condition = "above"
threshold = 2.0
hold = 2
level = "WARN"
"""


def train_calls(loss_fn, steps: int, gbs: int = 8, empty_first: int = -1):
    """GRPO steps through the transcribed worker: one policy.train call per step on a persistent model and
    optimizer (as NeMo's workers keep them), each call's metrics aggregated as grpo.py does.  ``empty_first``: the
    call whose first micro-batch has no valid sample (NeMo drops its metrics)."""
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = []
    for step in range(steps):
        data = make_data(200 + step, rows=8, amplify=True)
        if step == empty_first:
            data["sample_mask"][:2] = 0
        _, mb = worker_train(model, opt, data, loss_fn, gbs=gbs, mbs=2)
        out.append(grpo_aggregate(mb))
    return out


def test_curated_metrics_reach_grpos_train_metrics_and_the_options_reach_the_monitor(nemo_interfaces, tmp_path):
    """An amplifying sampler over 6 GRPO steps: the metrics GRPO aggregates from the loss's dicts hold the curated
    keys with the steps-table value of the previous step (also when the step's first micro-batch has no valid
    sample), NeMo's own keys unchanged; the rule file given as ``alerts`` is the one evaluated (its rule fires
    once, logged once), the ``loggers`` tracker receives the steps and the alert."""
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    rec = tmp_path / "rec.jsonl"
    recording_tracker.register()
    lines = recording_tracker.AlertLines()
    loss_fn = nemo_rl.NemoRLTriageLoss({}, triage=TriageConfig(gate_width=4, calibration=dict(window=1)),
                                       run_dir=str(tmp_path / "run"), monitor=MonitorConfig(window=4,
                                                                                            calibration_steps=2),
                                       alerts=str(rules), loggers=[{"kind": "recorder", "path": str(rec)}])
    logged = train_calls(loss_fn, 6, empty_first=3)
    close_all()
    lines.remove()
    steps = recording_tracker.steps_table(tmp_path / "run")
    assert steps.index.tolist() == list(range(6))
    checked = set()
    for s, m in enumerate(logged):
        assert set(NEMO_KEYS) <= set(m)
        ours = {k for k in m if k.startswith("triage/")}
        assert "triage/gate_weight_mean" in ours                          # per micro-batch, token-normalised
        if s == 0:
            assert "triage/metrics_step" not in ours and "triage/gate_downweighted_frac" not in ours
            continue
        assert m["triage/metrics_step"] == s - 1
        want = shown(steps.loc[s - 1])               # ratios at noise level left out, as on every tracker
        for k in CURATED_KEYS:
            v = want.get(k, math.nan)
            if math.isfinite(v):
                assert m[f"triage/{k}"] == pytest.approx(v, rel=1e-12), (s, k)
                checked.add(k)
            else:
                assert f"triage/{k}" not in m
    assert checked == set(CURATED_KEYS)
    assert logged[5]["triage/alerts_active"] == steps.loc[4, "alerts_active"] == 1
    alerts = recording_tracker.alerts_table(tmp_path / "run")
    assert alerts["rule"].tolist() == ["test_rho_asym_above_2"] and alerts["rank"].tolist() == [0]
    assert len(lines.lines) == 1 and "test_rho_asym_above_2" in lines.lines[0]
    rows = recording_tracker.read(rec)
    assert [r["rule"] for r in rows if r["kind"] == "alert"] == ["test_rho_asym_above_2"]
    assert [r["step"] for r in rows if r["kind"] == "metrics"] == list(range(6))
    norms = loss_fn.metric_normalizations
    assert all(norms[f"triage/{k}"] is MetricNormalizer.NONE for k in (*CURATED_KEYS, "metrics_step"))
    assert norms["triage/gate_weight_mean"] is MetricNormalizer.TOKENS


def test_two_global_batches_per_call_log_the_mean_of_their_previous_steps(nemo_interfaces, tmp_path):
    """train_global_batch_size half the step's rows: two optimizer steps (two monitored steps) per policy.train
    call; NeMo's ÷ num_global_batches and GRPO's sum give the mean of the two steps before each global batch (as
    docs/hooks.md#nemo-rl says; in the job's first call the global batch before any logged step adds 0); without
    alerts triage/alerts_active is absent (NaN in the steps table)."""
    loss_fn = nemo_rl.NemoRLTriageLoss({}, run_dir=str(tmp_path / "run"), alerts=False,
                                       monitor=MonitorConfig(window=4, calibration_steps=2))
    logged = train_calls(loss_fn, 3, gbs=4)
    close_all()
    steps = recording_tracker.steps_table(tmp_path / "run")
    assert steps.index.tolist() == list(range(6))                          # 2 monitored steps per call
    # the first call: its first global batch has no step before it and adds nothing, its second reports step 0
    assert logged[0]["triage/metrics_step"] == 0.0
    assert logged[0]["triage/window/rho_asym"] == pytest.approx(steps.loc[0, "window/rho_asym"] / 2, rel=1e-12)
    for call in (1, 2):
        before = [2 * call - 1, 2 * call]                                 # the steps before its 2 global batches
        assert logged[call]["triage/metrics_step"] == pytest.approx(sum(before) / 2)
        for k in ("window/rho_asym", "delta_abs_mean"):
            assert logged[call][f"triage/{k}"] == pytest.approx(steps.loc[before, k].mean(), rel=1e-12)
        assert "triage/alerts_active" not in logged[call]
    assert steps["alerts_active"].isna().all()


class Logger:
    """NeMo RL's ``Logger`` fan-out (``nemo_rl/utils/logger.py`` L964-1110 at 7ea279ab): ``self.loggers`` holds the
    enabled backends; ``log_metrics`` calls each one's ``log_metrics(metrics, step, prefix, step_metric,
    step_finished)`` (L1035-1053), ``finish`` each one's ``finish`` where it has one (L1063-1068)."""

    def __init__(self, backends):
        self.loggers = list(backends)

    def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False):
        for logger in self.loggers:
            logger.log_metrics(metrics, step, prefix, step_metric, step_finished)

    def finish(self):
        for logger in self.loggers:
            finish = getattr(logger, "finish", None)
            if callable(finish):
                finish()


class RecordingBackend:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False):
        self.calls.append((prefix, step, dict(metrics)))


def test_grpos_step_timers_reach_the_last_optimizer_step_of_each_grpo_step(nemo_interfaces, tmp_path):
    """loss_fn.record_timings(logger) on the driver; 3 GRPO steps of 2 global batches each (2 optimizer steps,
    monitored steps 0-5) through the transcribed worker, each step's rows on disk when policy.train returns (as a
    Ray worker flushes at its optimizer step); then GRPO's last log of the step, its Timer sums under
    prefix="timing/train" at total_steps + 1 (grpo.py L3657-3659, L3767-3772): the phases land on each GRPO
    step's last optimizer step (1, 3, 5), the others stay untimed; NeMo's own backends get the call unchanged."""
    from triage_monitor.offline.analysis import open_run

    loss_fn = nemo_rl.NemoRLTriageLoss({}, run_dir=str(tmp_path / "run"), alerts=False,
                                       monitor=MonitorConfig(window=4, calibration_steps=2))
    own = RecordingBackend()
    logger = Logger([own])
    backend = loss_fn.record_timings(logger)
    assert loss_fn.record_timings(logger) is backend and len(logger.loggers) == 2
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for total_steps in range(3):
        worker_train(model, opt, make_data(300 + total_steps, rows=8, amplify=True), loss_fn, gbs=4, mbs=2)
        loss_fn.runtime.monitor.flush()
        timing_metrics = {"generation": 6.0 + total_steps, "policy_and_reference_logprobs": 1.0,
                          "reward_calculation": 0.25, "advantage_calculation": 0.25, "policy_training": 2.0,
                          "prepare_for_generation/total": 0.5, "total_step_time": 10.0 + total_steps,
                          "valid_tokens_per_sec_per_gpu": 1234.0}
        # GRPO's metrics of the step: "reward" = np.mean of the batch's total_reward (grpo.py L3435, L3480-3490)
        rewards = np.array([1.0, 0.0, 0.5, 0.25 * total_steps])          # the batch's total_reward
        metrics = {"loss": 0.1, "reward": np.mean(rewards).item()}
        logger.log_metrics({"mean_gen_tokens_per_sample": 5.0}, total_steps + 1, prefix="train")   # L3022, before
        logger.log_metrics(metrics, total_steps + 1, prefix="train")
        logger.log_metrics(timing_metrics, total_steps + 1, prefix="timing/train", step_finished=True)
    close_all()
    logger.finish()
    steps = open_run(tmp_path / "run").steps().set_index("step")
    assert steps.index.tolist() == list(range(6))
    timed = steps[steps["time/step"].notna()]
    assert timed.index.tolist() == [1, 3, 5]
    assert timed["time/generation"].tolist() == [6.0, 7.0, 8.0] and timed["time/step"].tolist() == [10.0, 11.0, 12.0]
    assert timed["time/reward"].tolist() == [0.5] * 3 and timed["time/logprob"].tolist() == [1.0] * 3
    assert timed["time/update"].tolist() == [2.0] * 3 and timed["time/weight_sync"].tolist() == [0.5] * 3
    # GRPO's train/reward of each step is the reward of its last optimizer step's row: 0.375, 0.4375, 0.5
    assert timed["reward"].tolist() == [0.375, 0.4375, 0.5]
    assert steps.drop(index=[1, 3, 5])["reward"].isna().all()
    late = open_run(tmp_path / "run").timings()
    assert late["framework_step"].tolist() == [1, 2, 3] and set(late["framework"]) == {"nemo_rl"}
    assert [c[0] for c in own.calls] == ["train", "train", "timing/train"] * 3 and own.calls[2][2]["generation"] == 6.0
    assert not [p for p in (tmp_path / "run" / "timings").iterdir() if p.name.startswith(".")]   # sealed at finish


# ------------------------------------------------------------------------- real Ray cluster, 2 workers
STEPS, GBS, MBS = 4, 16, 2


def ray_worker_class(ray):
    @ray.remote(num_cpus=1)
    class PolicyWorker:
        """A data-parallel NeMo policy worker: a gloo process group (NeMo: NCCL), a model and an optimizer that
        live across train calls (lm_policy.train reuses the same workers)."""

        def setup(self, rank, world, port):
            import torch.distributed as dist

            import recording_tracker
            import test_hooks_nemo_rl as t
            t.install_nemo_interfaces()
            recording_tracker.register()                             # the "recorder" tracker kind, in the worker
            self.lines = recording_tracker.AlertLines()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
            self.t, self.rank, self.world = t, rank, world
            self.model = t.TinyLM()
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
            return os.getpid()

        def train(self, data, loss_fn, gbs, mbs):
            import torch.distributed as dist

            _, mb = self.t.worker_train(self.model, self.opt, data, loss_fn, gbs, mbs, dp_size=self.world,
                                        all_reduce=dist.all_reduce)
            rt = loss_fn.runtime
            return {"pid": os.getpid(), "mb_metrics": mb, "calls": rt.calls, "controller_calls": rt.controller.calls,
                    "optimizer_steps": rt.optimizer_steps, "thresholds": rt.controller.state_dict()["thresholds"],
                    "runtime_id": id(rt), "alert_lines": list(self.lines.lines)}

        def finish(self):
            import torch.distributed as dist

            close_all()
            dist.destroy_process_group()

    return PolicyWorker


def test_loss_fn_reshipped_every_call_keeps_calibration_and_every_token_once(tmp_path):
    """lm_policy.train ships loss_fn to both workers on every call: 4 calls (4 optimizer steps) × 4 micro-batches
    per worker give 4 monitored steps, each valid token once per rank, one run.json, and each worker's controller
    calibrates once and keeps its thresholds across the re-pickled copies.  With an amplifying sampler and the
    shipped rules: GRPO's train metrics (both workers' lists, lm_policy.py L853-858) carry the curated keys with
    rank 0's steps-table value of the previous step (the workers' gloo group all-reduces the step and window
    metrics); each alert is raised once for the job (one alerts/ row, one log line, in worker 0 only) and reaches
    the ``loggers`` tracker, which only worker 0 built."""
    import ray                          # installed by make setup-test (requirements-frameworks.txt): never skipped
    recording_tracker.register()
    rec = tmp_path / "rec.jsonl"
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}})
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        loss_fn = nemo_rl.NemoRLTriageLoss({}, triage=TriageConfig(gate_width=4, calibration=dict(window=1)),
                                           run_dir=str(tmp_path / "run"), monitor=MonitorConfig(window=2),
                                           alerts=True, loggers=[{"kind": "recorder", "path": str(rec)}])
        Worker = ray_worker_class(ray)
        workers = [Worker.remote() for _ in range(2)]
        pids = ray.get([w.setup.remote(r, 2, port) for r, w in enumerate(workers)])
        valid = [[], []]
        results = []
        for step in range(STEPS):
            full = make_data(100 + step, rows=GBS, amplify=True)
            shards = [{k: v[r * GBS // 2:(r + 1) * GBS // 2] for k, v in full.items()} for r in range(2)]
            for r, sh in enumerate(shards):
                valid[r].append(int((sh["token_mask"][:, 1:] * sh["sample_mask"].unsqueeze(-1)).sum()))
            # lm_policy.py L798-816: common_kwargs={"loss_fn": loss_fn, ...} → pickled into each worker, per call
            results.append(ray.get([w.train.remote(sh, loss_fn=loss_fn, gbs=GBS, mbs=MBS)
                                    for w, sh in zip(workers, shards)]))
        ray.get([w.finish.remote() for w in workers])
    finally:
        ray.shutdown()
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for r in range(2):
        per_call = [res[r] for res in results]
        assert len({c["runtime_id"] for c in per_call}) == 1        # every unpickled copy found the same runtime
        assert [c["calls"] for c in per_call] == [4 * (i + 1) for i in range(STEPS)]
        assert [c["controller_calls"] for c in per_call] == [4 * (i + 1) for i in range(STEPS)]
        assert [c["optimizer_steps"] for c in per_call] == list(range(1, STEPS + 1))
        # window=1: step 0's δ (first shipped copy) calibrates the thresholds at step 1 (second copy), kept at step 2
        assert per_call[0]["thresholds"] is None and per_call[1]["thresholds"] is not None
        assert per_call[2]["thresholds"] == per_call[1]["thresholds"]
        for c in per_call:      # the controller's per-micro-batch statistics, but the one the curated set claims
            assert all(f"triage/{k}" in m for m in c["mb_metrics"] for k in nemo_rl.TRIAGE_STATS
                       if k != "gate_downweighted_frac")
    assert runtime_for(loss_fn.settings).calls == 0                 # the driver never ran the loss
    tokens = pd.read_parquet(tmp_path / "run" / "tokens")
    counts = tokens.groupby(["step", "rank"]).size()
    for step in range(STEPS):
        for r in range(2):
            assert counts[(step, r)] == valid[r][step]              # every valid token once, none duplicated
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert len(manifest["attempts"]) == 1 and manifest["info"]["framework"] == "nemo-rl"
    assert set(tokens.attempt) == {manifest["attempts"][0]["attempt"]}
    # what GRPO logs: both workers' micro-batch lists concatenated (lm_policy.py L853-858), then grpo.py's sums
    steps = recording_tracker.steps_table(tmp_path / "run", rank=0)
    assert recording_tracker.steps_table(tmp_path / "run", rank=1).empty     # the step's one row is rank 0's
    for step, res in enumerate(results):
        m = grpo_aggregate(res[0]["mb_metrics"] + res[1]["mb_metrics"])
        if step == 0:
            assert "triage/metrics_step" not in m
            continue
        assert m["triage/metrics_step"] == step - 1
        want = shown(steps.loc[step - 1])
        for k in CURATED_KEYS:
            v = want.get(k, math.nan)
            assert m.get(f"triage/{k}", float("nan")) == pytest.approx(v, rel=1e-12) if math.isfinite(v) \
                else f"triage/{k}" not in m, (step, k)
    alerts = recording_tracker.alerts_table(tmp_path / "run")
    assert "rho_asym_critical" in set(alerts["rule"]) and set(alerts["rank"]) == {0}
    assert not alerts["rule"].duplicated().any()
    assert len(results[-1][0]["alert_lines"]) == len(alerts) and results[-1][1]["alert_lines"] == []
    assert grpo_aggregate(results[-1][0]["mb_metrics"] + results[-1][1]["mb_metrics"])["triage/alerts_active"] >= 1
    rows = recording_tracker.read(rec)
    assert {r["pid"] for r in rows} == {pids[0]}
    assert sorted(r["rule"] for r in rows if r["kind"] == "alert") == sorted(alerts["rule"])


def test_the_docs_lines_configure_the_hook():
    """The snippet of docs/hooks.md#nemo-rl, run as written (``master_config.loss_fn`` NeMo's defaults): the hook
    carries the controller, the run directory and the three options as configuration."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text()
    section = text.split("\n## NeMo RL\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    logger = Logger([])
    ns = {"master_config": types.SimpleNamespace(loss_fn={}), "logger": logger}
    exec(code, ns)
    assert [type(b) for b in logger.loggers] == [nemo_rl.TimingsBackend]
    s = ns["loss_fn"].settings
    assert (s.run_dir, s.alerts, s.framework_keys) == ("results/triage", True, "curated")
    assert s.triage is not None and [t.kind for t in s.loggers] == ["tensorboard", "mlflow"]
    assert b"MismatchMonitor" not in cloudpickle.dumps(ns["loss_fn"])
