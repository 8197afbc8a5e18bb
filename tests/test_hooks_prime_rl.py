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
- ``src/prime_rl/trainer/rl/train.py`` L307-323 (``rl_scale``: global count of rl loss tokens), L461-475 (the
  per-micro-batch ``compute_loss`` call on ``split(sequence_lengths)``), L534-535 (metric tensors
  ``.detach()``), L566 (``optimizer.step()`` once per step after all micro-batches).

Only type annotations (jaxtyping) and the ce / ref_kl components (absent in RL training: their weight streams
are None) are left out.  The adapter itself is imported through ``import_object`` exactly as prime-rl does.
"""

import importlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import cloudpickle
import pandas as pd
import pytest
import torch

from triage_monitor.controller import TriageConfig
from triage_monitor.hooks import prime_rl
from triage_monitor.hooks._runtime import close_all

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


def train_step_losses(micro_batches, rl_loss_fn, params=None):
    """train.py L307-323 (rl_scale over all micro-batches, one rank) then L461-475 per micro-batch, backward."""
    rl_scale = max(sum(int(mb["loss_mask"].sum()) for mb in micro_batches), 1)
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
