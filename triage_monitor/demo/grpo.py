"""The demo's GRPO loop: an NVFP4 sampler, a learner with other numerics, monitored like a user's job.

One step (docs/metrics.md#terms, docs/metrics.md#published-reference setup scaled down):

1. **Sampler path** (``torch.no_grad``, sampler recipe, KV cache): for each of
   ``prompts_per_step`` addition problems generate ``group_size`` responses at
   the configured temperature, recording each generated token's log-prob.
2. Exact reward (:mod:`.task`) and GRPO advantages
   ``A_i = (r_i − mean_g r) / (std_g r + 1e-6)`` per group (unbiased std, as
   verl), broadcast over the response's tokens.
3. **Learner path** (learner recipe, straight-through gradients): teacher-forced
   log-probs of the same tokens.
4. The public API, exactly as a user's job calls it, with the step's own phase timings
   (:meth:`MismatchMonitor.log_step`'s ``timings``: generation, the sampler's weight quantisation, the stale
   weights' copy, reward and advantages, the learner's recompute, the update, the demo's diagnostics as other;
   measured on the run's device):
   :meth:`TokenBatch.from_padded` → correction (``none``: plain PPO;
   ``tis``: :func:`~triage_monitor.triage.corrections.tis_weights`; ``triage``:
   :class:`~triage_monitor.triage.controller.TriageController`) →
   :func:`~triage_monitor.triage.corrections.ppo_clip_loss` reduced by
   :func:`~triage_monitor.triage.loss.weighted_policy_loss` (+ Repair loss) →
   one Adam update per rollout → :meth:`MismatchMonitor.log_step`.

With one update per rollout the PPO ratio is 1 at the update
(``old_logp = learner_logp.detach()``), so the clip only shapes the gradient;
TIS corrects the learner/sampler gap ``exp(old_logp − sampler_logp)``.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple, Optional

import pandas as pd
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..alerting.alerts import AlertEngine, CallbackSink, default_rules
from ..batch import TokenBatch
from ..triage.controller import CalibrationConfig, TriageConfig, TriageController
from ..triage.loss import weighted_policy_loss
from ..triage.corrections import ppo_clip_loss, tis_weights
from ..metrics import names
from ..metrics.stats import MetricConfig
from ..monitor import MismatchMonitor, MonitorConfig
from ..rundir.records import check_run_dir
from .nvfp4 import get_recipe, prepare_quantized_weights, use_recipe
from .model import GPTConfig, TinyGPT
from .task import EOS, TASKS, AdditionTask, WalkTask

Tensor = torch.Tensor
CORRECTIONS = ("none", "tis", "triage")
#: ``quantize`` choices: the linears whose sampler (and learner) recipe applies
QUANTIZE = {"mlp": ("blocks.*.mlp.*",),
            "mlp+attn": ("blocks.*.mlp.*", "blocks.*.attn.*"),
            "all": ("blocks.*.mlp.*", "blocks.*.attn.*", "head")}
GATE_THRESHOLDS = ("fixed", "calibrated")
SFT_CHECK_EVERY = 25
#: off the CPU, :func:`generate` asks whether every response has ended only every this many tokens (each question
#: is a host synchronisation; on the CPU it asks after every token, which costs nothing there)
DONE_CHECK_EVERY = 16


@dataclass
class DemoConfig:
    """Every option of ``triage-monitor demo`` with its default: the mismatch study's job (docs/study.md).

    The defaults are the job ``triage-monitor study`` runs: 64-token walks
    (:class:`~triage_monitor.demo.task.WalkTask`, 4 allowed digits, partial
    credit), TinyGPT with 2 layers and d = 64, a 25-step supervised warm
    start, 4 × 8 responses a step, Adam 1e-3, an NVFP4 W4A4 sampler on every
    linear that generates with the weights of 8 updates ago (asynchronous
    rollout), an fp32 learner, 16-token segments for the monitor and the
    Gate (4 per response), 150 steps; the correction defaults to TRIAGE (the
    study sets it per arm).

    Task and model: ``task`` = ``walk`` (``response_len`` tokens over
    ``alphabet`` allowed digits) or ``addition`` (``digits``-digit operands,
    exact reward); ``n_layer``, ``n_head``, ``d_model``.  Warm start: up to
    ``sft_steps`` supervised steps of ``sft_batch`` problems at ``sft_lr``,
    stopping once the greedy held-out score reaches ``sft_target`` (0: run all),
    in full precision whatever the recipes (the "pretrained checkpoint" both
    paths start from).  GRPO: ``steps`` updates, ``prompts_per_step`` ×
    ``group_size`` responses at ``temperature``, Adam ``lr``, PPO clip
    ``[1 − clip_low, 1 + clip_high]``, gradient-norm clip ``max_grad_norm``.
    Numerics: ``sampler_recipe`` / ``learner_recipe`` (keys of
    :data:`triage_monitor.demo.nvfp4.RECIPES`) on the linears ``quantize`` names
    (``mlp`` as in the published NVFP4 runs, ``mlp+attn``, ``all`` = + LM
    head), ``nvfp4_backend``.  Mismatch mechanism: ``sampler_lag`` (the
    sampler generates with the weights of ``sampler_lag`` updates ago; 0 =
    on-policy).  Correction: ``correction`` in ``none | tis | triage``,
    ``tis_clip`` (lo, hi), ``normalization`` (docs/metrics.md#normalization),
    ``gate_width`` / ``repair_width`` (TRIAGE segment sizes), ``gate_scope`` /
    ``repair_scope``, ``gate_thresholds`` = ``fixed`` (published) or
    ``calibrated`` on the first ``calibration_steps`` steps.  Monitoring:
    ``segment_width`` (docs/metrics.md#localisation W), ``window``,
    ``calibration_steps``.  Diagnostics: ``eval_every`` (greedy held-out score
    on ``eval_size`` problems, the ``accuracy`` column; NaN between),
    ``follow_every`` (the sampler-follow correlation, :func:`follow_correlation`;
    NaN between).  Execution: ``device`` (``cpu`` or ``cuda``/``cuda:N``),
    ``threads`` (torch CPU threads; the same seed and thread count give the
    same run on the CPU), ``seed``.  Display: ``log_every`` steps per printed row.

    Raises:
        ValueError: on construction, naming the field and value (the TRIAGE
            and monitor settings are checked by their own config classes);
            ``device`` names CUDA on a machine without it.
    """

    steps: int = 150
    seed: int = 0
    group_size: int = 8
    prompts_per_step: int = 4
    sampler_recipe: str = "nvfp4"
    learner_recipe: str = "fp32"
    correction: str = "triage"
    sft_steps: int = 25
    sft_target: float = 0.0
    sft_batch: int = 64
    sft_lr: float = 3e-3
    lr: float = 1e-3
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    max_grad_norm: float = 1.0
    tis_clip: tuple = (0.0, 2.0)
    normalization: str = "per_response"
    gate_width: int = 16
    gate_scope: str = "q3"
    repair_width: int = 32
    repair_scope: str = "adv_positive"
    segment_width: int = 16
    window: int = 25
    calibration_steps: int = 10
    digits: int = 2
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    vocab_tail: int = 0
    threads: int = 1
    log_every: int = 10
    eval_size: int = 8
    eval_every: int = 5
    follow_every: int = 10
    task: str = "walk"
    response_len: int = 64
    alphabet: int = 4
    quantize: str = "all"
    sampler_lag: int = 8
    gate_thresholds: str = "calibrated"
    nvfp4_backend: str = "native"
    device: str = "cpu"

    def __post_init__(self):
        for name in ("steps", "group_size", "prompts_per_step", "sft_batch", "gate_width", "repair_width",
                     "segment_width", "window", "calibration_steps", "threads", "log_every", "eval_size",
                     "eval_every", "follow_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DemoConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.sft_steps < 0:
            raise ValueError(f"DemoConfig.sft_steps must be >= 0, got {self.sft_steps}")
        if self.vocab_tail < 0:
            raise ValueError(f"DemoConfig.vocab_tail must be >= 0, got {self.vocab_tail}")
        if not 0.0 <= self.sft_target <= 1.0:
            raise ValueError(f"DemoConfig.sft_target must lie in [0, 1], got {self.sft_target}")
        if self.group_size < 2:
            raise ValueError(f"DemoConfig.group_size must be >= 2 for GRPO advantages, got {self.group_size}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"DemoConfig.correction must be one of {CORRECTIONS}, got {self.correction!r}")
        if not self.temperature > 0:
            raise ValueError(f"DemoConfig.temperature must be > 0, got {self.temperature}")
        for name in ("sampler_recipe", "learner_recipe"):
            get_recipe(getattr(self, name))
        self.tis_clip = tuple(float(v) for v in self.tis_clip)
        for name, allowed in (("task", tuple(TASKS)), ("quantize", tuple(QUANTIZE)),
                              ("gate_thresholds", GATE_THRESHOLDS), ("nvfp4_backend", ("torchao", "native"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"DemoConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.sampler_lag < 0:
            raise ValueError(f"DemoConfig.sampler_lag must be >= 0, got {self.sampler_lag}")
        self.torch_device()
        self.make_task()
        self.triage_config()
        self.monitor_config()

    def torch_device(self) -> torch.device:
        """``device`` as a ``torch.device``.

        Raises:
            ValueError: not a device name, or a CUDA device on a machine without CUDA (or without that index).
        """
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"DemoConfig.device: {self.device!r} is not a torch device ({exc})") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"DemoConfig.device must be cpu or cuda[:N], got {self.device!r}")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"DemoConfig.device = {self.device!r}, but CUDA is not available on this machine "
                                 f"(torch {torch.__version__}); use --device cpu")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(f"DemoConfig.device = {self.device!r}: only {torch.cuda.device_count()} CUDA "
                                 f"device(s)")
        return dev

    def triage_config(self) -> TriageConfig:
        """The TRIAGE controller settings: published defaults, this run's segment widths and TIS clip."""
        calibration = CalibrationConfig(window=self.calibration_steps) if self.gate_thresholds == "calibrated" else None
        return TriageConfig(gate_width=self.gate_width, gate_scope=self.gate_scope, repair_width=self.repair_width,
                            repair_scope=self.repair_scope, normalization=self.normalization, tis_clip=self.tis_clip,
                            calibration=calibration)

    def make_task(self):
        """The task object (:class:`AdditionTask` or :class:`WalkTask`); raises ValueError on bad sizes."""
        if self.task == "walk":
            return WalkTask(self.response_len, self.alphabet, vocab_tail=self.vocab_tail)
        if self.vocab_tail:
            raise ValueError("DemoConfig.vocab_tail needs task = 'walk'")
        return AdditionTask(self.digits)

    def mechanism(self) -> str:
        """One plain sentence: where this run's learner/sampler mismatch comes from (manifests, CLI, report).

        Says whether the numbers behind it were measured (docs/study.md): the claim that NVFP4 alone does
        not break the job is made only for the configuration it was measured on.
        """
        scope = {"mlp": "the MLP linears, as in the published NVFP4 runs",
                 "mlp+attn": "the MLP and attention linears, more than the MLP-only published NVFP4 runs",
                 "all": "every linear incl. the LM head, more than the MLP-only published NVFP4 runs"}[self.quantize]
        k = self.sampler_lag
        stale = f"a sampler {k} update{'s' if k != 1 else ''} stale (asynchronous rollout)"
        measured = (self.task == "walk" and self.response_len == 64 and self.d_model == 64 and self.n_layer == 2
                    and self.lr == 1e-3 and self.prompts_per_step * self.group_size == 32)
        if self.sampler_recipe == "fp32":
            if not k:
                return ("no mismatch mechanism: an fp32 sampler on-policy; the only learner/sampler gap is float32 "
                        "rounding (KV-cache decoding vs one full forward): the control.")
            return f"mismatch from {stale} alone, in full precision: staleness without 4-bit numerics."
        numerics = f"{self.sampler_recipe} W4A4 on {scope}"
        if not k:
            return (f"mismatch from {numerics} alone, sampler on-policy, Adam lr {self.lr:g}; whether the sampler "
                    f"follows each update is the run's sampler-follow correlation (docs/study.md).")
        alone = (f"NVFP4 alone does not break this model at this learning rate (Adam {self.lr:g})" if measured else
                 f"whether NVFP4 alone breaks this configuration at Adam {self.lr:g} was not measured")
        return f"mismatch from {stale} on top of {numerics}; {alone}: see docs/study.md."

    def monitor_config(self) -> MonitorConfig:
        """The monitor settings: docs/metrics.md#steps-and-windows thresholds with this run's segment width, window and calibration."""
        return MonitorConfig(metrics=MetricConfig(segment_width=self.segment_width), window=self.window,
                             calibration_steps=self.calibration_steps)


# ------------------------------------------------------------------ paths
class Rollout(NamedTuple):
    """:func:`generate`: the sampled responses, their sampler log-probs and the response-token mask."""

    responses: Tensor
    sampler_logp: Tensor
    mask: Tensor


class WarmStart(NamedTuple):
    """:func:`sft_warm_start`: the SFT steps run and the last loss (nats/token; NaN if no step ran)."""

    steps_run: int
    last_loss: float


class StepLoss(NamedTuple):
    """:func:`policy_loss`: the step's loss, the token weights and the controller stats."""

    loss: Tensor
    token_weights: Tensor
    stats: dict[str, float]


@torch.no_grad()
def generate(model: TinyGPT, prompts: Tensor, group_size: int, max_new: int, temperature: float,
             generator: Optional[torch.Generator], greedy: bool = False) -> Rollout:
    """Sampler path: ``group_size`` responses per prompt with a KV cache.

    The prompts ``(P, L)`` are prefilled once and the cache repeated per
    response, then tokens are decoded one at a time.  After a response's
    first ``EOS`` it is padded with ``EOS`` and masked out.  Decoding stops
    when every response has ended: on the CPU checked after each token, on
    other devices every :data:`DONE_CHECK_EVERY` tokens (the only host
    synchronisation of the loop), so a CUDA decode runs ahead of the host.

    Returns:
        :class:`Rollout`: responses ``(P·G, max_new)`` int64 (rows ordered prompt-major),
        sampler_logp ``(P·G, max_new)`` float32 nats of each sampled token
        under ``softmax(logits / temperature)``, and mask ``(P·G, max_new)``
        bool (tokens up to and including the first ``EOS``).
    """
    logits, cache = model(prompts)
    cache = [(k.repeat_interleave(group_size, 0), v.repeat_interleave(group_size, 0)) for k, v in cache]
    logits = logits[:, -1].repeat_interleave(group_size, 0)
    n = logits.shape[0]
    tokens, logps = [], []
    done = torch.zeros(n, dtype=torch.bool, device=logits.device)
    check_every = _done_check_every(logits.device)
    for t in range(max_new):
        logp_all = torch.log_softmax(logits / temperature, dim=-1)
        tok = logp_all.argmax(-1) if greedy else torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(1)
        tok = torch.where(done, torch.full_like(tok, EOS), tok)
        tokens.append(tok)
        logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
        done = done | (tok == EOS)
        # stop once every response has ended: the check reads a device value (a host synchronisation), so off the
        # CPU it runs every DONE_CHECK_EVERY tokens (the tokens decoded past the end are EOS padding, masked out)
        if t == max_new - 1 or ((t + 1) % check_every == 0 and bool(done.all())):
            break
        logits, cache = model(tok[:, None], cache)
        logits = logits[:, -1]
    responses = torch.stack(tokens, 1)
    logp = torch.stack(logps, 1)
    pad = max_new - responses.shape[1]
    if pad:
        responses = F.pad(responses, (0, pad), value=EOS)
        logp = F.pad(logp, (0, pad))
    is_eos = responses == EOS
    mask = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # up to and including the first EOS
    return Rollout(responses, logp, mask)


def _done_check_every(device: torch.device) -> int:
    """Tokens between two checks of :func:`generate` for the end of every response: 1 on the CPU, else
    :data:`DONE_CHECK_EVERY`."""
    return 1 if device.type == "cpu" else DONE_CHECK_EVERY


def teacher_forced_logp(model: TinyGPT, prompts: Tensor, responses: Tensor, temperature: float = 1.0) -> Tensor:
    """Learner path: log-probs ``(B, T)`` float32 (nats) of ``responses`` ``(B, T)`` after ``prompts`` ``(B, L)``.

    One full-sequence forward (no cache), differentiable.
    """
    seq = torch.cat([prompts, responses[:, :-1]], dim=1)
    logits, _ = model(seq)
    logits = logits[:, prompts.shape[1] - 1:] / temperature
    return torch.log_softmax(logits, -1).gather(2, responses.unsqueeze(2)).squeeze(2)


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO advantages ``(P·G,)``: rewards standardised within each group of ``group_size`` (unbiased std)."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def sft_warm_start(model: TinyGPT, task, cfg: DemoConfig, gen: torch.Generator,
                   on_step=None, accuracy=None) -> WarmStart:
    """Supervised warm start on reference answers (mean cross-entropy over answer tokens, Adam ``cfg.sft_lr``).

    Runs up to ``cfg.sft_steps`` steps of ``cfg.sft_batch`` fresh problems and
    stops early, checking every ``SFT_CHECK_EVERY`` steps, once
    ``accuracy()`` (a greedy held-out score) reaches ``cfg.sft_target`` (> 0):
    small transformers learn addition in sudden jumps whose timing depends on
    the seed, so a fixed step count would leave some seeds with an all-zero
    reward.  Calls ``on_step()`` after each step.

    Returns:
        :class:`WarmStart` (steps run, last loss in nats/token; NaN if no step ran).
    """
    opt = torch.optim.Adam(model.parameters(), lr=cfg.sft_lr)
    loss = torch.tensor(float("nan"))
    for i in range(cfg.sft_steps):
        if accuracy is not None and cfg.sft_target > 0 and i % SFT_CHECK_EVERY == 0 and i > 0 \
                and accuracy() >= cfg.sft_target:
            return WarmStart(i, float(loss.detach()))
        ops, prompts = task.sample(cfg.sft_batch, gen)
        answers, length = task.answers(ops, gen)
        mask = torch.arange(answers.shape[1]) < length[:, None]
        dev = next(model.parameters()).device
        prompts, answers, mask = prompts.to(dev), answers.to(dev), mask.to(dev)
        logp = teacher_forced_logp(model, prompts, answers)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step()
    return WarmStart(cfg.sft_steps, float(loss.detach()))


@torch.no_grad()
def greedy_accuracy(model: TinyGPT, task, ops: Tensor, prompts: Tensor) -> float:
    """Mean reward of greedy decoding (current recipe) on fixed problems (exact-match accuracy for addition).

    ``ops`` and ``prompts`` must be on the model's device."""
    responses, _, _ = generate(model, prompts, 1, task.max_answer_len, 1.0, None, greedy=True)
    return float(task.reward(responses, ops).mean())


def policy_loss(batch: TokenBatch, cfg: DemoConfig, triage: TriageController, step: int
                ) -> StepLoss:
    """The step's loss, as a user's training job would write it with this package.

    ``per-token PPO loss × token weights``, normalised by
    :func:`~triage_monitor.triage.loss.weighted_policy_loss` (``cfg.normalization``),
    plus the Repair loss for ``triage``.  Weights: ``none`` → 1, ``tis`` →
    ``clamp(exp(old_logp − sampler_logp), *cfg.tis_clip)``, ``triage`` → the
    controller's Gate × TIS weights (docs/metrics.md#controller).  ``old_logp`` is the
    learner's log-prob at rollout time, here ``batch.learner_logp.detach()``.

    Returns:
        :class:`StepLoss`: loss (0-dim, differentiable), token weights ``(N,)`` (detached), and the
        stats ``gate_weight_mean``, ``gate_downweighted_frac``, ``repair_loss``,
        ``repair_active_frac``, ``tis_clip_frac`` (the share of tokens whose
        TIS ratio leaves ``cfg.tis_clip``, reported for every correction).
    """
    old_logp = batch.learner_logp.detach()
    per_token = ppo_clip_loss(batch.learner_logp, old_logp, batch.advantage, cfg.clip_low, cfg.clip_high)
    if cfg.correction == "triage":
        out = triage(batch, step=step, old_logp=old_logp)
        loss = weighted_policy_loss(per_token, out.token_weights, batch, normalization=cfg.normalization)
        return StepLoss(loss + out.repair_loss, out.token_weights, dict(out.stats))
    ratio = torch.exp(old_logp - batch.sampler_logp)
    stats = {"gate_weight_mean": 1.0, "gate_downweighted_frac": 0.0, "repair_loss": 0.0, "repair_active_frac": 0.0,
             "tis_clip_frac": float(((ratio < cfg.tis_clip[0]) | (ratio > cfg.tis_clip[1])).float().mean())}
    if cfg.correction == "tis":
        weights = tis_weights(old_logp, batch.sampler_logp, *cfg.tis_clip)
    else:
        weights = torch.ones_like(old_logp)
    return StepLoss(weighted_policy_loss(per_token, weights, batch, normalization=cfg.normalization), weights, stats)


# ------------------------------------------------------------------ run
#: per-step terminal columns: (metric key, header, format)
DISPLAY = [("reward", "reward", "{:.3f}"), ("accuracy", "acc", "{:.3f}"),
           *((m, names.short(m), spec) for m, spec in (("delta_abs_mean", "{:.4f}"), ("rho_asym", "{:.3f}"),
                                                       ("small_gap_share", "{:.3f}"), ("c_tok", "{:.3f}"))),
           ("gate_weight_mean", "gate w", "{:.3f}"), ("repair_loss", "repair", "{:.1e}")]
#: extra rows of the final summary table (metrics under their declared labels, then the job's own figures)
SUMMARY_EXTRA = [*((m, names.label(m), spec) for m, spec in (("window/rho_asym", "{:.3f}"), ("delta_q05", "{:.4f}"),
                                                             ("k3_kl", "{:.1e}"))),
                 ("tis_clip_frac", "TIS clip frac", "{:.4f}"), ("gate_downweighted_frac", "gate down frac", "{:.4f}"),
                 ("mixed_groups", "mixed groups", "{:.3f}"), ("seconds", "s / step", "{:.2f}")]


def _fmt(v, spec) -> str:
    return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else spec.format(v)


def run_demo(cfg: DemoConfig, out_dir, *, quiet: bool = False, console=None, on_step=None, resume: bool = False,
             force: bool = False) -> pd.DataFrame:
    """Run the demo GRPO job and record it with :class:`MismatchMonitor` in ``out_dir``.

    Args:
        cfg: :class:`DemoConfig`.
        out_dir: run directory (created; Parquet ``tokens/``, ``steps/`` and ``run.json``).  An
            existing run there of the same configuration is continued as a new attempt, with a warning; one of
            another configuration is refused before any work (docs/reliability.md#one-run-per-directory).
        quiet: no terminal output.
        console: a ``rich.console.Console`` (default: a new one on stdout).
        on_step: optional ``fn(metrics: dict)`` called after every GRPO step (progress bars of callers).
        resume: continue a run of another correction / demo config in ``out_dir`` as a new attempt.
        force: start over: a run in ``out_dir`` is moved to ``<out_dir>.replaced-<UTC time>``.

    Returns:
        One row per GRPO step: ``step``, ``reward`` (mean exact-match reward of
        the sampled responses), ``accuracy`` (greedy exact-match accuracy on
        ``eval_size`` fixed held-out problems under the sampler recipe, with
        the policy that generated the step's rollout), ``mixed_groups`` (share of groups with both outcomes, the
        ones that carry gradient), ``loss``, ``seconds``, the controller stats
        ``grad_norm`` (total gradient norm before clipping), ``sampler_nll`` (mean −log-prob of the sampled
        tokens under the sampler: its entropy estimate, nats), ``response_len``,
        and every metric ``log_step`` returned (``rho_asym``,
        ``small_gap_share``, ``c_tok``, ``delta_q05``, ``window/...``).
        ``df.attrs`` holds ``eval_before`` / ``eval_after`` (greedy accuracy
        under the sampler recipe) and ``seconds_total``.

    Raises:
        triage_monitor.records.OutputError: ``out_dir`` cannot be written, holds another run, or is being
            written by another process (before the SFT warm start).
    """
    console = console or Console(quiet=quiet)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, Path(out_dir), console, on_step, resume, force)
    finally:
        torch.set_num_threads(threads)


def _recipe(name: str, console):
    """The named recipe; without torchao, its bit-identical native backend (with a note)."""
    r = get_recipe(name)
    if r is not None and r.backend == "torchao" and importlib.util.find_spec("torchao") is None:
        console.print(f"[yellow]torchao is not installed: recipe {name} runs on the native NVFP4 backend "
                      f"(bit-identical; pip install 'torchao>=0.18' for the reference)[/]")
        r = replace(r, backend="native")
    return r


def _progress(console) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=True)


def _run(cfg: DemoConfig, out_dir: Path, console, on_step=None, resume: bool = False,
         force: bool = False) -> pd.DataFrame:
    t_start = time.perf_counter()
    dev = cfg.torch_device()
    torch.manual_seed(cfg.seed)
    data_gen = torch.Generator().manual_seed(cfg.seed)                  # prompts: drawn on the CPU, moved to dev
    sample_gen = torch.Generator(device=dev).manual_seed(cfg.seed + 1)
    task = cfg.make_task()
    model = TinyGPT(GPTConfig(vocab_size=task.vocab_size, block_size=task.prompt_len + task.max_answer_len,
                              n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
                              quantized=QUANTIZE[cfg.quantize])).to(dev)
    sampler, learner = _recipe(cfg.sampler_recipe, console), _recipe(cfg.learner_recipe, console)
    if cfg.nvfp4_backend == "native":  # the bit-identical backend (tests/test_nvfp4.py), faster on every device
        sampler, learner = (replace(r, backend="native") if r is not None else None for r in (sampler, learner))
    eval_ops, eval_prompts = (t.to(dev) for t in task.sample(cfg.eval_size,
                                                             torch.Generator().manual_seed(cfg.seed + 2)))
    n_params = sum(p.numel() for p in model.parameters())
    # what the run is (compared with a run already in out_dir before the costly SFT warm start: one run per directory)
    manifest: dict = {"model": f"TinyGPT-{cfg.n_layer}L-d{cfg.d_model} ({n_params} params, NVFP4-capable: "
                         f"{', '.join(model.quantized)})",
                "task": (f"{cfg.digits}-digit addition, reversed answer, exact-match reward" if cfg.task == "addition"
                         else f"{cfg.response_len}-token walk over {cfg.alphabet} allowed digits, no repeats, "
                              f"partial-credit reward" + (f", {cfg.vocab_tail} never-valid tail tokens"
                                                          if cfg.vocab_tail else "")),
                "correction": cfg.correction, "demo_config": asdict(cfg), "framework": "triage-monitor demo"}
    existing = check_run_dir(out_dir, cfg.monitor_config().to_dict(), manifest, resume=resume, force=force)
    if existing is not None:
        console.print(f"[yellow]{out_dir} already holds this run (same configuration): this one is recorded as a new "
                      f"attempt (its steps replace the older ones with the same numbers); use --force or a fresh "
                      f"--out for a clean run[/]")
    task_text = (f"{cfg.digits}-digit addition" if cfg.task == "addition"
                 else f"{cfg.response_len}-token walks over {cfg.alphabet} allowed digits")
    console.print(f"[bold]triage-monitor demo[/]: GRPO on {task_text}, TinyGPT {n_params:,} params "
                  f"({cfg.n_layer} layers, d={cfg.d_model}) on {dev}; sampler [cyan]{cfg.sampler_recipe}[/], learner "
                  f"[cyan]{cfg.learner_recipe}[/], correction [cyan]{cfg.correction}[/] → {out_dir}")
    console.print(f"mismatch: {cfg.mechanism()}")

    with _progress(console) as progress:
        bar = progress.add_task("SFT warm start", total=cfg.sft_steps)
        with use_recipe(model, None):  # the "pretrained checkpoint": full precision, same for every recipe
            sft_done, sft_loss = sft_warm_start(model, task, cfg, data_gen, lambda: progress.update(bar, advance=1),
                                                lambda: greedy_accuracy(model, task, eval_ops, eval_prompts))
    with use_recipe(model, sampler):
        eval_before = greedy_accuracy(model, task, eval_ops, eval_prompts)
    console.print(f"SFT warm start: {sft_done} steps, loss {sft_loss:.3f}; "
                  f"greedy score under the sampler recipe {eval_before:.3f}")

    triage = TriageController(cfg.triage_config())
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    manifest.update({"mismatch_mechanism": cfg.mechanism(), "sampler_lag": cfg.sampler_lag,
                     "sampler_recipe": cfg.sampler_recipe, "learner_recipe": cfg.learner_recipe,
                     "recipes": {"sampler": asdict(sampler) if sampler else None,
                                 "learner": asdict(learner) if learner else None},
                     "device": str(dev), "sft_steps_run": sft_done, "sft_greedy_accuracy": eval_before,
                     "sampler_logp": f"raw log-softmax at temperature {cfg.temperature} (no top-p/top-k)"})
    P, G = cfg.prompts_per_step, cfg.group_size
    # asynchronous rollout: the sampler generates with a copy of the weights from `sampler_lag` updates ago
    stale = copy.deepcopy(model) if cfg.sampler_lag else model
    history = [copy.deepcopy(model.state_dict())] if cfg.sampler_lag else []
    sample_ids = torch.arange(P * G, device=dev)
    rows = []
    table_cols = [("step", "{:d}")] + [(k, f) for k, _, f in DISPLAY]
    # the shipped default alert rules watch the run live (the run directory's alerts/ table, the console)
    alerts = AlertEngine(default_rules(), sinks=[CallbackSink(lambda a: console.print(
        f"[yellow]alert[/] step {a.step}: [bold]{a.rule}[/] ({a.metric} {a.value:.4g}, threshold {a.threshold:.4g})"))])
    with MismatchMonitor(out_dir, cfg.monitor_config(), manifest=manifest, alerts=alerts, resume=resume) as mon, \
            _progress(console) as progress:
        bar = progress.add_task("GRPO", total=cfg.steps)
        console.print(" ".join(f"{h:>7}" for h in ["step"] + [h for _, h, _ in DISPLAY]), style="bold")
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            clock = _PhaseClock(dev)
            ops, prompts = (t.to(dev) for t in task.sample(P, data_gen))
            with clock("weight_sync"):         # the asynchronous rollout's generator gets the weights of lag steps ago
                if cfg.sampler_lag:
                    stale.load_state_dict(history[0])
            with use_recipe(stale, sampler):
                with clock("quantize"):        # the sampler's 4-bit weights and scales for the new weights
                    prepare_quantized_weights(stale)
                with clock("other"):           # diagnostics of the demo: greedy held-out score
                    accuracy = (greedy_accuracy(stale, task, eval_ops, eval_prompts) if step % cfg.eval_every == 0
                                else math.nan)
                with clock("generation"):
                    responses, sampler_logp, mask = generate(stale, prompts, G, task.max_answer_len, cfg.temperature,
                                                             sample_gen)
            with clock("reward"):
                ops_rep, prompts_rep = ops.repeat_interleave(G, 0), prompts.repeat_interleave(G, 0)
                rewards = task.reward(responses, ops_rep)
                adv = group_advantages(rewards, G)

            with clock("logprob"), use_recipe(model, learner):
                learner_logp = teacher_forced_logp(model, prompts_rep, responses, cfg.temperature)
            batch = TokenBatch.from_padded(
                learner_logp, sampler_logp, adv, mask, sample_ids=sample_ids,
                group_ids=(step * P + torch.arange(P, device=dev)).repeat_interleave(G))
            with clock("update"):
                loss, weights, stats = policy_loss(batch, cfg, triage, step)
            probe = step % cfg.follow_every == 0
            if probe:   # the sampler recipe's log-probs before the update, current weights (not the stale copy)
                with clock("other"), torch.no_grad(), use_recipe(model, sampler):
                    sampler_before = teacher_forced_logp(model, prompts_rep, responses, cfg.temperature)
            with clock("update"):
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
                opt.step()
            with clock("other"):
                follow = (follow_correlation(model, sampler, learner, prompts_rep, responses, mask,
                                             learner_logp.detach(), sampler_before, cfg.temperature)
                          if probe else math.nan)
            with clock("weight_sync"):
                if cfg.sampler_lag:
                    history = (history + [copy.deepcopy(model.state_dict())])[-(cfg.sampler_lag + 1):]

            groups = rewards.view(P, G)
            extra = {"reward": float(rewards.mean()), "accuracy": accuracy,
                     "mixed_groups": float(((groups.min(1).values == 0) & (groups.max(1).values == 1)).float().mean()),
                     "response_len": float(mask.sum(1).float().mean()), "loss": float(loss.detach()),
                     "grad_norm": grad_norm, "sampler_nll": float(-sampler_logp[mask].mean()),
                     "sampler_staleness": min(step, cfg.sampler_lag), "follow_corr": follow,
                     **stats, "seconds": time.perf_counter() - t0}
            metrics = mon.log_step(step, batch, extra=extra, token_extras={"token_weight": weights},
                                   timings={**clock.seconds, "step": extra["seconds"]})
            rows.append(metrics)
            progress.update(bar, advance=1)
            if on_step is not None:
                on_step(metrics)
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                console.print(" ".join(f"{_fmt(metrics.get(k), f):>7}" for k, f in table_cols))

    df = pd.DataFrame(rows)
    with use_recipe(model, sampler):
        eval_after = greedy_accuracy(model, task, eval_ops, eval_prompts)
    df.attrs.update(sft_steps_run=sft_done, eval_before=eval_before, eval_after=eval_after,
                    seconds_total=time.perf_counter() - t_start)
    _summary(console, cfg, df, out_dir)
    return df


class _PhaseClock:
    """Seconds per phase of one demo step (``with clock("generation"): ...``, added up per phase); on a CUDA device
    each phase waits for its kernels before it is read (``torch.cuda.synchronize``), so the time is the phase's."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict = {}

    def __call__(self, phase: str):
        import contextlib

        @contextlib.contextmanager
        def timed():
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                yield
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

        return timed()


@torch.no_grad()
def follow_correlation(model: TinyGPT, sampler, learner, prompts: Tensor, responses: Tensor, mask: Tensor,
                       learner_before: Tensor, sampler_before: Tensor, temperature: float = 1.0) -> float:
    """The sampler-follow correlation of one update: does the sampler's numerics see the learner's update?

    After the optimizer step, the learner recipe's and the sampler recipe's teacher-forced log-probs of
    the same tokens are computed again with the updated weights (the current model, not a stale copy);
    the result is Pearson's correlation, over the valid tokens, between the learner's change
    ``Δ_L = log π_L(after) − log π_L(before)`` and the sampler's change ``Δ_S`` (nats).  1: the
    sampler's quantised weights follow each update (an fp32 sampler gives exactly 1); near 0: its
    change is rounding noise, the premise of the published NVFP4 runs (docs/study.md).

    Args:
        model: the learner's model after the update; sampler / learner: recipes (None = fp32).
        prompts ``(B, L)``, responses ``(B, T)``, mask ``(B, T)`` bool; learner_before / sampler_before:
            ``(B, T)`` log-probs before the update (nats).

    Returns:
        The correlation (float), NaN when a change has zero variance or fewer than 2 valid tokens.
    """
    with use_recipe(model, learner):
        learner_after = teacher_forced_logp(model, prompts, responses, temperature)
    with use_recipe(model, sampler):
        sampler_after = teacher_forced_logp(model, prompts, responses, temperature)
    dl = (learner_after - learner_before)[mask].double()
    ds = (sampler_after - sampler_before)[mask].double()
    if dl.numel() < 2:
        return math.nan
    dl, ds = dl - dl.mean(), ds - ds.mean()
    denom = float((dl.square().sum() * ds.square().sum()).sqrt())
    return float((dl * ds).sum()) / denom if denom > 0 else math.nan


def _summary(console, cfg: DemoConfig, df: pd.DataFrame, out_dir: Path) -> None:
    n = len(df)
    parts = {"first 25%": df.iloc[: max(1, n // 4)], "last 25%": df.iloc[-max(1, n // 4):], "all": df}
    table = Table(title=f"demo summary ({cfg.correction}; sampler {cfg.sampler_recipe}, learner {cfg.learner_recipe})")
    table.add_column("metric")
    for name in parts:
        table.add_column(name, justify="right")
    for key, label, spec in DISPLAY + SUMMARY_EXTRA:
        if key in df:
            table.add_row(label, *(_fmt(float(p[key].mean()), spec) for p in parts.values()))
    console.print(table)
    from ..metrics.timings import cycle_summary

    for line in cycle_summary(df).lines(cfg.device):      # the step's own phase timings (docs/metrics.md)
        console.print(line, highlight=False)
    from ..exits import command_line       # the command as it runs from here (docs/cli.md#printed-commands)

    console.print(f"greedy accuracy (sampler recipe): {df.attrs['eval_before']:.3f} after SFT → "
                  f"{df.attrs['eval_after']:.3f} after GRPO; {df.attrs['seconds_total']:.1f} s; run written to "
                  f"{out_dir} (try: {command_line('analyze', out_dir)})", highlight=False, soft_wrap=True)
