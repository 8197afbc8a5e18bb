"""prime-rl contract test: our custom loss driven through prime-rl's own call site, transcribed.

prime-rl does not install on a CPU machine (CUDA-only trainer: torch.compile'd kernels, FSDP2 on "cuda",
flash-attn), so the calling code is reproduced here from its public repository at commit
559b44772e471d1538537b8805cc77f3824a5e64 (PrimeIntellect-ai/prime-rl):

- ``src/prime_rl/trainer/rl/loss.py`` L13-36 (``LossInputs``, ``LossOutputs``), L94-106 (``_safe_mean``,
  ``compute_importance_ratio_and_mismatch_kl``), L109-161 (``default_loss_fn``, prime-rl's default loss),
  L262-282 (``setup_rl_loss_fn``), L285-403 (``compute_loss``);
- ``src/prime_rl/utils/utils.py`` L34-38 (``import_object``);
- ``packages/prime-rl-configs/src/prime_rl/configs/trainer.py`` L494-530 (``DefaultLossConfig`` defaults,
  ``CustomLossConfig``: ``import_path``, ``kwargs``);
- ``src/prime_rl/trainer/rl/train.py`` L307-323 (``rl_scale``: global count of rl loss tokens, all-reduced over
  the ranks), L461-475 (the per-micro-batch ``compute_loss`` call on ``split(sequence_lengths)``), L485 and
  L538-539 (the loss and the metric tensors appended to ``Tensors`` per micro-batch), L566 (``optimizer.step()``
  once per step after all micro-batches), L623 and L675-676 (``tensors.compute_stats()`` after the optimizer step;
  ``monitors.log`` of the filtered stats, rank 0 only: ``src/prime_rl/monitors/__init__.py`` L59-61);
- ``src/prime_rl/trainer/utils.py`` L205-235 (``flexible_all_gather``), L238-280 (``Tensors.compute_stats``: every
  rank's values all-gathered into ``<key>/mean|median|std|min|max``), L283-321
  (``filter_rl_trainer_tensor_stats_for_wandb``).
- the orchestrator process, for the reward: ``src/prime_rl/monitors/__init__.py`` L41-84 (``setup``: only the
  configured W&B / Prime / file monitors, refused when ``MONITORS`` is not empty, L58);
  ``src/prime_rl/orchestrator/orchestrator.py`` L195, L219-228, L314-321 (``setup``), L458-461 (``start``), L619-747
  (``finalize_train_batch``: episodes logged at L684, ``progress.step += 1`` at L690, the metrics dict of L698-727
  logged at L747); ``orchestrator/types.py`` L27-30 (``Progress.step = 1``); ``orchestrator/metrics.py`` L244-253,
  L324-335 (the ``train/agg/<subset>/<agent>/reward/...`` keys).

Only type annotations (jaxtyping) and the ce / ref_kl components (absent in RL training: their weight streams
are None) are left out; ``"cuda"`` is the CPU here and the process group gloo.  The adapter itself is imported
through ``import_object`` exactly as prime-rl does.
"""

import asyncio
import importlib
import json
import math
import os
import subprocess
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import cloudpickle
import pandas as pd
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recording_tracker  # noqa: E402
from triage_monitor.offline.analysis import open_run  # noqa: E402
from triage_monitor.triage.controller import TriageConfig  # noqa: E402
from triage_monitor.hooks import prime_rl  # noqa: E402
from triage_monitor.hooks.worker_runtime import close_all  # noqa: E402
from triage_monitor.alerting.trackers import CURATED_KEYS  # noqa: E402

pytestmark = pytest.mark.framework

COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"
assert prime_rl.PRIME_RL_COMMIT == COMMIT


# ----------------------------------------------------------------- transcription of prime-rl @ 559b4477
@dataclass
class LossInputs:                                                   # loss.py L13-28
    trainer_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    loss_weights: torch.Tensor | None = field(default=None)


@dataclass
class LossOutputs:                                                  # loss.py L31-36
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclass
class DefaultLossConfig:                                            # configs/trainer.py L494-507
    type: str = "default"
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    adv_tau: float = 1.0
    kl_tau: float = 1e-3


@dataclass
class CustomLossConfig:                                             # configs/trainer.py L522-528
    import_path: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    type: str = "custom"


def import_object(dotted_path: str) -> Any:                         # utils/utils.py L34-38
    module_path, _, name = dotted_path.rpartition(".")
    module = importlib.import_module(module_path)
    return getattr(module, name)


def _safe_mean(values, mask):                                       # loss.py L94-97
    denom = torch.clamp_min(mask.sum(), 1)
    return values[mask].sum() / denom


def compute_importance_ratio_and_mismatch_kl(trainer_logprobs, inference_logprobs):   # loss.py L100-106
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    mismatch_kl = importance_ratio - log_importance_ratio - 1
    return log_importance_ratio, importance_ratio, mismatch_kl


def default_loss_fn(inputs: LossInputs, loss_config: DefaultLossConfig) -> LossOutputs:   # loss.py L109-161
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    advantages = inputs.advantages
    loss_mask = inputs.loss_mask

    log_importance_ratio, importance_ratio, mismatch_kl = compute_importance_ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )

    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    dppo_invalid_mask_high = probs_diff > loss_config.dppo_mask_high
    dppo_invalid_mask_low = probs_diff < -loss_config.dppo_mask_low
    positive_advantages = advantages > 0
    negative_advantages = advantages < 0
    dppo_invalid_mask = torch.where(positive_advantages, dppo_invalid_mask_high, dppo_invalid_mask_low)

    is_masked = dppo_invalid_mask
    is_masked_high = positive_advantages & dppo_invalid_mask_high
    is_masked_low = negative_advantages & dppo_invalid_mask_low
    drop_mask = loss_mask & is_masked
    keep_mask = loss_mask & ~is_masked

    advantages = loss_config.adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + loss_config.kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()

    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),
        "is_masked": _safe_mean(is_masked, loss_mask),
        "is_masked_low": _safe_mean(is_masked_low, loss_mask),
        "is_masked_high": _safe_mean(is_masked_high, loss_mask),
        "masked_advantage_positive": _safe_mean(positive_advantages, drop_mask),
        "masked_advantage_negative": _safe_mean(negative_advantages, drop_mask),
    }

    return LossOutputs(loss=loss, metrics=metrics)


def setup_rl_loss_fn(loss_config) -> Callable[..., LossOutputs]:   # loss.py L262-282 (IPO branch left out)
    if isinstance(loss_config, CustomLossConfig):
        custom_fn = import_object(loss_config.import_path)
        kwargs = loss_config.kwargs

        def rl_fn(inputs: LossInputs) -> LossOutputs:
            return custom_fn(inputs, **kwargs)
    else:

        def rl_fn(inputs: LossInputs) -> LossOutputs:
            return default_loss_fn(inputs, loss_config)

    return rl_fn


def compute_loss(trainer_logprobs, inference_logprobs, ref_logprobs, advantages, loss_mask, rl_weights,
                 rl_loss_fn, rl_scale):                            # loss.py L285-403 (ce / ref_kl streams None)
    all_metrics: dict[str, list[torch.Tensor]] = {}

    n = len(trainer_logprobs)
    if ref_logprobs is None:
        ref_logprobs = [None] * n
    if rl_weights is None:
        rl_weights = [None] * n

    def run_loss_fn(loss_fn, inputs: LossInputs) -> torch.Tensor:
        result = loss_fn(inputs)
        for k, v in result.metrics.items():
            all_metrics.setdefault(k, []).append(v)
        return result.loss

    rl_loss = trainer_logprobs[0].sum() * 0.0
    for t_logp, i_logp, ref_logp, adv, mask, rl_w in zip(
        trainer_logprobs, inference_logprobs, ref_logprobs, advantages, loss_mask, rl_weights
    ):

        def make_inputs(component_mask, weights) -> LossInputs:
            return LossInputs(trainer_logprobs=t_logp, inference_logprobs=i_logp, ref_logprobs=ref_logp,
                              advantages=adv, loss_mask=component_mask, loss_weights=weights)

        if rl_w is None:
            rl_loss = rl_loss + run_loss_fn(rl_loss_fn, make_inputs(mask, None))
        else:
            rl_mask = mask & (rl_w != 0)
            if bool(rl_mask.any()):
                rl_loss = rl_loss + run_loss_fn(rl_loss_fn, make_inputs(rl_mask, rl_w))

    scaled_loss = rl_loss / rl_scale

    aggregated: dict[str, Any] = {}
    for k, v in all_metrics.items():
        if v[0].dim() == 0:
            aggregated[k] = torch.stack(v)
        else:
            aggregated[k] = torch.cat(v)

    return scaled_loss, aggregated


def flexible_all_gather(tensor):                                    # trainer/utils.py L205-235
    assert tensor.ndim == 1, "Can only flexibly all-gather 1D tensors"
    if dist.get_world_size() == 1:
        return tensor
    local_numel = tensor.numel()
    local_numel_tensor = torch.tensor(local_numel, device=tensor.device)
    all_numel_tensors = [torch.tensor(0, device=tensor.device) for _ in range(dist.get_world_size())]
    dist.all_gather(all_numel_tensors, local_numel_tensor)
    all_numels = [numel.item() for numel in all_numel_tensors]
    max_numel = int(max(all_numels))
    if local_numel < max_numel:
        tensor = torch.cat([tensor, torch.zeros(max_numel - local_numel, dtype=tensor.dtype, device=tensor.device)])
    all_tensors = [torch.zeros(max_numel, dtype=tensor.dtype, device=tensor.device)
                   for _ in range(dist.get_world_size())]
    dist.all_gather(all_tensors, tensor)
    return torch.cat([tensor[:numel] for tensor, numel in zip(all_tensors, all_numels)])


class Tensors(defaultdict):                                         # trainer/utils.py L238-280 ("cuda" → cpu)
    def __init__(self):
        assert dist.is_initialized(), "Tensors requires a distributed environment"
        super().__init__(list)

    def compute_stats(self):
        local_keys = list(self.keys())
        gathered_keys = [None] * dist.get_world_size()
        dist.all_gather_object(gathered_keys, local_keys)
        keys = sorted({key for rank_keys in gathered_keys if rank_keys is not None for key in rank_keys})
        metrics = {}
        for key in keys:
            values = self.pop(key, [])
            tensors = torch.cat(values, dim=0) if values else torch.empty(0)
            assert tensors.ndim == 1, "Can only aggregate 1D tensors"
            tensors = flexible_all_gather(tensors)
            assert tensors.ndim == 1, "Can only aggregate 1D tensors"
            if tensors.numel() == 0:
                for stat in ("mean", "median", "std", "min", "max"):
                    metrics[f"{key}/{stat}"] = float("nan")
                continue
            metrics[f"{key}/mean"] = tensors.mean().item()
            metrics[f"{key}/median"] = torch.median(tensors).item()
            metrics[f"{key}/std"] = tensors.std().item()
            metrics[f"{key}/min"] = tensors.min().item()
            metrics[f"{key}/max"] = tensors.max().item()
            self[key].append(tensors.tolist())
        return metrics


def _is_env_tensor_stat(key, allowed_stats):                        # trainer/utils.py L283-286
    parts = key.split("/")
    return len(parts) >= 3 and parts[-1] in allowed_stats


def filter_rl_trainer_tensor_stats_for_wandb(metrics):              # trainer/utils.py L289-321
    skip_prefixes = ("trainer_probs/", "inference_probs/")
    mean_max_only_prefixes = ("is_masked/", "is_masked_low/", "is_masked_high/", "masked_advantage_positive/",
                              "masked_advantage_negative/", "mismatch_kl/", "masked_mismatch_kl/",
                              "unmasked_mismatch_kl/", "ref_kl/is_masked/", "ref_kl/masked_mismatch_kl/",
                              "ref_kl/unmasked_mismatch_kl/")
    out = {}
    for k, v in metrics.items():
        if k == "step":
            out[k] = v
            continue
        if any(k.startswith(p) for p in skip_prefixes):
            continue
        if k.startswith("entropy/") and not _is_env_tensor_stat(k, {"mean", "std", "max"}):
            continue
        if any(k.startswith(p) for p in mean_max_only_prefixes):
            if _is_env_tensor_stat(k, {"mean", "std", "max"}):
                out[k] = v
                continue
            if not (k.endswith("/mean") or k.endswith("/max")):
                continue
        out[k] = v
    return out


def train_step_losses(micro_batches, rl_loss_fn, params=None, all_reduce=None):
    """train.py L307-323 (rl_scale over all micro-batches, all-reduced over the ranks when given) then L461-475
    per micro-batch, backward."""
    rl_scale = sum(int(mb["loss_mask"].sum()) for mb in micro_batches)
    if all_reduce is not None:
        global_scales = torch.tensor([rl_scale, 0, 0], dtype=torch.int64)
        all_reduce(global_scales)                                   # dist.all_reduce(..., SUM, dp_cp_group)
        rl_scale = int(global_scales[0])
    rl_scale = max(rl_scale, 1)
    out = []
    for mb in micro_batches:
        lp = mb["trainer_logprobs"] if params is None else mb["trainer_logprobs"] + params
        split = mb["sequence_lengths"]
        loss, loss_tensors = compute_loss(
            trainer_logprobs=lp.squeeze().split(split),
            inference_logprobs=mb["inference_logprobs"].squeeze().split(split),
            ref_logprobs=None,
            advantages=mb["advantages"].squeeze().split(split),
            loss_mask=mb["loss_mask"].squeeze().split(split),
            rl_weights=None,
            rl_loss_fn=rl_loss_fn,
            rl_scale=rl_scale,
        )
        loss.backward()
        out.append((loss.detach(), {k: v.detach() for k, v in loss_tensors.items()}))   # L534-535
    return out


# ------------------------------------------------------------------------------------------ data
def packed_micro_batch(seed: int, lengths=(30, 42, 17), prompt=(6, 9, 4)):
    """One packed micro-batch (batch size 1, samples along the sequence): prompt tokens out of the loss mask
    (inference log-prob 0), a masked tool-output span inside sample 1, per-sample advantages broadcast."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    inference = -torch.rand(T, generator=g) * 2 - 0.05
    trainer = (inference + 0.25 * torch.randn(T, generator=g)).clamp(max=-1e-3)
    mask = torch.zeros(T, dtype=torch.bool)
    adv = torch.zeros(T)
    start = 0
    for i, (L, P) in enumerate(zip(lengths, prompt)):
        mask[start + P:start + L] = True
        adv[start:start + L] = torch.randn((), generator=g) * 1.5
        start += L
    mask[lengths[0] + 20:lengths[0] + 25] = False                   # tool output inside sample 1
    inference = torch.where(mask, inference, torch.zeros(()))
    return {"trainer_logprobs": trainer.unsqueeze(0).requires_grad_(), "inference_logprobs": inference.unsqueeze(0),
            "advantages": adv.unsqueeze(0), "loss_mask": mask.unsqueeze(0), "sequence_lengths": list(lengths)}


def amplifying_micro_batch(seed: int, lengths=(30, 42, 17, 25), prompt=(6, 9, 4, 5)):
    """A packed micro-batch whose sampler is biased in the amplifying direction: advantages alternate
    −1.5 / +0.5 (× U(1, 1.2)) per sample, and the inference log-probs sit 0.4 nats above the trainer's on the A<0
    samples and 0.4 below on the A>0 ones (δ = trainer − inference ≈ ∓0.4): every loss token amplifies, the A⁻
    mass three times the A⁺ mass (window ρ_asym ≈ 3 from the first step: the shipped rules fire)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    trainer = -torch.rand(T, generator=g) * 2 - 0.5
    mask = torch.zeros(T, dtype=torch.bool)
    adv = torch.zeros(T)
    start = 0
    for i, (L, P) in enumerate(zip(lengths, prompt)):
        mask[start + P:start + L] = True
        adv[start:start + L] = (-1.5 if i % 2 == 0 else 0.5) * (1 + 0.2 * float(torch.rand((), generator=g)))
        start += L
    inference = (trainer + torch.where(adv < 0, 0.4, -0.4) + 0.02 * torch.randn(T, generator=g)).clamp(max=-1e-3)
    inference = torch.where(mask, inference, torch.zeros(()))
    return {"trainer_logprobs": trainer.unsqueeze(0).requires_grad_(), "inference_logprobs": inference.unsqueeze(0),
            "advantages": adv.unsqueeze(0), "loss_mask": mask.unsqueeze(0), "sequence_lengths": list(lengths)}


OFF = {"gate": False, "tis": False, "repair": False}


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("triage", [None, OFF], ids=["monitor-only", "triage-off"])
def test_triage_off_equals_prime_rls_default_loss_through_compute_loss(triage, tmp_path):
    """[trainer.loss] type="custom" → import_object → compute_loss, against prime-rl's default_loss_fn on the same
    tensors: the step loss (÷ rl_scale), its gradient and every default-loss metric agree to float tolerance."""
    cfg = {"dppo_mask_low": 0.2, "dppo_mask_high": 0.2, "kl_tau": 1e-3}
    if triage is not None:
        cfg["triage"] = triage
    ours_fn = setup_rl_loss_fn(CustomLossConfig("triage_monitor.hooks.prime_rl.triage_loss", cfg))
    ref_fn = setup_rl_loss_fn(DefaultLossConfig())
    mbs = [packed_micro_batch(s) for s in (1, 2)]
    ours = train_step_losses(mbs, ours_fn)
    grads = [mb["trainer_logprobs"].grad.clone() for mb in mbs]
    for mb in mbs:
        mb["trainer_logprobs"].grad = None
    ref = train_step_losses(mbs, ref_fn)
    for (lo, mo), (lr, mr), g, mb in zip(ours, ref, grads, mbs):
        assert float(lr) != 0.0 and abs(float(lo) - float(lr)) <= 1e-6 * max(1.0, abs(float(lr)))
        assert torch.allclose(g, mb["trainer_logprobs"].grad, atol=1e-7)
        for k in prime_rl.DEFAULT_LOSS_METRICS:
            assert mo[k].shape == mr[k].shape == (3,) and torch.allclose(mo[k], mr[k], atol=1e-7), k
        assert bool([k for k in mo if k.startswith("triage/")]) == (triage is not None)   # ours only with a controller
    close_all()


def test_a_single_sample_is_a_sum_not_a_mean():
    """The 42-token sample of the issue: prime-rl divides the per-sample sum by rl_scale = 42; a per-sample mean
    (the old adapter) came out 42× too small.  Value worked out from the formula on a constant sample."""
    L = 42
    t = torch.full((L,), math.log(0.5)).requires_grad_()
    i = torch.full((L,), math.log(0.45))
    adv, mask = torch.ones(L), torch.ones(L, dtype=torch.bool)
    fn = setup_rl_loss_fn(CustomLossConfig("triage_monitor.hooks.prime_rl.triage_loss", {"triage": OFF}))
    loss, _ = compute_loss([t], [i], None, [adv], [mask], None, fn, rl_scale=L)
    r = 0.5 / 0.45                                                  # Δp = 0.05 ≤ 0.2: every token kept
    per_token = -r + 1e-3 * math.log(r) ** 2
    assert float(loss.detach()) == pytest.approx(per_token, rel=1e-6)       # (42 · per_token) / 42


def test_triage_on_reports_tensor_metrics_under_triage_and_keeps_prime_rls():
    """With the controller on, compute_loss's aggregation (which needs tensors: the crash of the old adapter)
    stacks our statistics per sample under triage/; prime-rl's metric values do not change; Gate lowers the
    loss contribution of the down-weighted sample."""
    mb = packed_micro_batch(3)
    trainer = mb["trainer_logprobs"].detach().clone()
    trainer[0, 6:30] = mb["inference_logprobs"][0, 6:30] - 2.0      # sample 0: learner far below the sampler
    mb["trainer_logprobs"] = trainer.requires_grad_()
    triage = {"gate_width": 8, "repair": False, "tis": False}
    fn = setup_rl_loss_fn(CustomLossConfig("triage_monitor.hooks.prime_rl.triage_loss", {"triage": triage}))
    ((_, ours),) = train_step_losses([mb], fn)
    ((_, ref),) = train_step_losses([mb], setup_rl_loss_fn(DefaultLossConfig()))
    for k in prime_rl.DEFAULT_LOSS_METRICS:
        assert torch.allclose(ours[k], ref[k], atol=1e-7)
    assert ours["triage/gate_weight_mean"].shape == (3,) and all(isinstance(v, torch.Tensor) for v in ours.values())
    assert float(ours["triage/gate_weight_mean"][0]) < 1.0


def test_toml_config_lines_and_steps_from_the_optimizer(tmp_path):
    """The docs' TOML lines, parsed as prime-rl parses [trainer.loss]; 2 optimizer steps × 2 micro-batches give 2
    monitored steps with every loss token once; the hook pickles to configuration only."""
    toml = f"""
[trainer.loss]
type = "custom"
import_path = "triage_monitor.hooks.prime_rl.triage_loss"
kwargs = {{ run_dir = "{tmp_path / 'run'}", triage = {{ gate_width = 8 }}, monitor = {{ window = 2 }} }}
"""
    loss_cfg = tomllib.loads(toml)["trainer"]["loss"]
    assert loss_cfg["type"] == "custom"
    fn = setup_rl_loss_fn(CustomLossConfig(loss_cfg["import_path"], loss_cfg["kwargs"]))
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.AdamW([w], lr=1e-3)
    n_tokens = []
    for step in range(2):
        mbs = [packed_micro_batch(10 * step + m) for m in range(2)]
        n_tokens.append(sum(int(mb["loss_mask"].sum()) for mb in mbs))
        train_step_losses(mbs, fn, params=w)
        opt.step()                                                  # train.py L566
        opt.zero_grad()
    hook = prime_rl._HOOKS[json.dumps(loss_cfg["kwargs"], sort_keys=True, default=str)]
    data = cloudpickle.dumps(hook)
    assert b"MismatchMonitor" not in data and b"TriageController" not in data
    assert hook.runtime.optimizer_steps == 2
    close_all()
    tokens = pd.read_parquet(tmp_path / "run" / "tokens")
    assert tokens.groupby("step").size().tolist() == n_tokens       # every loss token of each step once
    assert json.loads((tmp_path / "run" / "run.json").read_text())["info"]["framework"] == "prime-rl"


def test_unsupported_inputs_raise_clearly():
    with pytest.raises(ValueError, match="kl_tau"):
        prime_rl.PrimeRLTriageLoss(kl_tau=-1)
    mb = packed_micro_batch(4, lengths=(12,), prompt=(2,))
    t, i, a, m = (mb[k][0] for k in ("trainer_logprobs", "inference_logprobs", "advantages", "loss_mask"))
    weights = torch.ones(12)
    weights[5] = 0.5
    hook = prime_rl.PrimeRLTriageLoss(triage=TriageConfig(**OFF))
    with pytest.raises(ValueError, match=r"loss_weights\[5\] = 0.5"):
        hook(LossInputs(t, i, None, a, m, weights))
    with pytest.raises(ValueError, match="import_path"):
        hook(LossInputs(t, i, None, a, m), kl_tau=0.1)
    out = hook(SimpleNamespace(trainer_logprobs=t, inference_logprobs=i, advantages=a, loss_mask=m))
    assert out.loss.dim() == 0


def test_hook_options_are_validated_naming_the_option():
    with pytest.raises(ValueError, match=r"PrimeRLTriageLoss: alerts=3"):
        prime_rl.PrimeRLTriageLoss(alerts=3)
    with pytest.raises(ValueError, match=r"PrimeRLTriageLoss: loggers: tracker kind 'nope'"):
        prime_rl.triage_loss(None, loggers=["nope"])
    with pytest.raises(ValueError, match=r"PrimeRLTriageLoss: framework_keys='some'"):
        prime_rl.PrimeRLTriageLoss(framework_keys="some")
    with pytest.raises(ValueError, match=r"PrimeRLTriageLoss: alerts\[0\]: missing required field"):
        prime_rl.PrimeRLTriageLoss(alerts=[{"name": "x"}])
    hook = prime_rl.PrimeRLTriageLoss("r", alerts=False, loggers={"kind": "mlflow", "tracking_uri": "file:/m"},
                                      framework_keys=["window/rho_asym"])
    s = hook.settings
    assert s.alerts is False and s.loggers[0].kind == "mlflow" and s.framework_keys == ("window/rho_asym",)


def test_global_token_normalization_is_refused_at_construction():
    """prime-rl divides each sample's sum by rl_scale: the weights are renormalised per response, so a TriageConfig
    (or a TOML ``triage`` table) asking for the global token mean is refused naming the setting."""
    with pytest.raises(ValueError, match=r"PrimeRLTriageLoss: TriageConfig.normalization='global_token' cannot be "
                                         r"honoured: prime-rl divides each sample's loss sum by rl_scale"):
        prime_rl.PrimeRLTriageLoss(triage=TriageConfig(normalization="global_token"))
    with pytest.raises(ValueError, match=r"normalization='global_token'"):
        prime_rl.triage_loss(None, triage={"normalization": "global_token"})
    prime_rl.PrimeRLTriageLoss(triage={"normalization": "per_response"})


def test_gate_weights_renormalise_per_response_under_prime_rls_normaliser():
    """docs/hooks.md#triage-weights-under-a-frameworks-normaliser through prime-rl's ``compute_loss`` (one loss
    call per sample, ÷ rl_scale): three 4-token samples, A = −1, −1, +1, the inference log-probs above the trainer's
    by −δ: sample a partly gated (δ = +0.2 ungated, tier 0.3 on the rest), b all gated.  The gradient per token
    (DPPO-Binary-TV + KL, all weighted) over the Gate-off one is w · 4 / W: 4/1.9 and 0.3 · 4/1.9 on a, 1 on b, c."""
    delta = torch.tensor([[0.2, -0.8, -0.9, -1.0], [-0.8, -0.9, -1.0, -0.7], [-0.8, -0.9, -1.0, -0.7]])
    inference = torch.full_like(delta, -2.0)
    adv = torch.tensor([-1.0, -1.0, 1.0])
    grads = {}
    for name, triage in (("off", OFF), ("on", {"tis": False, "repair": False, "gate_width": 4})):
        fn = setup_rl_loss_fn(CustomLossConfig("triage_monitor.hooks.prime_rl.triage_loss", {"triage": triage}))
        t = [(inference[s] + delta[s]).requires_grad_() for s in range(3)]
        loss, _ = compute_loss(t, list(inference), None, [adv[s].expand(4) for s in range(3)],
                               [torch.ones(4, dtype=torch.bool)] * 3, None, fn, rl_scale=12)
        loss.backward()
        grads[name] = torch.stack([x.grad for x in t])
    s = 4 / 1.9
    want = torch.tensor([[s, .3 * s, .3 * s, .3 * s], [1.0] * 4, [1.0] * 4])
    assert (grads["off"] != 0).all()
    assert torch.allclose(grads["on"] / grads["off"], want, rtol=1e-5)
    close_all()


def test_the_docs_toml_lines_configure_the_hook():
    """The ``[trainer.loss]`` block of docs/hooks.md#prime-rl, parsed as prime-rl parses its TOML: the kwargs build
    the hook with the controller, prime-rl's loss settings and the three options as written."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text()
    section = text.split("\n## prime-rl\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```toml\n", 1)[1].split("```", 1)[0]
    loss = tomllib.loads(block)["trainer"]["loss"]
    assert (loss["type"], loss["import_path"]) == ("custom", "triage_monitor.hooks.prime_rl.triage_loss")
    kw = dict(loss["kwargs"], triage=TriageConfig(**loss["kwargs"]["triage"]))
    hook = prime_rl.PrimeRLTriageLoss(**kw)
    s = hook.settings
    assert s.triage.gate_width == 64 and hook.surrogate_kwargs["kl_tau"] == 1e-3
    assert s.alerts is True and s.framework_keys == "curated"
    assert [(t.kind, dict(t.options)) for t in s.loggers] == [
        ("tensorboard", {}), ("mlflow", {"tracking_uri": "file:/shared/mlruns"})]


# ----------------------------------------------------------- 2 torchrun-like ranks (gloo): prime-rl's logging path
DIST_STEPS = 6
DIST_TOML = """
[trainer.loss]
type = "custom"
import_path = "triage_monitor.hooks.prime_rl.triage_loss"

[trainer.loss.kwargs]
run_dir = "{run}"
triage = {{ gate_width = 8, calibration = {{ window = 1 }} }}
monitor = {{ window = 4, calibration_steps = 2, per_rank_steps = true }}
alerts = true
loggers = [{{ kind = "recorder", path = "{rec}" }}]
framework_keys = "curated"
"""


def install_monitors_module():
    """``prime_rl.monitors`` as far as the trainer's logging uses it (``src/prime_rl/monitors/__init__.py`` L38
    ``MONITORS``, L101-113 ``log``: every registered monitor's ``log``, a failing one warned and skipped), in
    ``sys.modules`` where ``train.py``'s ``from prime_rl import monitors`` finds it; no monitor registered (this
    test's ranks set none up, as a job without W&B / file monitors)."""
    import types

    pkg = sys.modules.setdefault("prime_rl", types.ModuleType("prime_rl"))
    mod = types.ModuleType("prime_rl.monitors")
    mod.MONITORS = []

    async def log(data, step, kind="train", subset="effective"):
        for monitor in mod.MONITORS:
            try:
                await monitor.log(data, step=step, kind=kind, subset=subset)
            except Exception as e:  # noqa: BLE001 — prime-rl's own: get_logger().warning(...)
                print(f"Failed to log to {monitor.__class__.__name__}: {e}")

    mod.log = log
    pkg.monitors = mod
    sys.modules["prime_rl.monitors"] = mod
    return mod


def dist_worker(rank: int, world: int, outdir: str) -> None:
    """One trainer rank: prime-rl's train step (transcribed above) over DIST_STEPS optimizer steps, 2 amplifying
    micro-batches per rank and step; rank 0 keeps what ``monitors.log`` receives (the filtered tensor stats)."""
    out = Path(outdir)
    recording_tracker.register()
    lines = recording_tracker.AlertLines()
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=world)
    loss_cfg = tomllib.loads(DIST_TOML.format(run=out / "run", rec=out / "recorder.jsonl"))["trainer"]["loss"]
    fn = setup_rl_loss_fn(CustomLossConfig(loss_cfg["import_path"], loss_cfg["kwargs"]))
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.AdamW([w], lr=1e-4)
    monitors = install_monitors_module()
    logged = []
    for step in range(DIST_STEPS):
        tensors = Tensors()                                          # train.py L331
        mbs = [amplifying_micro_batch(1000 * rank + 10 * step + m) for m in range(2)]
        for loss, loss_tensors in train_step_losses(mbs, fn, params=w, all_reduce=dist.all_reduce):
            tensors["loss"].append(loss.unsqueeze(0))                # L485
            for key, loss_tensor in loss_tensors.items():            # L538-539
                tensors[key].append(loss_tensor)
        opt.step()                                                   # L566: the monitor logs the step here
        opt.zero_grad()
        tensor_stats = tensors.compute_stats()                       # L623
        tensor_stats["step"] = step                                  # L675 (progress.step)
        if rank == 0:                                                # monitors.log: rank 0's monitors only
            logged.append(filter_rl_trainer_tensor_stats_for_wandb(tensor_stats))
        time_metrics = {                                             # L679-688: the step's timers, logged last
            "time/step": 10.0 + step,
            "time/wait_for_batch": 6.0,
            "time/load_data": 0.25,
            "time/broadcast_weights": 0.5,
            "time/save_ckpt": 0.0,
            "time/forward_backward": 3.0,
            "step": step,
        }
        asyncio.run(monitors.log(time_metrics, step=step))
    close_all()
    lines.remove()
    (out / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "logged": logged, "alerts": lines.lines}))
    dist.barrier()                   # neither rank tears its gloo pairs down while the other still uses them
    dist.destroy_process_group()


def test_curated_metrics_reach_prime_rls_logged_stats_and_alerts_fire_once(tmp_path):
    """2 ranks (gloo) through prime-rl's loss, metric and logging path with an amplifying sampler and the docs'
    TOML (alerts, loggers, framework_keys): the stats prime-rl logs hold, under triage/<key>/{mean,median,min,max},
    rank 0's steps-table value of the previous step (std 0 up to float32 rounding), never a prime-rl name; the
    shipped rules fire, each alert once for the job: one row in alerts/, one log line on rank 0 and none on rank 1,
    one alert record in the "recorder" tracker, which only rank 0's monitor built and fed."""
    run_dist(tmp_path)
    check_dist(tmp_path)


def run_dist(tmp_path, script: str = __file__, pythonpath: str = "") -> None:
    """Run ``script <rank> 2 <tmp_path>`` as 2 processes (this file: :func:`dist_worker`) and wait for both."""
    path = os.pathsep.join(p for p in (pythonpath, str(Path(__file__).resolve().parents[1])) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, str(r), "2", str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0].decode())
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o


def check_dist(tmp_path) -> None:
    """The assertions of the 2-rank test on what :func:`dist_worker` left in ``tmp_path``."""
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    run = tmp_path / "run"
    steps = recording_tracker.steps_table(run, rank=0)
    assert steps.index.tolist() == list(range(DIST_STEPS))
    logged = res[0]["logged"]
    assert [e["step"] for e in logged] == list(range(DIST_STEPS)) and res[1]["logged"] == []
    checked = set()
    for entry in logged:
        s = entry["step"]
        ours = {k for k in entry if k.startswith("triage/")}
        own = {k.rsplit("/", 1)[0] for k in entry if not k.startswith("triage/") and k != "step"}
        assert own == {"loss", *prime_rl.DEFAULT_LOSS_METRICS}           # prime-rl's names, none under triage/
        # the controller's per-sample statistics keep their names, but not the one the curated set claims
        assert {"triage/gate_weight_mean/mean", "triage/repair_loss/mean"} <= ours
        if s == 0:                                                       # nothing logged before the first step
            assert not any(k.startswith(("triage/window/", "triage/metrics_step")) for k in ours)
            assert "triage/gate_downweighted_frac/mean" not in ours
            continue
        assert entry["triage/metrics_step/mean"] == s - 1                # one step behind
        row = steps.loc[s - 1]
        for k in CURATED_KEYS:
            if not math.isfinite(row[k]):
                assert f"triage/{k}/mean" not in entry, k
                continue
            for stat in ("mean", "median", "min", "max"):
                assert entry[f"triage/{k}/{stat}"] == pytest.approx(row[k], rel=1e-6, abs=1e-7), (s, k, stat)
            assert entry[f"triage/{k}/std"] <= 1e-6 * max(1.0, abs(row[k]))   # 0 up to float32 rounding
            checked.add(k)
    assert checked == set(CURATED_KEYS)
    # the ranks' own values differ (the Gate's share): what prime-rl logs is rank 0's, not a pool of both
    # (rank 1's row is there because the configuration asks for every rank's: per_rank_steps)
    other = recording_tracker.steps_table(run, rank=1)
    assert (other["gate_downweighted_frac"] != steps["gate_downweighted_frac"]).any()
    alerts = recording_tracker.alerts_table(run)
    assert len(alerts) >= 1 and set(alerts["rank"]) == {0} and not alerts["rule"].duplicated().any()
    assert "rho_asym_critical" in set(alerts["rule"])
    assert len(res[0]["alerts"]) == len(alerts) and res[1]["alerts"] == []
    first = int(alerts["step"].min())
    assert first < DIST_STEPS - 1 and logged[first + 1]["triage/alerts_active/mean"] >= 1   # seen in prime-rl's log
    rows = recording_tracker.read(tmp_path / "recorder.jsonl")
    assert {r["pid"] for r in rows} == {res[0]["pid"]}                   # built and fed by rank 0 only
    assert sorted(r["rule"] for r in rows if r["kind"] == "alert") == sorted(alerts["rule"])
    assert [r["step"] for r in rows if r["kind"] == "metrics"] == list(range(DIST_STEPS))
    for r in rows:
        if r["kind"] == "metrics":
            assert r["metrics"]["window/rho_asym"] == pytest.approx(steps.loc[r["step"], "window/rho_asym"])
    assert steps_table_nan(run, "alerts_active", rank=1)                  # rank 1 evaluates no rule
    # the trainer's timers of each step (logged after its row was written) reach the row, rank 0's table only
    timed = open_run(run).steps()
    assert timed["time/step"].tolist() == [10.0 + s for s in range(DIST_STEPS)]
    assert (timed["time/generation"] == 6.0).all() and (timed["time/update"] == 3.0).all()
    assert (timed["time/weight_sync"] == 0.5).all() and (timed["time/other"] == 0.25).all()
    late = open_run(run).timings()
    assert set(late["rank"]) == {0} and set(late["framework"]) == {"prime_rl"}


def steps_table_nan(run, col, rank):
    return bool(recording_tracker.steps_table(run, rank=rank)[col].isna().all())


# ------------------------------------------------- the orchestrator process: prime-rl's reward into the timings table
async def orchestrator_monitors_setup(module) -> None:
    """``monitors.setup`` (``src/prime_rl/monitors/__init__.py`` L41-84) with no monitor configured (wandb, prime and
    file None: this test registers none of prime-rl's); its guard against a second setup (L58) and rank check kept."""
    assert not module.MONITORS, "Monitors already set up. Call `setup` only once per process."
    rank = int(os.environ.get("RANK", os.environ.get("DP_RANK", "0")))
    if rank != 0:
        return


class Orchestrator:
    """prime-rl's ``Orchestrator`` (``src/prime_rl/orchestrator/orchestrator.py`` @ 559b4477) as far as it reaches
    its monitors: ``Progress`` (``orchestrator/types.py`` L27-30: ``step = 1``), ``setup`` (L195; monitors set up at
    L219-228, ``progress.step = resume_step + 1`` on resume, L314-321), ``start`` (L458-461: ``setup`` first) and
    ``finalize_train_batch`` (L619-747: the step's episodes logged at L684, ``progress.step += 1`` at L690, the
    metrics dict of L698-727 logged at L747).  A batch is given as ``{agent: [trace rewards]}`` of its effective
    cohort and of its whole arrival window; ``to_wandb`` (``orchestrator/metrics.py`` L324-335, L244-253, ``Stat``
    L79-88) is reduced to the keys of the ``reward`` distribution and one ``rewards/<name>`` custom metric."""

    def __init__(self, monitors, resume_step=None):
        self.monitors = monitors
        self.progress = SimpleNamespace(step=1)
        self.resume_step = resume_step

    async def setup(self) -> None:
        await orchestrator_monitors_setup(self.monitors)                    # L219-228
        if self.resume_step is not None:                                    # L314-321
            self.progress.step = self.resume_step + 1

    async def start(self) -> None:
        await self.setup()                                                  # L461

    async def finalize_train_batch(self, effective: dict, arrived: dict, env_name: str = "reverse-text") -> None:
        step = self.progress.step                                           # L625
        await self.monitors.log([], step, "train", "effective")             # L684 (the episodes)
        self.progress.step += 1                                             # L690
        metrics: dict = {}
        for subset, pool in (("all", arrived), ("effective", effective)):   # L698-702
            for prefix in ("train/agg", f"train/{env_name}"):
                for agent, rewards in pool.items():
                    base = f"{prefix}/{subset}/{agent}"
                    metrics |= {f"{base}/reward/mean": sum(rewards) / len(rewards), f"{base}/reward/max": max(rewards),
                                f"{base}/reward/min": min(rewards),
                                f"{base}/rewards/correct/mean": 1.0 - sum(rewards) / len(rewards)}
        metrics |= {"time/step": 7.0, "time/pack": 0.1, "time/save_ckpt": 2.0, "time/wait_for_policy": 0.5,
                    "step": step}                                           # L713-727
        await self.monitors.log(metrics, step=step)                         # L747


def orchestrator_rewards(s: int) -> tuple:
    """Orchestrator step s's batch: the shipped cohort's trace rewards (mean 0.1 · s, distinct per step) and the
    arrival window's (with failed traces: another mean), one agent."""
    effective = {"policy": [0.1 * s - 0.05, 0.1 * s + 0.05]}
    arrived = {"policy": [*effective["policy"], 0.0, 0.0]}
    return effective, arrived


@pytest.mark.parametrize("resume_step", [None, 3])
def test_the_orchestrators_reward_reaches_the_steps_rows(tmp_path, resume_step):
    """The orchestrator started by ``orchestrator_main`` (:func:`prime_rl.with_reward_monitor` over prime-rl's
    ``Orchestrator``, transcribed above) ships batch s and logs its metrics (``finalize_train_batch``) before the
    trainer trains it — two batches ahead at the start (``TARGET_LAG = 1``, L104, L662-682); the trainer (its own
    process: its own ``prime_rl.monitors``) trains batch s at its ``progress.step`` s through prime-rl's loss and
    logging path.  Each step's reward — the effective cohort's ``train/agg/effective/policy/reward/mean``, not the
    arrival window's, not the per-env or ``rewards/`` keys — is the reward of monitored step s − first step, read back
    through ``open_run(run).steps()``; on a resumed launch (orchestrator and trainer at ``resume_step`` + 1, a new
    attempt whose monitored steps start at 0) too."""
    run = tmp_path / "run"
    steps = 5
    first = 1 if resume_step is None else resume_step + 1
    orch_monitors = install_monitors_module()                               # the orchestrator process's module
    orch = prime_rl.with_reward_monitor(Orchestrator, str(run))(orch_monitors, resume_step=resume_step)
    asyncio.run(orch.start())
    assert [type(m) for m in orch_monitors.MONITORS] == [prime_rl.RewardMonitor]
    assert orch.progress.step == first

    trainer_monitors = install_monitors_module()                            # the trainer process's module
    fn = setup_rl_loss_fn(CustomLossConfig("triage_monitor.hooks.prime_rl.triage_loss",
                                           {"run_dir": str(run), "monitor": {"window": 2}}))
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.AdamW([w], lr=1e-3)
    shipped = first
    for _ in range(2):                                                      # the orchestrator runs ahead
        asyncio.run(orch.finalize_train_batch(*orchestrator_rewards(shipped)))
        shipped += 1
    for progress_step in range(first, first + steps):                       # the trainer's progress.step
        train_step_losses([packed_micro_batch(progress_step)], fn, params=w)
        opt.step()                                                          # train.py L566
        opt.zero_grad()
        asyncio.run(trainer_monitors.log({"time/step": 3.0, "time/forward_backward": 1.0, "step": progress_step},
                                         step=progress_step))               # train.py L679-688
        if shipped < first + steps:
            asyncio.run(orch.finalize_train_batch(*orchestrator_rewards(shipped)))
            shipped += 1
    asyncio.run(orch_monitors.log({"eval/reverse-text/avg@1": 0.9, "step": 2.0}, step=2))   # an eval dict: no reward
    close_all()
    for m in orch_monitors.MONITORS:                                        # monitors.finalize (L506)
        asyncio.run(m.finalize())
    got = open_run(run).steps()
    assert got["step"].tolist() == list(range(steps))                       # monitored steps from 0
    assert got["reward"].tolist() == pytest.approx([0.1 * (first + k) for k in range(steps)])
    late = open_run(run).timings()
    assert late.loc[late["reward"].notna(), "framework_step"].tolist() == list(range(first, first + steps))
    # the trainer's timers, none of the orchestrator's (its time/step, time/save_ckpt are no trainer phase)
    assert (got["time/step"] == 3.0).all() and (got["time/update"] == 1.0).all() and got["time/other"].isna().all()


def test_the_orchestrators_reward_key_and_entry_point():
    """Only the effective cohort's one-agent ``train/agg/.../reward/mean`` is a reward; ``orchestrator_main`` asks for
    the run directory before touching prime-rl."""
    key = "train/agg/effective/policy/reward/mean"
    assert prime_rl.orchestrator_reward({key: 0.25, "train/agg/all/policy/reward/mean": 0.1,
                                         "train/agg/effective/policy/rewards/reward/mean": 0.7}) == 0.25
    assert prime_rl.orchestrator_reward({key: 0.25, "train/agg/effective/judge/reward/mean": 0.5}) is None
    assert prime_rl.orchestrator_reward({key: float("nan")}) is None
    assert prime_rl.orchestrator_reward({"eval/reverse-text/avg@1": 0.9}) is None
    env = {k: v for k, v in os.environ.items() if k != prime_rl.RUN_DIR_ENV}
    out = subprocess.run([sys.executable, "-c", "from triage_monitor.hooks import prime_rl; prime_rl.orchestrator_main()"],
                         env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and prime_rl.RUN_DIR_ENV in out.stderr


if __name__ == "__main__":
    dist_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
