"""The built-in demo RL job: ``triage-monitor demo`` (one run) and ``triage-monitor study`` (arms × seeds).

A real (small) GRPO run on the CPU (or a CUDA device): a tiny causal
transformer learns 64-token walks with partial credit (a task that keeps its
entropy; the default, the mismatch study's job) or multi-digit addition with an
exact reward, sampling with NVFP4 W4A4 linears (by default 8 updates stale:
asynchronous rollout) and learning in fp32, every step recorded through the public API
(:class:`~triage_monitor.TokenBatch`,
:class:`~triage_monitor.triage.controller.TriageController`,
:class:`~triage_monitor.monitor.MismatchMonitor`, the default alert rules).
See :mod:`.grpo` and, for the comparison of corrections, :mod:`.study`
(docs/study.md).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from .grpo import CORRECTIONS, DemoConfig, run_demo

__all__ = ["DemoConfig", "add_arguments", "config_from_args", "run_demo"]

_HELP = {
    "steps": "GRPO updates (one per rollout)",
    "seed": "random seed; the same seed (and --threads) gives the same run",
    "group_size": "responses per prompt (G)",
    "prompts_per_step": "prompts per rollout",
    "sampler_recipe": "numerics of the sampler's --quantize linears: nvfp4 = W4A4, 1x16 blocks, two-level scales; "
                      "nvfp4_16x16 = 16x16 weight tiles, single-level scales; fp32 = no quantization",
    "learner_recipe": "numerics of the learner's --quantize linears (same choices; straight-through gradients)",
    "correction": "off-policy correction: none (plain PPO), tis (TIS clip), triage (TIS + Gate + Repair)",
    "sft_steps": "maximum supervised warm-start steps before GRPO",
    "sft_target": "stop the warm start once greedy held-out accuracy reaches this (0: run all --sft-steps)",
    "sft_batch": "problems per warm-start step",
    "sft_lr": "Adam learning rate of the warm start",
    "lr": "Adam learning rate of the GRPO updates",
    "temperature": "sampling temperature",
    "clip_low": "PPO ratio clip below 1 (ratio >= 1 - clip_low)",
    "clip_high": "PPO ratio clip above 1 (ratio <= 1 + clip_high)",
    "max_grad_norm": "gradient-norm clip of each update",
    "tis_clip": "TIS weight clamp [LO, HI]",
    "normalization": "weighted policy-loss normalisation (docs/metrics.md#normalization)",
    "gate_width": "TRIAGE Gate segment width in tokens (the published runs use 64)",
    "gate_scope": "tokens the Gate weight applies to: q3 (delta < 0 only) or whole segment",
    "repair_width": "TRIAGE Repair segment width in tokens (the published runs use 128)",
    "repair_scope": "tokens that carry Repair gradient",
    "segment_width": "monitor localisation segment width W in tokens (the published runs use 64)",
    "window": "trailing window of the monitor's window/ metrics, in steps",
    "calibration_steps": "steps of the reference window that calibrates tau_tail",
    "digits": "operand length of the addition task",
    "n_layer": "transformer layers",
    "n_head": "attention heads",
    "d_model": "model width (multiple of 16)",
    "threads": "torch CPU threads",
    "log_every": "print a metrics row every k steps",
    "eval_size": "held-out problems scored greedily every --eval-every steps (the accuracy column)",
    "eval_every": "steps between two greedy held-out scores (accuracy is NaN in between)",
    "follow_every": "steps between two measurements of the sampler-follow correlation (follow_corr: learner vs "
                    "sampler log-prob change over one update)",
    "vocab_tail": "walk task: extra never-valid token ids (a long-tail vocabulary)",
    "device": "torch device: cpu, or cuda / cuda:N (the model, the rollout and the loss run there)",
    "task": "addition (exact answer) or walk (long responses, many valid answers, partial credit: keeps entropy)",
    "response_len": "walk task: response length in tokens",
    "alphabet": "walk task: allowed digits per prompt",
    "quantize": "linears that run the recipes: mlp (as the published NVFP4 runs), mlp+attn, all (+ LM head: "
                "exaggerated)",
    "sampler_lag": "the sampler generates with the weights of this many updates ago (asynchronous rollout; "
                   "0 = on-policy)",
    "gate_thresholds": "TRIAGE Gate thresholds: fixed (published) or calibrated on the first --calibration-steps",
    "nvfp4_backend": "torchao (reference) or native (bit-identical, faster on CPU)",
}


def add_arguments(parser: argparse.ArgumentParser, *, exclude=(), defaults=None,
                  suppress: bool = False) -> argparse.ArgumentParser:
    """Add one ``--option`` per :class:`DemoConfig` field (``--out`` is the caller's); returns ``parser``.

    Args:
        exclude: field names to leave out (``study`` sets ``seed``, ``correction`` and ``sampler_recipe`` per arm).
        defaults: field → default shown in the help (default: :class:`DemoConfig`'s).
        suppress: do not set attributes for options not given (``argparse.SUPPRESS``), so a caller can
            tell an explicit option from a default (``study --preset``); the help still shows the default.
    """
    from .nvfp4 import RECIPES

    from .grpo import GATE_THRESHOLDS, QUANTIZE
    from .task import TASKS

    choices = {"sampler_recipe": sorted(RECIPES), "learner_recipe": sorted(RECIPES), "correction": list(CORRECTIONS),
               "task": list(TASKS), "quantize": list(QUANTIZE), "gate_thresholds": list(GATE_THRESHOLDS),
               "nvfp4_backend": ["torchao", "native"],
               "normalization": ["per_response", "global_token"], "gate_scope": ["q3", "whole"],
               "repair_scope": ["adv_positive", "q2", "whole"]}
    shown = {f.name: f.default for f in fields(DemoConfig)}
    shown.update(defaults or {})
    for f in fields(DemoConfig):
        if f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = shown[f.name]
        help_ = f"{_HELP.get(f.name, f.name.replace('_', ' '))} (default: {default})"
        kw: dict[str, Any] = dict(default=argparse.SUPPRESS if suppress else default, help=help_)
        if f.name == "tis_clip":
            parser.add_argument(flag, type=float, nargs=2, metavar=("LO", "HI"), **kw)
        else:
            parser.add_argument(flag, type=type(f.default), choices=choices.get(f.name), **kw)
    return parser


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Build a :class:`DemoConfig` from parsed arguments (fields absent from ``args`` keep their defaults).

    Raises:
        ValueError: an option value is invalid (the message names it).
    """
    return DemoConfig(**{f.name: getattr(args, f.name) for f in fields(DemoConfig) if hasattr(args, f.name)})
