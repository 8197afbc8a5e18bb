"""The built-in demo RL job: ``triage-monitor demo``.

A real (small) GRPO run on CPU: a tiny causal transformer learns multi-digit
addition with an exact reward, sampling with NVFP4 W4A4 MLP projections and
learning with a different numeric recipe, every step recorded through the
public API (:class:`~triage_monitor.TokenBatch`,
:class:`~triage_monitor.controller.TriageController`,
:class:`~triage_monitor.monitor.MismatchMonitor`).  See :mod:`.grpo`.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from .grpo import CORRECTIONS, DemoConfig, run_demo

__all__ = ["DemoConfig", "add_arguments", "config_from_args", "run_demo"]

_HELP = {
    "steps": "GRPO updates (one per rollout)",
    "seed": "random seed; the same seed (and --threads) gives the same run",
    "group_size": "responses per prompt (G)",
    "prompts_per_step": "prompts per rollout",
    "sampler_recipe": "numeric recipe of the sampler's MLP projections",
    "learner_recipe": "numeric recipe of the learner's MLP projections",
    "correction": "off-policy correction: none (plain PPO), tis (TIS clip), triage (TIS + Gate + Repair)",
    "sft_steps": "maximum supervised warm-start steps before GRPO",
    "sft_target": "stop the warm start once greedy held-out accuracy reaches this (0: run all --sft-steps)",
    "lr": "Adam learning rate of the GRPO updates",
    "sft_lr": "Adam learning rate of the warm start",
    "temperature": "sampling temperature",
    "digits": "operand length of the addition task",
    "threads": "torch CPU threads",
    "log_every": "print a metrics row every k steps",
}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one ``--option`` per :class:`DemoConfig` field (``--out`` is the caller's); returns ``parser``."""
    from ..nvfp4 import RECIPES

    choices = {"sampler_recipe": sorted(RECIPES), "learner_recipe": sorted(RECIPES), "correction": list(CORRECTIONS),
               "normalization": ["per_response", "global_token"], "gate_scope": ["q3", "whole"],
               "repair_scope": ["adv_positive", "q2", "whole"]}
    for f in fields(DemoConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = f"{_HELP.get(f.name, f.name.replace('_', ' '))} (default: %(default)s)"
        if f.name == "tis_clip":
            parser.add_argument(flag, type=float, nargs=2, default=f.default, metavar=("LO", "HI"), help=help_)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, choices=choices.get(f.name),
                                help=help_)
    return parser


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Build a :class:`DemoConfig` from parsed arguments (fields absent from ``args`` keep their defaults).

    Raises:
        ValueError: an option value is invalid (the message names it).
    """
    return DemoConfig(**{f.name: getattr(args, f.name) for f in fields(DemoConfig) if hasattr(args, f.name)})
