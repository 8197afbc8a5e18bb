"""NeMo RL hook: the TRIAGE loss as a NeMo RL ``LossFunction`` (replaces ``ClippedPGLossFn`` in GRPO).

Checked against NeMo RL's public repository at commit ``7ea279abfbeb698b092856d0dab61e7cf39bc909``
(``nemo_rl/algorithms/loss/{interfaces,loss_functions,utils}.py``, ``nemo_rl/models/automodel/train.py``,
``nemo_rl/models/policy/{lm_policy.py,workers/dtensor_policy_worker_v2.py}``); NeMo RL does not install on a
CPU machine, so ``tests/test_hooks_nemo_rl.py`` reproduces its call sites (docs/hooks.md#nemo-rl).

The protocol (since 2026-03): a loss has ``input_type`` (here ``LossInputType.LOGPROB``: ``prepare_loss_input``
turns the logits into next-token log-probs and calls ``loss_fn(data=, global_valid_seqs=, global_valid_toks=,
next_token_logprobs=)``) and ``loss_type`` (``LossType.TOKEN_LEVEL`` or ``SEQUENCE_LEVEL``), both enums of
``nemo_rl.algorithms.loss.interfaces``.  ``data`` holds ``(B, S)`` tensors over prompt + response, right padded:
``prev_logprobs`` (learner, before the update), ``generation_logprobs`` (vLLM), ``reference_policy_logprobs``,
``advantages``, ``token_mask``, ``sample_mask``; ``next_token_logprobs`` is ``(B, S−1)`` and every loss reads
``[:, 1:]`` of the data.  The loss of a micro-batch is divided by the **global** valid token count
(``global_valid_toks``, all micro-batches and data-parallel ranks of the global batch) or sequence count; the
worker sums the micro-batch losses (backward on each) and sums the metrics, so token-normalised metrics come
back as global means.  ``policy.train(data, loss_fn)`` ships ``loss_fn`` to every Ray worker on **every** call
(``common_kwargs``): this object carries configuration only, the controller's calibration and the monitor live
in each worker process (:mod:`triage_monitor.hooks.worker_runtime`).

What this hook computes: NeMo's clipped PG loss (PPO-clip against ``prev_logprobs``, ``ratio_clip_min/max``,
dual clip ``ratio_clip_c``, reference KL penalty ``reference_policy_kl_penalty`` of type k1/k2/k3 with NeMo's
clamps and score-function weight) with the TRIAGE weights, aggregated as NeMo does (token level:
``token_mean`` over ``global_valid_toks``; sequence level: ``seq_mean_token_mean`` over ``global_valid_seqs``).
With Gate, TIS and Repair off it equals ``ClippedPGLossFn`` with the same config.  TRIAGE's TIS replaces NeMo's
importance-sampling correction (``TriageConfig.tis``, ``tis_clip``).  Repair: the update's segment count is taken
as ``global_valid_toks / repair_width`` (each micro-batch contributes its Σφ over that count).
Options this path cannot honour raise at construction: ``disable_ppo_ratio``, ``use_cispo``,
``sequence_level_importance_ratios``, ``use_importance_sampling_correction`` / ``truncated_importance_sampling_*``
(use TRIAGE's TIS), ``use_on_policy_kl_approximation``, ``positive_example_nll_weight``.

Metrics: NeMo's own (``token_mult_prob_error``, ``gen_kl_error``, ``policy_kl_error``, ``js_divergence_error``,
``probs_ratio*``, ``kl_penalty``, ``sampling_importance_ratio``, ``num_valid_samples``, ``approx_entropy``, ...)
with ``ClippedPGLossFn``'s values and normalisation; ours under ``triage/`` (token-normalised like NeMo's).
Steps: one monitored step per optimizer step of the worker (``self.optimizer.step()`` once per global batch).

What reaches NeMo's own logger: ``settings.framework_keys`` of the last step the worker logged
(:meth:`WorkerRuntime.framework_metrics`: the curated set by default, ``triage/<name>`` plus
``triage/metrics_step``) go into the metrics dict of **one** loss call per monitored step — the first call after
that step closed that has a valid sample — on the monitor's rank 0, as plain floats.  NeMo divides every
micro-batch metric without ``_min`` / ``_max`` in its name by ``num_global_batches``
(``nemo_rl/models/automodel/train.py`` L524-534), keeps only micro-batches with ``num_valid_samples > 0``
(``models/policy/workers/dtensor_policy_worker_v2.py`` L527-537), lists them per key (``automodel/train.py``
L1122-1134), concatenates the workers' lists (``models/policy/lm_policy.py`` L853-858) and GRPO sums each list
(``algorithms/grpo.py`` L3466-3491; all at ``7ea279ab``): with one global batch per ``policy.train`` call
(GRPO's default, ``train_global_batch_size`` = prompts × generations per step) the logged value is rank 0's
steps-table value of step ``triage/metrics_step``, the step before the one being trained; with ``k`` global batches
it is the mean of the ``k`` steps before each.  ``metric_normalizations`` marks these keys
``MetricNormalizer.NONE`` (the Megatron split path rescales only the others).  NeMo has no key under ``triage/``.
A controller statistic whose name is in ``framework_keys`` (``gate_downweighted_frac`` in the curated set) is the
monitor's value; the others stay per micro-batch, token-normalised.
"""

from __future__ import annotations

import enum
import uuid
from typing import Any, Optional

import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.triage.corrections import reference_kl
from triage_monitor.triage.loss import agg_loss
from triage_monitor.monitor import MonitorConfig

from .micro_batches import leading_positions
from .loss_hook_options import first_hand_over, framework_names, hook_options, own_stats, reports
from .option_strings import check_normalization
from .worker_runtime import HookSettings, LossHook

#: The NeMo RL commit this hook's call-site contract was read from.
NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"

#: ``ClippedPGLossConfig`` fields this hook reads, with NeMo's defaults.
CLIPPED_PG_DEFAULTS = dict(ratio_clip_min=0.2, ratio_clip_max=0.2, ratio_clip_c=None, reference_policy_kl_penalty=0.01,
                           reference_policy_kl_type="k3", kl_input_clamp_value=20.0, kl_output_clamp_value=10.0,
                           use_kl_in_reward=False, token_level_loss=True, force_on_policy_ratio=False)
#: ``ClippedPGLossConfig`` options the TRIAGE path cannot honour, with the value that is supported.
UNSUPPORTED = dict(disable_ppo_ratio=False, use_cispo=False, sequence_level_importance_ratios=False,
                   use_importance_sampling_correction=False, truncated_importance_sampling_type=None,
                   truncated_importance_sampling_ratio=None, truncated_importance_sampling_ratio_min=None,
                   use_on_policy_kl_approximation=False, positive_example_nll_weight=0.0)
#: The controller statistics reported as ``triage/<name>``.
TRIAGE_STATS = ("gate_weight_mean", "gate_downweighted_frac", "repair_loss", "repair_active_frac", "tis_clip_frac")
#: NeMo metrics that are per-micro-batch extrema (never rescaled).
EXTREMA = ("probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max")


class _LossType(enum.Enum):          # used only where nemo_rl is not importable
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class _LossInputType(enum.Enum):
    LOGPROB = "logprob"


def _nemo_interfaces():
    """``(LossType, LossInputType, MetricNormalizer)`` of the installed NeMo RL, or local stand-ins."""
    try:
        from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType, MetricNormalizer
        return LossType, LossInputType, MetricNormalizer
    except ImportError:
        return _LossType, _LossInputType, None


def batch_from_nemo_rl(data, learner_key: str = "prev_logprobs", on_invalid: str = "raise",
                       learner_logp=None) -> TokenBatch:
    """TokenBatch from a NeMo RL data dict (``(B, S)`` tensors, first column dropped as NeMo's losses do).

    Valid tokens: ``token_mask[:, 1:] · sample_mask``; positions count from each row's first valid token.

    Args:
        data: dict-like with ``token_mask``, ``sample_mask``, ``advantages``, ``generation_logprobs`` and
            ``learner_key`` (``(B, S)``, nats).
        learner_logp: ``(B, S−1)`` live log-probs (``next_token_logprobs``), overriding ``data[learner_key][:, 1:]``.

    Raises:
        ValueError: from :meth:`TokenBatch.from_padded` (shapes, non-finite values with ``"raise"``).
    """
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    learner = data[learner_key][:, 1:] if learner_logp is None else learner_logp
    return TokenBatch.from_padded(learner, data["generation_logprobs"][:, 1:], data["advantages"][:, 1:], mask,
                                  positions=leading_positions(mask), on_invalid=on_invalid)


def _cfg_dict(cfg) -> dict[str, Any]:
    if cfg is None:
        return {}
    if hasattr(cfg, "model_dump"):
        return cfg.model_dump()
    return dict(cfg)


class NemoRLTriageLoss(LossHook):
    """TRIAGE loss following NeMo RL's ``LossFunction`` protocol (``input_type = LossInputType.LOGPROB``).

    Args:
        loss_cfg: NeMo's ``master_config.loss_fn`` (``ClippedPGLossConfig`` or a dict); missing fields take
            NeMo's defaults (:data:`CLIPPED_PG_DEFAULTS`).
        triage: :class:`~triage_monitor.triage.controller.TriageConfig` (or dict); None = NeMo's loss, monitored only.
        run_dir, monitor, manifest, on_invalid, step_source: :class:`~triage_monitor.hooks.worker_runtime.HookSettings`.
        use_fused_linear_logprobs: as ``ClippedPGLossFn`` (read by ``prepare_loss_input``).
        alerts: the rules rank 0's monitor evaluates: True (default, the shipped rules), False, a rule file path or
            a list of rules.
        loggers: trackers rank 0's monitor feeds, as configuration (``"tensorboard"``, ``{"kind": "mlflow", ...}``;
            one may be given without a list); each worker builds its own.
        framework_keys: the monitor's metrics handed to NeMo's metrics dict: ``"curated"`` (default), ``"all"`` or a
            list of names (module docstring).

    Raises:
        ValueError: an option of :data:`UNSUPPORTED` is set (message names it and the TRIAGE alternative),
            ``ratio_clip_c`` ≤ 1, an unknown ``reference_policy_kl_type``, a bad ``alerts`` / ``loggers`` /
            ``framework_keys`` (naming the option), or ``TriageConfig.normalization="global_token"`` (NeMo's
            normaliser: the weights are renormalised per response).
    """

    def __init__(self, loss_cfg=None, triage=None, run_dir: Optional[str] = None, monitor=None,
                 manifest: Optional[dict] = None, on_invalid: str = "raise", step_source: str = "auto",
                 use_fused_linear_logprobs: bool = False, alerts=True, loggers=(), framework_keys="curated"):
        alerts, loggers, framework_keys = hook_options("NemoRLTriageLoss", alerts, loggers, framework_keys)
        cfg = _cfg_dict(loss_cfg)
        for name, ok in UNSUPPORTED.items():
            value = cfg.get(name, ok)
            if value is not None and value != ok:
                alt = " (TRIAGE's TIS replaces it: TriageConfig(tis=True, tis_clip=(lo, hi)))" \
                    if "importance_sampling" in name else ""
                raise ValueError(f"NemoRLTriageLoss: loss_fn.{name}={value!r} is not supported with the TRIAGE "
                                 f"loss; set it to {ok!r}{alt}")
        c = {k: cfg.get(k, v) for k, v in CLIPPED_PG_DEFAULTS.items()}
        if c["ratio_clip_c"] is not None and c["ratio_clip_c"] <= 1:
            raise ValueError(f"NemoRLTriageLoss: loss_fn.ratio_clip_c must be > 1, got {c['ratio_clip_c']}")
        if c["reference_policy_kl_type"] not in ("k1", "k2", "k3"):
            raise ValueError("NemoRLTriageLoss: loss_fn.reference_policy_kl_type must be k1, k2 or k3, got "
                             f"{c['reference_policy_kl_type']!r}")
        self.clip_low, self.clip_high = float(c["ratio_clip_min"]), float(c["ratio_clip_max"])
        self.ratio_clip_c = c["ratio_clip_c"]
        self.reference_policy_kl_penalty = 0.0 if c["use_kl_in_reward"] else float(c["reference_policy_kl_penalty"])
        self.reference_policy_kl_type = c["reference_policy_kl_type"]
        self.kl_input_clamp_value, self.kl_output_clamp_value = c["kl_input_clamp_value"], c["kl_output_clamp_value"]
        self.token_level_loss = bool(c["token_level_loss"])
        self.force_on_policy_ratio = bool(c["force_on_policy_ratio"])
        self.use_fused_linear_logprobs = bool(use_fused_linear_logprobs)
        self.settings = HookSettings(run_dir=run_dir, monitor=monitor or MonitorConfig(), triage=triage,
                                     manifest={"framework": "nemo-rl", "nemo_rl_commit": NEMO_RL_COMMIT,
                                               **(manifest or {})},
                                     on_invalid=on_invalid, step_source=step_source, alerts=alerts,
                                     loggers=loggers, framework_keys=framework_keys, key=uuid.uuid4().hex)
        check_normalization(self.settings.triage, "NemoRLTriageLoss", "NeMo RL divides the loss by "
                            "global_valid_toks (token level) or global_valid_seqs (sequence level)")

    # ------------------------------------------------------------- protocol
    @property
    def input_type(self):
        """``LossInputType.LOGPROB``: NeMo passes ``next_token_logprobs``."""
        return _nemo_interfaces()[1].LOGPROB

    @property
    def loss_type(self):
        """``LossType.TOKEN_LEVEL`` (``loss_fn.token_level_loss``, default) or ``SEQUENCE_LEVEL``."""
        lt = _nemo_interfaces()[0]
        return lt.TOKEN_LEVEL if self.token_level_loss else lt.SEQUENCE_LEVEL

    @property
    def metric_normalizations(self) -> dict[str, Any]:
        """Per metric, the global denominator it was divided by (NeMo's ``MetricNormalizer``; {} without NeMo)."""
        mn = _nemo_interfaces()[2]
        if mn is None:
            return {}
        grad = mn.TOKENS if self.token_level_loss else mn.SEQUENCES
        out = {k: mn.TOKENS for k in ("probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error",
                                      "policy_kl_error", "js_divergence_error", "approx_entropy",
                                      "sampling_importance_ratio")}
        out.update({"loss": grad, "kl_penalty": grad, "num_valid_samples": mn.NONE, "positive_nll_loss": mn.NONE,
                    **{k: mn.NONE for k in EXTREMA}})
        if self.settings.triage is not None:
            out.update({f"triage/{k}": mn.TOKENS for k in own_stats(dict.fromkeys(TRIAGE_STATS), self.settings)})
        out.update({f"triage/{k}": mn.NONE for k in self._framework_names()})
        return out

    def _framework_names(self) -> list[str]:
        """Every name the monitor may hand over (``framework_keys``; ``"all"``: the monitor's computed metrics, the
        controller's statistics and the last step's other keys), with ``metrics_step``."""
        names = framework_names(self.settings)
        if names is None:
            from triage_monitor.monitor import RESERVED_KEYS
            names = {*RESERVED_KEYS, *TRIAGE_STATS, *(self.runtime.last_metrics or {})} - {"step"}
        return sorted({*names, "metrics_step"}) if names else []

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, **kwargs):
        """Loss of one micro-batch (already divided by the global count) and NeMo's metrics + ``triage/*``.

        Args:
            next_token_logprobs: ``(B, S−1)`` live log-probs (nats, grad-carrying).
            data: the micro-batch ``BatchedDataDict`` (``(B, S)`` tensors, module docstring).
            global_valid_seqs, global_valid_toks: NeMo's global counts (tensors or numbers).

        Returns:
            ``(loss, metrics)``: 0-dim float32 tensor; dict of floats.
        """
        curr = next_token_logprobs
        batch = batch_from_nemo_rl(data, on_invalid=self.settings.on_invalid, learner_logp=curr)
        gen = batch.sampler_logp
        prev = batch.learner_logp.detach() if self.force_on_policy_ratio \
            else batch.gather(data["prev_logprobs"][:, 1:])
        toks = _as_float(global_valid_toks, curr.device)
        seqs = _as_float(global_valid_seqs, curr.device)
        mode, den = ("token_mean", toks) if self.token_level_loss else ("seq_mean_token_mean", seqs)
        triage = self.runtime.controller
        repair_den = toks / triage.config.repair_width if triage is not None else None
        res = self.compute_loss(batch, old_logp=prev, clip_low=self.clip_low, clip_high=self.clip_high,
                                dual_clip=self.ratio_clip_c, agg_mode=mode, denominator=den + 1e-8,
                                repair_denominator=repair_den)
        kl = torch.zeros((), device=curr.device)
        if self.reference_policy_kl_penalty != 0:
            live = batch.learner_logp
            if "curr_logprobs_unfiltered" in data:
                live = batch.gather(data["curr_logprobs_unfiltered"])
            kl_tok = reference_kl(live, batch.gather(data["reference_policy_logprobs"][:, 1:]),
                                  self.reference_policy_kl_type, self.kl_input_clamp_value, self.kl_output_clamp_value)
            kl = self.reference_policy_kl_penalty * agg_loss(kl_tok, torch.ones_like(kl_tok), batch, mode,
                                                             denominator=den + 1e-8)
        loss = res.loss + kl
        metrics = self._nemo_metrics(batch, prev, gen, res, loss, kl, toks, data)
        if triage is not None:
            share = batch.num_tokens / (float(toks) + 1e-8)
            for k, v in own_stats(res.output.stats, self.settings).items():
                metrics[f"triage/{k}"] = float(v) if k == "repair_loss" else float(v) * share
        rt = self.runtime
        if metrics["num_valid_samples"] > 0 and reports(rt) and first_hand_over(rt):
            # once per monitored step, on rank 0, unscaled: NeMo's ÷ num_global_batches and GRPO's sum give it back
            metrics.update(rt.framework_metrics())
        return loss, metrics

    def record_timings(self, logger) -> Optional["TimingsBackend"]:
        """Record GRPO's step timers (``timing/train/*``) of NeMo's ``logger`` in this hook's run directory
        (:func:`record_timings`; on the driver, after ``setup(...)``); None without a ``run_dir``."""
        if self.settings.run_dir is None:
            return None
        return record_timings(logger, self.settings.run_dir)

    def _nemo_metrics(self, batch, prev, gen, res, loss, kl, toks, data) -> dict[str, float]:
        """``ClippedPGLossFn``'s metrics (same names, same values and normalisation) on this micro-batch."""
        with torch.no_grad():
            den = toks + 1e-8
            tsum = lambda v: float(v.float().sum() / den)  # noqa: E731  (NeMo: masked_mean over global_valid_toks)
            kl_type = self.reference_policy_kl_type
            lp, g, p = batch.learner_logp.detach().float(), gen.float(), prev.float()
            ratio = torch.exp(lp - p)
            clamped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
            log_mix = torch.log(0.5 * torch.exp(p) + 0.5 * torch.exp(g))
            js = 0.5 * (torch.exp(p - log_mix) - (p - log_mix) - 1) + 0.5 * (torch.exp(g - log_mix) - (g - log_mix) - 1)
            n = batch.num_tokens
            out = {
                "loss": float(loss.detach()),
                "probs_ratio": tsum(ratio), "probs_ratio_clamped": tsum(clamped),
                "probs_ratio_min": float(ratio.min()) if n else float("inf"),
                "probs_ratio_max": float(ratio.max()) if n else float("-inf"),
                "probs_ratio_clamped_min": float(clamped.min()) if n else float("inf"),
                "probs_ratio_clamped_max": float(clamped.max()) if n else float("-inf"),
                "kl_penalty": float(kl) / self.reference_policy_kl_penalty if float(kl) else 0,
                "token_mult_prob_error": tsum(torch.exp(torch.abs(g - p))),
                "gen_kl_error": tsum(reference_kl(g, p, kl_type, None, None, score_function=False)),
                "policy_kl_error": tsum(reference_kl(p, g, kl_type, None, None, score_function=False)),
                "js_divergence_error": tsum(js),
                "sampling_importance_ratio": tsum(torch.exp(p - g).nan_to_num(0.0, 0.0, 0.0)),
                "num_valid_samples": float(data["sample_mask"].sum()),
                "approx_entropy": -tsum(torch.exp(lp - g) * lp),
                "positive_nll_loss": 0.0,
            }
        return out


class TimingsBackend:
    """A logger backend in NeMo RL's ``Logger.loggers`` (``nemo_rl/utils/logger.py`` L964-1110 at ``7ea279ab``:
    ``log_metrics`` fans each call out to every backend, as do ``log_hyperparams``, ``log_histogram``,
    ``log_plot`` and ``finish``), recording GRPO's step timers.

    GRPO logs a step's ``Timer`` readings last, once the step is over: ``logger.log_metrics(timing_metrics,
    total_steps + 1, prefix="timing/train", step_finished=True)`` (``algorithms/grpo.py`` L3657-3659,
    L3767-3772), after the workers wrote the step's rows at their optimizer steps (each on disk when
    ``policy.train`` returns).  This backend hands those readings, as ``timing/train/<label>``, to a
    :class:`~triage_monitor.rundir.timings_writer.TimingsWriter` of ``run_dir`` at the run's newest monitored step (the
    last optimizer step of the GRPO step), keeping GRPO's step as ``framework_step``, together with the step's
    reward: the ``reward`` of GRPO's ``logger.log_metrics(metrics, total_steps + 1, prefix="train")`` just before
    (L3762; ``metrics["reward"]`` = ``np.mean`` of the batch's ``total_reward``, L3435 and L3480-3490; the async
    trainer alike, L5394-5400).  Every other call is ignored, and it never raises."""

    PREFIX = "timing/train"
    #: GRPO's log of the step's training metrics, which holds its ``reward``
    TRAIN_PREFIX = "train"

    def __init__(self, run_dir):
        from triage_monitor.rundir.timings_writer import TimingsWriter

        self.writer = TimingsWriter(run_dir, framework="nemo_rl")
        self._reward = None            # (GRPO step, reward) of the last "train" log that held one

    def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False) -> None:
        try:
            if prefix == self.TRAIN_PREFIX and metrics and "reward" in metrics:
                self._reward = (step, metrics["reward"])
            if prefix == self.PREFIX and metrics:
                reward = self._reward[1] if self._reward is not None and self._reward[0] == step else None
                self._reward = None
                self.writer.record({f"{self.PREFIX}/{k}": v for k, v in dict(metrics).items()}, framework_step=step,
                                   reward=reward)
        except Exception:  # noqa: BLE001 — the writer says a bad reading itself; never raised into GRPO
            pass

    def log_hyperparams(self, params) -> None:
        return None

    def log_histogram(self, histogram, step, name) -> None:
        return None

    def log_plot(self, figure, step, name) -> None:
        return None

    def finish(self) -> None:
        self.writer.close()


def record_timings(logger, run_dir) -> TimingsBackend:
    """Add a :class:`TimingsBackend` of ``run_dir`` to NeMo RL's ``logger`` (the ``Logger`` GRPO's ``setup``
    returns; once per logger and run directory) and return it: GRPO's step timers reach the run's steps table
    (docs/hooks.md#phase-timings).  :meth:`NemoRLTriageLoss.record_timings` does this with the hook's
    ``run_dir``."""
    from triage_monitor.rundir.layout import RunLayout

    where = RunLayout(run_dir).location
    for b in logger.loggers:
        if isinstance(b, TimingsBackend) and b.writer.layout.location == where:
            return b
    b = TimingsBackend(run_dir)
    logger.loggers.append(b)
    return b


def _as_float(x, device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32, device=device)


__all__ = ["NEMO_RL_COMMIT", "CLIPPED_PG_DEFAULTS", "UNSUPPORTED", "batch_from_nemo_rl", "NemoRLTriageLoss",
           "TimingsBackend", "record_timings"]
