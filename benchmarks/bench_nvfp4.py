"""Cost of NVFP4 fake quantization per decode step of the study's sampler (docs/study.md#speed).

The sampler path of ``triage-monitor study`` decodes one token at a time for every response of a
step, and each quantized linear fake-quantizes its activation on every call (the weights are
quantized once per update and cached).  This script measures, for one decode step of the study's
model (TinyGPT, 2 layers, d = 64, all linears quantized: 9 activation calls; ``--quantize mlp``: 4):

  * the fake-quantization calls alone, with the shapes of one decode step:
      - ``before, native``: the native backend before this change (about 28 torch ops, a host
        synchronisation, the straight-through wrapper ``x + (q - x).detach()``), copied below;
      - ``before, torchao``: torchao's ``NVFP4Tensor`` round trip plus the same wrapper (the
        ``nvfp4`` recipe's default backend);
      - ``now, native``: :func:`triage_monitor.demo.nvfp4.fake_quantize_ste` as the sampler calls it now
        (under ``torch.no_grad``: no wrapper; on the CPU one compiled pass);
      - ``now, torch ops``: the sync-free torch path that CUDA tensors take, timed on this device;
  * one whole decode step (KV cache) with the fp32 recipe and with NVFP4 before / now.

    python benchmarks/bench_nvfp4.py [--batch 32] [--d-model 64] [--quantize all] [--repeats 5]

Prints microseconds per decode step (median of ``--repeats`` rounds of ``--iters`` steps each).

``--regime`` measures instead whether an NVFP4 sampler alone (on-policy, no staleness) reaches the regime of the
published runs (docs/study.md#the-gpu-kit): the demo's walk task at GPU scale (TinyGPT d = 256, 4 layers, a
1,024-token vocabulary whose tail never is valid, 256-token responses, 16 × 16 responses a step, a 300-step
warm start), one process per learning rate of ``--lrs`` (LLM-like 1e-6 to the CPU study's 1e-3), all concurrent
on ``--device``.  Each step the NVFP4 W4A4 sampler (every linear) generates the rollout with its KV cache; the
fp32 learner takes one plain PPO update (one per rollout, Adam).  On the same tokens, before and after the
update, four samplers' log-probs: ``nvfp4`` (the rollout's own decode log-probs; its change over the update
from the teacher-forced pass), ``nvfp4-tf`` (every linear, teacher-forced: an engine's prefill), ``nvfp4-mlp``
(the MLP linears only, the published scope, teacher-forced) and ``bf16`` (the whole model under bf16 autocast,
teacher-forced).  Per step and sampler: the sampler-follow correlation (Pearson of the learner's and the
sampler's log-prob change over the update, valid tokens), δ = learner − sampler (small-gap share |δ| < 0.05,
mean |δ|, |δ| quantiles 0.5 / 0.9 / 0.99) and ρ_asym with its trailing ``--window`` (a ``MismatchMonitor`` per
sampler, records off).  An fp32 sampler teacher-forced is the learner itself (δ = 0); the fp32 sampler's
KV-cache gap is the study's fp32 arm.

    python benchmarks/bench_nvfp4.py --regime [--lrs 1e-6,1e-5,1e-4,1e-3] [--steps 50] [--device cuda]
                                     [--deadline SECONDS] [--json PATH] [--csv PATH] [--work DIR]

Each process appends its rows to its own CSV after every step; at ``--deadline`` seconds the processes still
running are stopped and the summary is made from the steps they finished (``--json``: per learning rate and
sampler, the means and whether the regime was reached: small-gap share >= 0.83 and window ρ_asym drifting by
more than 15 % from its first full window; ``--csv``: every step's row).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fnmatch
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

import triage_monitor.demo.nvfp4 as nv
from triage_monitor.demo.grpo import QUANTIZE
from triage_monitor.demo.model import GPTConfig, TinyGPT
from triage_monitor.demo.task import VOCAB_SIZE


# ---------------------------------------------------------------- the native backend before the compiled kernel (verbatim)
def _legacy_round_e2m1(v):
    a = v.abs()
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(q, v)


def legacy_native(x, two_level=True, rows=1):
    """The 1x16 / 16x16 native arithmetic as it was (commit 4dc26c8): torch ops with a host sync."""
    with torch.no_grad():
        xf = x.detach().float()
        amax = xf.abs().amax()
        if not bool(amax > 0):
            return torch.zeros_like(x) if bool(amax == 0) else x.detach() * float("nan")
        if two_level:
            tensor_scale = amax / (nv.E2M1_MAX * nv.E4M3_MAX)
        K = x.shape[-1]
        R = x.shape[-2] if x.dim() > 1 else 1
        tiles = xf.reshape(-1, R // rows, rows, K // 16, 16)
        block_scale = tiles.abs().amax(dim=(-3, -1), keepdim=True) / nv.E2M1_MAX
        if two_level:
            block_scale = block_scale / tensor_scale
        s8 = block_scale.clamp(nv.E4M3_MIN_SCALE, nv.E4M3_MAX).to(torch.float8_e4m3fn).float()
        recip = (1.0 / tensor_scale) / s8 if two_level else 1.0 / s8
        elems = _legacy_round_e2m1((tiles * recip).clamp(-nv.E2M1_MAX, nv.E2M1_MAX))
        hp_scale = s8 * tensor_scale if two_level else s8
        return (elems * hp_scale).reshape(x.shape).to(x.dtype)


def legacy_ste(x, **kw):
    """The wrapper as it was: always ``x + (q − x).detach()``, also under ``torch.no_grad``."""
    if kw.get("backend") == "native":
        return x + (legacy_native(x, two_level=kw.get("two_level", True)) - x).detach()
    return x + (nv.nvfp4_fake_quantize(x, **kw) - x).detach()


# ---------------------------------------------------------------- measurement
def _median_us(fn, iters: int, repeats: int) -> float:
    fn()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(rounds)


def decode_inputs(model, batch: int, past: int):
    """A KV cache of ``past`` tokens for ``batch`` responses and the activations each quantized linear
    receives in one decode step (captured with forward pre-hooks)."""
    idx = torch.randint(0, VOCAB_SIZE, (batch, past))
    with torch.no_grad():
        _, cache = model(idx)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda _m, a: seen.append(a[0].clone()))
             for m in model.modules() if isinstance(m, nv.NVFP4Linear)]
    tok = torch.randint(0, VOCAB_SIZE, (batch, 1))
    with torch.no_grad():
        model(tok, cache)
    for h in hooks:
        h.remove()
    return cache, tok, seen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="responses decoded together (study: 4 × 8)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--quantize", default="all", choices=list(QUANTIZE))
    p.add_argument("--past", type=int, default=38, help="cached tokens (prompt 6 + half of a 64-token response)")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyGPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.past + 8, n_layer=args.n_layer,
                              d_model=args.d_model, quantized=QUANTIZE[args.quantize])).eval()
    recipe = nv.get_recipe("nvfp4")
    native = replace(recipe, backend="native")
    with nv.use_recipe(model, native):
        cache, tok, acts = decode_inputs(model, args.batch, args.past)
    shapes = sorted({tuple(a.shape) for a in acts})
    print(f"decode step: batch {args.batch}, d={args.d_model}, {args.n_layer} layers, quantize {args.quantize}: "
          f"{len(acts)} activation calls, shapes {shapes}; torch threads 1")

    def calls(fn):
        def run():
            with torch.no_grad():
                for a in acts:
                    fn(a)
        return run

    rows = [
        ("fake-quant calls, before, native (torch ops + sync + STE wrapper)",
         calls(lambda a: legacy_ste(a, backend="native"))),
        ("fake-quant calls, before, torchao (+ STE wrapper)", calls(lambda a: legacy_ste(a, backend="torchao"))),
        ("fake-quant calls, now, native (CPU kernel, no wrapper)",
         calls(lambda a: nv.fake_quantize_ste(a, backend="native"))),
        ("fake-quant calls, now, torch ops (the CUDA path, on this device)",
         calls(lambda a: nv._native_torch(a.float(), 1, True))),
    ]
    for label, fn in rows:
        print(f"{label:<72} {_median_us(fn, args.iters, args.repeats):9.1f} µs / decode step")

    def step(recipe_, ste=None):
        def run():
            saved = nv.fake_quantize_ste
            if ste is not None:
                nv.fake_quantize_ste = ste
            try:
                with torch.no_grad(), nv.use_recipe(model, recipe_):
                    model(tok, cache)
            finally:
                nv.fake_quantize_ste = saved
        return run

    full = [("whole decode step, fp32 recipe", step(None)),
            ("whole decode step, NVFP4 native, before", step(native, legacy_ste)),
            ("whole decode step, NVFP4 native, now", step(native))]
    base = None
    for label, fn in full:
        us = _median_us(fn, args.iters, args.repeats)
        base = us if base is None else base
        print(f"{label:<72} {us:9.1f} µs / decode step  ({us / base:.2f}× fp32)")


# ---------------------------------------------------------------- the NVFP4 regime (--regime)
#: the samplers compared on each rollout's tokens (module docstring)
SAMPLERS = ("nvfp4", "nvfp4-tf", "nvfp4-mlp", "bf16")
#: the published regime: most tokens within 0.05 nats, and a direction ratio that drifts
REGIME_SMALL_GAP, REGIME_DRIFT = 0.83, 0.15
REGIME_COLUMNS = ("lr", "sampler", "step", "reward", "n_tokens", "follow", "small_gap_share", "delta_mean",
                  "delta_abs_mean", "absdelta_q50", "absdelta_q90", "absdelta_q99", "rho_asym", "window_rho_asym",
                  "step_s", "generation_s")


@contextlib.contextmanager
def recipe_on(model, recipe, patterns=("*",)):
    """Run ``recipe`` on the NVFP4-capable linears of ``model`` whose names match ``patterns`` (full precision on the
    others) inside the block; the recipes before are restored on exit."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nv.NVFP4Linear)]
    saved = [m.recipe for _, m in layers]
    try:
        for n, m in layers:
            m.recipe = recipe if any(fnmatch.fnmatchcase(n, p) for p in patterns) else None
        yield model
    finally:
        for (_, m), r in zip(layers, saved):
            m.recipe = r


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson's correlation of two ``(n,)`` tensors in float64; NaN for fewer than 2 values or zero variance."""
    a, b = a.double(), b.double()
    if a.numel() < 2:
        return math.nan
    a, b = a - a.mean(), b - b.mean()
    den = float((a.square().sum() * b.square().sum()).sqrt())
    return float((a * b).sum()) / den if den > 0 else math.nan


def regime_worker(spec: dict) -> None:
    """One learning rate of ``--regime`` (module docstring): warm start, then ``spec["steps"]`` on-policy GRPO
    updates, appending one row per (step, sampler) to ``spec["csv"]`` (columns :data:`REGIME_COLUMNS`) after each
    step."""
    from triage_monitor.batch import TokenBatch
    from triage_monitor.demo.grpo import (DemoConfig, generate, group_advantages, policy_loss, sft_warm_start,
                                          teacher_forced_logp)
    from triage_monitor.metrics.stats import MetricConfig
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    cfg = DemoConfig(**spec["config"])
    dev = cfg.torch_device()
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    sample_gen = torch.Generator(device=dev).manual_seed(cfg.seed + 1)
    task = cfg.make_task()
    model = TinyGPT(GPTConfig(vocab_size=task.vocab_size, block_size=task.prompt_len + task.max_answer_len,
                              n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
                              quantized=QUANTIZE["all"])).to(dev)
    with nv.use_recipe(model, None):
        sft_warm_start(model, task, cfg, data_gen)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    recipe = replace(nv.get_recipe("nvfp4"), backend="native")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    P, G = cfg.prompts_per_step, cfg.group_size

    def sampler_logp(name, prompts, responses):
        if name == "bf16":
            with nv.use_recipe(model, None), torch.autocast(dev.type, dtype=torch.bfloat16):
                return teacher_forced_logp(model, prompts, responses, cfg.temperature).float()
        with recipe_on(model, recipe, ("blocks.*.mlp.*",) if name == "nvfp4-mlp" else ("*",)):
            return teacher_forced_logp(model, prompts, responses, cfg.temperature)

    mcfg = MonitorConfig(metrics=MetricConfig(segment_width=cfg.segment_width), window=cfg.window,
                         calibration_steps=cfg.calibration_steps, record_tokens=False)
    path = Path(spec["csv"])
    with contextlib.ExitStack() as stack:
        mons = {s: stack.enter_context(MismatchMonitor(Path(spec["run_dir"]) / s, mcfg, alerts=False))
                for s in SAMPLERS}
        f = stack.enter_context(path.open("w", newline=""))
        w = csv.DictWriter(f, fieldnames=REGIME_COLUMNS)
        w.writeheader()
        f.flush()
        for step in range(cfg.steps):
            sync()
            t0 = time.perf_counter()
            ops, prompts = (t.to(dev) for t in task.sample(P, data_gen))
            with recipe_on(model, recipe):
                nv.prepare_quantized_weights(model)
                responses, decode_logp, mask = generate(model, prompts, G, task.max_answer_len, cfg.temperature,
                                                        sample_gen)
            sync()
            t_gen = time.perf_counter() - t0
            ops_rep, prompts_rep = ops.repeat_interleave(G, 0), prompts.repeat_interleave(G, 0)
            rewards = task.reward(responses, ops_rep)
            adv = group_advantages(rewards, G)
            with nv.use_recipe(model, None):
                learner = teacher_forced_logp(model, prompts_rep, responses, cfg.temperature)
            with torch.no_grad():
                before = {s: sampler_logp(s, prompts_rep, responses) for s in SAMPLERS[1:]}
            before["nvfp4"] = decode_logp
            batch = TokenBatch.from_padded(learner, decode_logp, adv, mask)
            loss, _, _ = policy_loss(batch, cfg, None, step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            with torch.no_grad(), nv.use_recipe(model, None):
                learner_after = teacher_forced_logp(model, prompts_rep, responses, cfg.temperature)
                after = {s: sampler_logp(s, prompts_rep, responses) for s in SAMPLERS[1:]}
            after["nvfp4"] = after["nvfp4-tf"]
            sync()
            t_step = time.perf_counter() - t0
            d_learner = (learner_after - learner.detach())[mask]
            for s in SAMPLERS:
                d_sampler = (after[s] - (before["nvfp4-tf"] if s == "nvfp4" else before[s]))[mask]
                delta = (learner.detach() - before[s])[mask].float()
                m = mons[s].log_step(step, TokenBatch.from_padded(learner.detach(), before[s], adv, mask))
                q = torch.quantile(delta.abs(), torch.tensor([0.5, 0.9, 0.99], device=delta.device)).tolist() \
                    if delta.numel() else [math.nan] * 3
                w.writerow({"lr": cfg.lr, "sampler": s, "step": step, "reward": float(rewards.mean()),
                            "n_tokens": int(delta.numel()), "follow": _pearson(d_learner, d_sampler),
                            "small_gap_share": m.get("small_gap_share"), "delta_mean": m.get("delta_mean"),
                            "delta_abs_mean": m.get("delta_abs_mean"), "absdelta_q50": q[0], "absdelta_q90": q[1],
                            "absdelta_q99": q[2], "rho_asym": m.get("rho_asym"),
                            "window_rho_asym": m.get("window/rho_asym"), "step_s": t_step, "generation_s": t_gen})
            f.flush()


def _mean(values) -> float:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return statistics.fmean(v) if v else math.nan


def regime_summary(rows: list, window: int) -> list:
    """Per (learning rate, sampler): steps, the means of follow, small-gap share, mean |δ| and |δ| quantiles, the
    window ρ_asym at its first full window and at the last step, its drift (last − first) ÷ |first|, and whether the
    published regime was reached (small-gap share >= :data:`REGIME_SMALL_GAP` and |drift| > :data:`REGIME_DRIFT`).

    Args:
        rows: dicts with the :data:`REGIME_COLUMNS` (numbers, or strings as read from the CSV).
        window: the monitor's window in steps.
    """
    num = lambda v: float(v) if v not in (None, "") else math.nan
    groups: dict = {}
    for r in rows:
        groups.setdefault((num(r["lr"]), r["sampler"]), []).append(r)
    out = []
    for (lr, s), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], SAMPLERS.index(kv[0][1]))):
        rs = sorted(rs, key=lambda r: int(num(r["step"])))
        win = [(int(num(r["step"])), num(r["window_rho_asym"])) for r in rs if int(num(r["step"])) >= window - 1]
        win = [(st, v) for st, v in win if math.isfinite(v)]
        first, last = (win[0][1], win[-1][1]) if win else (math.nan, math.nan)
        drift = (last - first) / abs(first) if win and first != 0 else math.nan
        small = _mean(num(r["small_gap_share"]) for r in rs)
        out.append({"lr": lr, "sampler": s, "steps": len(rs), "follow_mean": _mean(num(r["follow"]) for r in rs),
                    "small_gap_share_mean": small, "delta_abs_mean": _mean(num(r["delta_abs_mean"]) for r in rs),
                    "absdelta_q50_mean": _mean(num(r["absdelta_q50"]) for r in rs),
                    "absdelta_q99_mean": _mean(num(r["absdelta_q99"]) for r in rs),
                    "rho_asym_mean": _mean(num(r["rho_asym"]) for r in rs), "window_rho_first": first,
                    "window_rho_last": last, "window_rho_drift": drift,
                    "reward_first": num(rs[0]["reward"]), "reward_last": num(rs[-1]["reward"]),
                    "step_s_mean": _mean(num(r["step_s"]) for r in rs),
                    "generation_s_mean": _mean(num(r["generation_s"]) for r in rs),
                    "regime_reached": bool(small >= REGIME_SMALL_GAP and math.isfinite(drift)
                                           and abs(drift) > REGIME_DRIFT)})
    return out


def _clean(obj):
    """``obj`` with every non-finite float as None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def regime_main(argv=None) -> int:
    """``--regime`` (module docstring): start one process per learning rate, wait until they end or the deadline,
    summarise what they wrote.  Returns 0 when every process finished, 3 when some were stopped at the deadline,
    1 when one failed (the summary holds what they finished either way)."""
    import multiprocessing as mp
    import tempfile

    p = argparse.ArgumentParser(description="the NVFP4 regime: " + __doc__.splitlines()[0])
    p.add_argument("--regime", action="store_true")
    p.add_argument("--lrs", default="1e-6,1e-5,1e-4,1e-3", help="Adam learning rates, one process each")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="cuda")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab-tail", type=int, default=1010, help="never-valid tail ids (1,024 tokens in all)")
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--segment-width", type=int, default=64)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--window", type=int, default=10, help="trailing window of window ρ_asym, steps")
    p.add_argument("--jobs", type=int, default=0, help="processes at a time (default: one per learning rate)")
    p.add_argument("--deadline", type=float, default=0.0, help="stop the processes after this many seconds (0: none)")
    p.add_argument("--work", default=None, help="folder for the per-process CSVs (default: a temporary one)")
    p.add_argument("--json", default=None)
    p.add_argument("--csv", default=None)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    work = Path(args.work or tempfile.mkdtemp(prefix="nvfp4-regime-"))
    work.mkdir(parents=True, exist_ok=True)
    config = dict(task="walk", response_len=args.response_len, vocab_tail=args.vocab_tail, d_model=args.d_model,
                  n_layer=args.n_layer, n_head=args.n_head, prompts_per_step=args.prompts, group_size=args.group,
                  sft_steps=args.sft_steps, sft_batch=64 if args.sft_steps >= 25 else 4, steps=args.steps,
                  segment_width=args.segment_width, window=args.window,
                  calibration_steps=max(1, min(10, args.steps)), correction="none", sampler_lag=0,
                  quantize="all", device=args.device)
    from triage_monitor.demo.grpo import DemoConfig

    DemoConfig(**{**config, "lr": lrs[0]})          # a bad option fails here, before any process starts
    specs = [{"config": {**config, "lr": lr}, "csv": str(work / f"regime-{i}.csv"), "run_dir": str(work / f"run-{i}")}
             for i, lr in enumerate(lrs)]
    jobs = args.jobs or len(specs)
    ctx = mp.get_context("spawn")
    pending, running, status = list(specs), [], {}
    end = t_start + args.deadline if args.deadline > 0 else math.inf
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            proc = ctx.Process(target=regime_worker, args=(spec,), daemon=True)
            proc.start()
            running.append((spec, proc))
        spec, proc = running[0]
        proc.join(timeout=max(0.0, min(end - time.perf_counter(), 1.0)))
        for spec, proc in list(running):
            if not proc.is_alive():
                running.remove((spec, proc))
                status[spec["config"]["lr"]] = "finished" if proc.exitcode == 0 else f"failed ({proc.exitcode})"
        if time.perf_counter() >= end:
            for spec, proc in running:
                proc.terminate()
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                status[spec["config"]["lr"]] = "stopped at the deadline"
            for spec in pending:
                status[spec["config"]["lr"]] = "not started (deadline)"
            running, pending = [], []
    rows = []
    for spec in specs:
        with contextlib.suppress(FileNotFoundError), open(spec["csv"], newline="") as f:
            rows += [r for r in csv.DictReader(f) if r.get("sampler") in SAMPLERS and r.get("window_rho_asym") is not None]
    summary = regime_summary(rows, args.window)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=REGIME_COLUMNS)
            w.writeheader()
            w.writerows(rows)
    import torch as _torch

    device = _torch.cuda.get_device_name(0) if args.device.startswith("cuda") and _torch.cuda.is_available() \
        else f"{args.device} (not a GPU figure)"
    head = {"part": "nvfp4_regime", "device": device, "config": config, "lrs": lrs, "samplers": list(SAMPLERS),
            "status": {str(k): v for k, v in status.items()}, "regime_rule": {"small_gap_share_at_least":
                                                                             REGIME_SMALL_GAP,
                                                                             "window_rho_drift_above": REGIME_DRIFT},
            "seconds": time.perf_counter() - t_start, "summary": summary}
    if args.json:
        tmp = Path(f"{args.json}.tmp")
        tmp.write_text(json.dumps(_clean(head), indent=1))
        os.replace(tmp, args.json)
    for r in summary:
        print(f"lr {r['lr']:g} {r['sampler']:>9}: {r['steps']} steps, follow {r['follow_mean']:.3f}, small-gap share "
              f"{r['small_gap_share_mean']:.3f}, mean |δ| {r['delta_abs_mean']:.4g}, |δ| q99 "
              f"{r['absdelta_q99_mean']:.4g}, window ρ_asym {r['window_rho_first']:.3f} → {r['window_rho_last']:.3f}, "
              f"regime {'reached' if r['regime_reached'] else 'not reached'}; {r['step_s_mean']:.2f} s a step "
              f"({r['generation_s_mean']:.2f} s generating)", flush=True)
    print(f"processes: {status}", flush=True)
    if any(v.startswith("failed") for v in status.values()) or not status:
        return 1
    return 0 if all(v == "finished" for v in status.values()) else 3


if __name__ == "__main__":
    if "--regime" in sys.argv[1:]:
        sys.exit(regime_main())
    main()
