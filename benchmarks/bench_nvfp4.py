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
      - ``now, native``: :func:`triage_monitor.nvfp4.fake_quantize_ste` as the sampler calls it now
        (under ``torch.no_grad``: no wrapper; on the CPU one compiled pass);
      - ``now, torch ops``: the sync-free torch path that CUDA tensors take, timed on this device;
  * one whole decode step (KV cache) with the fp32 recipe and with NVFP4 before / now.

    python benchmarks/bench_nvfp4.py [--batch 32] [--d-model 64] [--quantize all] [--repeats 5]

Prints microseconds per decode step (median of ``--repeats`` rounds of ``--iters`` steps each).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

import triage_monitor.nvfp4 as nv
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


if __name__ == "__main__":
    main()
