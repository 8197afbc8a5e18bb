"""NVFP4 fake quantization (emulation on any device) and W4A4 linear layers.

NVFP4 (docs/metrics.md#nvfp4) stores a tensor as

* elements in FP4 **E2M1**: sign bit and magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6};
* one **FP8 E4M3** scale (max 448) per block of 16 consecutive elements along
  the reduction (last) dimension ("1x16"); training recipes also use square
  16x16 weight tiles ("16x16"), which make ``W`` and ``Wᵀ`` share scales;
* optionally a second-level **FP32 per-tensor scale** ``amax / (6 · 448)`` so
  that the block scales use the whole E4M3 range ("two-level" scaling).
  Without it ("single-level") block scales are ``block_amax / 6`` stored
  directly in E4M3, clamped to [2⁻⁶, 448] (torchao's ``E4M3_EPS`` floor).

Elements are rounded to nearest, ties to even (the inference-engine choice).
"Fake" quantization returns the dequantized values in the input dtype, so the
rest of the network runs in full precision on the 4-bit grid: it reproduces
NVFP4 numerics, not its speed.

The default backend calls torchao (``NVFP4Tensor.to_nvfp4(x,
per_tensor_scale=per_tensor_amax_to_scale(amax)).dequantize(torch.float32)``),
the reference implementation of the format, for 1x16 blocks.  A "native"
backend runs the same arithmetic without torchao and is the only one for 16x16
tiles: on the CPU in one compiled pass (numba, :func:`_quantize_kernel`; a
call costs about as much as one small torch op), on other devices in about 20
vectorised torch ops with no host synchronisation (on CUDA compiled with
``torch.compile`` while the compiled kernels stay within
:data:`COMPILED_MAX_DIFF_FRACTION` / :data:`COMPILED_MAX_DIFF_OF_BLOCK_AMAX` of
the eager ops; :func:`quantizer_status` says which runs).  The tests check
both bit for bit against torchao and against a hand implementation
(benchmarks/bench_nvfp4.py measures the cost per decode step, docs/study.md).

:class:`NVFP4Linear` quantizes weights and activations (W4A4) with a
straight-through estimator, so a learner can train through it; a
:class:`NVFP4Recipe` names the scaling choices of one computation path, and
:func:`use_recipe` switches a model between paths (sampler vs learner) while
the weights stay shared.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit
from torch import nn

Tensor = torch.Tensor

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: smallest block scale (torchao's E4M3_EPS, the smallest normal E4M3 number, 2^-6)
E4M3_MIN_SCALE = 2.0 ** -6
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK_SHAPES = ("1x16", "16x16")
BACKENDS = ("torchao", "native")


def _torchao():
    """Import torchao's NVFP4 module lazily (a core dependency, torchao>=0.18), quietly."""
    noisy = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in noisy]
    try:
        for lg in noisy:
            lg.setLevel(logging.ERROR)
        from torchao.prototype.mx_formats import nvfp4_tensor
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "NVFP4 emulation needs torchao>=0.18: pip install 'torchao>=0.18'") from exc
    finally:
        for lg, lv in zip(noisy, levels):
            lg.setLevel(lv)
    return nvfp4_tensor


def _round_e2m1(v: Tensor) -> Tensor:
    """Round float32 ``v`` (already clamped to [-6, 6]) to the E2M1 grid, ties to even.

    ``torch.bucketize`` (an element equal to a boundary goes to the lower
    bucket) against the midpoints of the grid finds the nearest magnitude; the
    ties that round up to the even code (0.75 → 1, 1.75 → 2, 3.5 → 4) use the
    float32 just below the midpoint as their boundary, so they land in the
    upper bucket, and the ties that round down (0.25 → 0, 1.25 → 1, 2.5 → 2,
    5 → 4) use the midpoint itself.  The sign is kept (−0.25 → −0).
    """
    bounds, grid = _e2m1_tables(v.device)
    return torch.copysign(grid[torch.bucketize(v.abs(), bounds)], v)


class E2M1Tables(NamedTuple):
    """:func:`_e2m1_tables`: the bucket boundaries ``(7,)`` and the E2M1 grid ``(8,)`` float32 on one device."""

    bounds: Tensor
    grid: Tensor


_E2M1_TABLES: dict[str, E2M1Tables] = {}


def _e2m1_tables(device) -> E2M1Tables:
    """Bucket boundaries ``(7,)`` and grid ``(8,)`` of :func:`_round_e2m1` on ``device`` (cached)."""
    key = str(device)
    if key not in _E2M1_TABLES:
        below = lambda m: float(torch.nextafter(torch.tensor(m), torch.tensor(0.0)))
        bounds = torch.tensor([0.25, below(0.75), 1.25, below(1.75), 2.5, below(3.5), 5.0], device=device)
        _E2M1_TABLES[key] = E2M1Tables(bounds, torch.tensor(E2M1_GRID, device=device))
    return _E2M1_TABLES[key]


# ---- the CPU kernel: one pass, float32 arithmetic in the order of the torch path (so the same bits)
_F0, _F1, _F6, _FN6 = np.float32(0.0), np.float32(1.0), np.float32(E2M1_MAX), np.float32(-E2M1_MAX)
_F2688 = np.float32(E2M1_MAX * E4M3_MAX)
_SMIN, _SMAX = np.float32(E4M3_MIN_SCALE), np.float32(E4M3_MAX)
_G1, _G2, _G3, _G4, _G5, _G6, _G7 = (np.float32(g) for g in E2M1_GRID[1:])


@njit(nogil=True, cache=True)
def _e2m1_scalar(v):                                          # pragma: no cover - compiled
    """:func:`_round_e2m1` of one float32 in [-6, 6]: comparisons with the midpoints, ties to the even code."""
    a = abs(v)
    if a <= np.float32(0.25):
        q = _F0
    elif a < np.float32(0.75):
        q = _G1
    elif a <= np.float32(1.25):
        q = _G2
    elif a < np.float32(1.75):
        q = _G3
    elif a <= np.float32(2.5):
        q = _G4
    elif a < np.float32(3.5):
        q = _G5
    elif a <= np.float32(5.0):
        q = _G6
    else:
        q = _G7
    return -q if np.signbit(v) else q


@njit(nogil=True, cache=True, error_model="numpy")
def _quantize_kernel(x, rows, two_level, out):                # pragma: no cover - compiled
    """NVFP4 fake quantization of float32 ``x`` ``(R, K)`` into ``out`` ``(R, K)``; returns amax(|x|).

    Blocks of ``rows`` × 16 (1 or 16 rows; ``R % rows == 0``, ``K % 16 == 0``).  The E4M3 block
    scale is rounded to nearest even on its bits (3 mantissa bits; the clamp to [2⁻⁶, 448] keeps it
    normal).  When the returned amax is 0 or not finite ``out`` is undefined (the caller decides).
    """
    R, K = x.shape
    amax = _F0
    for i in range(R):
        for j in range(K):
            a = abs(x[i, j])
            if a > amax or a != a:
                amax = a
                if a != a:
                    return amax
    if not amax > _F0 or amax == np.inf:
        return amax
    ts = amax / _F2688
    inv_ts = _F1 / ts
    nb = K // 16
    bs = np.empty(nb, np.float32)
    bits = bs.view(np.uint32)
    for r0 in range(0, R, rows):
        for b in range(nb):
            m = _F0
            for i in range(r0, r0 + rows):
                for j in range(b * 16, b * 16 + 16):
                    a = abs(x[i, j])
                    if a > m:
                        m = a
            s = m / _F6
            if two_level:
                s = s / ts
            bs[b] = min(max(s, _SMIN), _SMAX)
        for b in range(nb):                                   # float32 -> E4M3: round 20 mantissa bits away
            w = np.int64(bits[b])
            bits[b] = np.uint32((w + 0x7FFFF + ((w >> 20) & 1)) & 0xFFF00000)
        for b in range(nb):
            s8 = bs[b]
            recip = inv_ts / s8 if two_level else _F1 / s8
            hp = s8 * ts if two_level else s8
            for i in range(r0, r0 + rows):
                for j in range(b * 16, b * 16 + 16):
                    v = min(max(x[i, j] * recip, _FN6), _F6)
                    out[i, j] = _e2m1_scalar(v) * hp
    return amax


def _kernel():
    """The compiled CPU kernel (numba; compiled on first use and cached on disk)."""
    return _quantize_kernel


def nvfp4_fake_quantize(x: Tensor, *, block_size: int = 16, two_level: bool = True,
                        block_shape: str = "1x16", backend: str = "torchao") -> Tensor:
    """Round ``x`` onto the NVFP4 grid and return the dequantized values (docs/metrics.md#nvfp4).

    Args:
        x: ``(..., K)`` float tensor (float32, bfloat16 or float16); blocks run
            along the last (reduction) dimension, ``K % 16 == 0``.  For
            ``block_shape="16x16"`` also ``x.shape[-2] % 16 == 0`` (a weight
            ``(out, in)``); tiles are 16 rows × 16 columns.
        block_size: elements per block; NVFP4 fixes it at 16.
        two_level: add the FP32 per-tensor scale ``amax(|x|) / (6 · 448)``;
            ``False`` stores ``block_amax / 6`` directly in E4M3.
        block_shape: ``"1x16"`` (inference engines, activations) or ``"16x16"``
            (weight tiles of training recipes).
        backend: ``"torchao"`` (1x16 through torchao's ``NVFP4Tensor``, the
            reference) or ``"native"`` (the same arithmetic here: one compiled
            pass on the CPU, vectorised torch ops without a host
            synchronisation elsewhere; bit-identical, see the tests).  16x16
            tiles always use the native code (torchao has none).

    Returns:
        Tensor of ``x``'s shape and dtype, on ``x``'s device; every value is
        ``e * s_block * s_tensor`` with ``e`` in ±E2M1 (round to nearest, ties
        to even; magnitudes above 6 saturate), ``s_block`` an E4M3 number in
        [2⁻⁶, 448] and ``s_tensor`` the per-tensor scale (1 when single-level).
        Not differentiable (use :func:`fake_quantize_ste`).  An all-zero input
        returns zeros; non-finite inputs give non-finite outputs.

    Raises:
        ValueError: ``block_size != 16``, unknown ``block_shape`` or ``backend``, a non-float
            dtype, or a dimension not divisible by 16 (the message names it).
    """
    if block_size != 16:
        raise ValueError(f"nvfp4_fake_quantize: block_size must be 16 for NVFP4, got {block_size}")
    if block_shape not in BLOCK_SHAPES:
        raise ValueError(f"nvfp4_fake_quantize: block_shape must be one of {BLOCK_SHAPES}, got {block_shape!r}")
    if backend not in BACKENDS:
        raise ValueError(f"nvfp4_fake_quantize: backend must be one of {BACKENDS}, got {backend!r}")
    if not x.is_floating_point():
        raise ValueError(f"nvfp4_fake_quantize: x must be a float tensor, got dtype {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % 16:
        raise ValueError(f"nvfp4_fake_quantize: last dim of x (shape {tuple(x.shape)}) must be a multiple of 16")
    if block_shape == "16x16" and (x.dim() < 2 or x.shape[-2] % 16):
        raise ValueError(f"nvfp4_fake_quantize: block_shape='16x16' needs dim -2 of x (shape {tuple(x.shape)}) "
                         f"to be a multiple of 16")
    with torch.no_grad():
        xf = x.detach().float()
        rows = 16 if block_shape == "16x16" else 1
        if block_shape == "1x16" and backend == "torchao":
            amax = xf.abs().amax()
            if not bool(amax > 0):
                return torch.zeros_like(x) if bool(amax == 0) else x.detach() * float("nan")
            nvfp4_tensor = _torchao()
            flat = xf.reshape(-1, x.shape[-1]).contiguous()
            scale = nvfp4_tensor.per_tensor_amax_to_scale(amax) if two_level else None
            q = nvfp4_tensor.NVFP4Tensor.to_nvfp4(flat, block_size=16, per_tensor_scale=scale)
            return q.dequantize(torch.float32).reshape(x.shape).to(x.dtype)
        if xf.device.type == "cpu":
            flat = xf.reshape(-1, x.shape[-1]).contiguous()
            out = torch.empty_like(flat)
            amax = _kernel()(flat.numpy(), rows, two_level, out.numpy())
            if not 0 < amax < math.inf:   # all zero: zeros; NaN/inf somewhere: NaN everywhere
                return torch.zeros_like(x) if amax == 0 else torch.full_like(x, float("nan"))
            return out.reshape(x.shape).to(x.dtype)
        flat = xf.reshape(-1, x.shape[-1])   # 2-D: one compiled graph whatever the input's rank
        return _device_quantizer(xf.device)(flat, rows, two_level).reshape(x.shape).to(x.dtype)


def _native_torch(xf: Tensor, rows: int, two_level: bool) -> Tensor:
    """The native arithmetic in vectorised torch ops, without a host synchronisation (any device).

    ``xf``: float32 ``(..., R, K)`` (``R`` only read for 16-row tiles).  Same values as
    :func:`_quantize_kernel`; an all-zero input gives zeros, a non-finite one NaN everywhere.
    """
    K = xf.shape[-1]
    R = xf.shape[-2] if xf.dim() > 1 else 1
    a = xf.abs()
    amax = a.amax()
    tiles = a.reshape(-1, R // rows, rows, K // 16, 16)
    block_scale = tiles.amax(dim=(-3, -1), keepdim=True) / E2M1_MAX
    if two_level:
        tensor_scale = amax / (E2M1_MAX * E4M3_MAX)  # torchao's per_tensor_amax_to_scale
        block_scale = block_scale / tensor_scale
    s8 = block_scale.clamp(E4M3_MIN_SCALE, E4M3_MAX).to(torch.float8_e4m3fn).float()
    recip = (1.0 / tensor_scale) / s8 if two_level else 1.0 / s8
    elems = _round_e2m1((xf.reshape(tiles.shape) * recip).clamp(-E2M1_MAX, E2M1_MAX))
    out = torch.where(amax == 0, 0.0, elems * (s8 * tensor_scale if two_level else s8))
    return torch.where(torch.isfinite(amax), out, float("nan"))


_DEVICE_QUANTIZERS: dict = {}
#: device type -> one line: which quantizer runs there and why (:func:`quantizer_status`)
_QUANTIZER_STATUS: dict = {}
_WARNED: set = set()
_log = logging.getLogger("triage_monitor.nvfp4")  # its name before the move to demo/: log lines unchanged

#: Tolerance of the compiled device quantizer against the eager torch ops, checked at the first use of each
#: (rows, two_level) on a fixed set of random inputs (:func:`_compare_to_eager`): at most this fraction of the values
#: may differ ...
COMPILED_MAX_DIFF_FRACTION = 1e-3
#: ... and each differing value by at most this fraction of its block's amax(|x|) (plus two floor scales, for blocks
#: whose E4M3 scale is clamped at 2⁻⁶).  One E2M1 step is at most 2 × scale ≈ amax/3 (between 4 and 6), so this
#: admits a value rounded to the neighbouring grid point or a block scale one E4M3 step off (what an approximate
#: float32 division, e.g. Triton's, does to a value within an ulp of a rounding boundary), and nothing larger.
COMPILED_MAX_DIFF_OF_BLOCK_AMAX = 0.4


def _check_inputs(device, rows: int) -> list[Tensor]:
    """The fixed random inputs ``(R, K)`` float32 of the compiled quantizer's check (heavy-tailed: many block
    scales, some clamped at the E4M3 floor; one all-zero block row)."""
    g = torch.Generator(device=device).manual_seed(0)
    shapes = ((8, 64), (24, 256), (64, 64), (5, 32)) if rows == 1 else ((48, 32), (64, 64))
    out = []
    for shape in shapes:
        x = torch.randn(*shape, generator=g, device=device) * torch.rand(*shape, generator=g, device=device) ** 4
        x[0, :16] = 0.0
        out.append(x)
    return out


class EagerComparison(NamedTuple):
    """:func:`_compare_to_eager`: how many values differ, the worst difference (of its block's amax), all within?"""

    n_diff: int
    worst: float
    within: bool


def _compare_to_eager(got: Tensor, want: Tensor, x: Tensor, rows: int, two_level: bool) -> EagerComparison:
    """How far ``got`` (the compiled quantizer's output) is from ``want`` (the eager ops'), both float32 of ``x``'s
    ``(R, K)`` elements.

    Returns:
        :class:`EagerComparison` ``(n_diff, worst, within)``: the number of values whose bits differ, the largest
        difference as a fraction of its block's amax(|x|) (0 when none differs, NaN when a NaN differs), and whether
        every differing value lies within :data:`COMPILED_MAX_DIFF_OF_BLOCK_AMAX` of its block's amax (+ two floor
        scales).
    """
    got, want = got.reshape(x.shape), want.reshape(x.shape)       # _native_torch returns the tiled view
    differ = got.view(torch.int32) != want.view(torch.int32)
    n = int(differ.sum())
    if n == 0:
        return EagerComparison(0, 0.0, True)
    R, K = x.shape
    a = x.abs()
    blocks = a.reshape(R // rows, rows, K // 16, 16).amax(dim=(1, 3), keepdim=True)
    blocks = blocks.expand(R // rows, rows, K // 16, 16).reshape(R, K)
    floor = E4M3_MIN_SCALE * (float(a.amax()) / (E2M1_MAX * E4M3_MAX) if two_level else 1.0)
    d = (got - want).abs()[differ]
    bound = COMPILED_MAX_DIFF_OF_BLOCK_AMAX * blocks[differ] + 2 * floor
    worst = float((d / blocks[differ].clamp_min(torch.finfo(torch.float32).tiny)).max())
    return EagerComparison(n, worst, bool((d <= bound).all()))


def _check_compiled(compiled, device, rows: int, two_level: bool) -> str:
    """Run ``compiled`` and the eager ops on :func:`_check_inputs`; return how they compare (one phrase).

    Raises:
        ValueError: outside the tolerance (:data:`COMPILED_MAX_DIFF_FRACTION`, :data:`COMPILED_MAX_DIFF_OF_BLOCK_AMAX`),
            the message giving the counts.
    """
    n_diff = total = 0
    worst = 0.0
    within = True
    for x in _check_inputs(device, rows):
        n, w, ok = _compare_to_eager(compiled(x, rows, two_level), _native_torch(x, rows, two_level), x, rows,
                                     two_level)
        n_diff, total, within = n_diff + n, total + x.numel(), within and ok
        worst = w if (w != w or w > worst) else worst
    key = f"rows={rows}, two_level={two_level}"
    if not within or n_diff > COMPILED_MAX_DIFF_FRACTION * total:
        raise ValueError(f"compiled NVFP4 quantizer outside the tolerance ({key}): {n_diff} of {total} values "
                         f"differ from the eager ops, the largest by {worst:.3g} of its block's amax (allowed: "
                         f"{COMPILED_MAX_DIFF_FRACTION:g} of the values, each within "
                         f"{COMPILED_MAX_DIFF_OF_BLOCK_AMAX:g} of its block's amax)")
    if n_diff == 0:
        return f"bit-identical to the eager ops ({key}, {total} values)"
    return (f"within tolerance ({key}): {n_diff} of {total} values differ from the eager ops, the largest by "
            f"{worst:.3g} of its block's amax")


def _fall_back(kind: str, why) -> None:
    """Use the eager ops on ``kind`` from now on, saying why once per process."""
    _DEVICE_QUANTIZERS[kind] = _native_torch
    _QUANTIZER_STATUS[kind] = f"eager torch ops: {why}"
    if kind not in _WARNED:
        _WARNED.add(kind)
        _log.warning("NVFP4 on %s: using the eager torch ops (%s)", kind, why)


def _one_compile_worker() -> None:
    """Let inductor compile in this process, with no pool of worker processes (several demo processes compiling at
    once would each start one), unless ``TORCHINDUCTOR_COMPILE_THREADS`` in the environment says otherwise."""
    import os

    if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"):
        return
    try:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
    except Exception:   # pragma: no cover - an inductor without the setting: its default
        pass


def _device_quantizer(device, compile_fn=None):
    """The function ``(xf, rows, two_level) -> Tensor`` that runs :func:`_native_torch` on ``device`` (cached per
    device type).

    On CUDA the ~20 small ops of :func:`_native_torch` are compiled into a few fused kernels with
    ``torch.compile`` (a decode step of a small model calls the quantizer for every linear: on a GPU the cost is one
    kernel launch per op), with one compile worker (:func:`_one_compile_worker`).  The compiled function is used
    only while it stays within the tolerance of the eager ops (:data:`COMPILED_MAX_DIFF_FRACTION`,
    :data:`COMPILED_MAX_DIFF_OF_BLOCK_AMAX`; bit-identical in the usual case), checked on fixed random inputs
    for ``rows=1, two_level=True`` (the ``nvfp4`` recipe) when it is built and for any other (rows, two_level) at
    its first use.  If compiling or a check fails, or a later call raises, the eager ops are used from then on,
    with one warning saying why (:func:`quantizer_status` keeps the line).  ``TRIAGE_NVFP4_COMPILE=0`` in the
    environment keeps the eager ops.  Other devices use the eager ops.  ``compile_fn`` (tests): the compiler to
    use instead of ``torch.compile``, and compile on any device.
    """
    import os

    kind = torch.device(device).type
    if kind in _DEVICE_QUANTIZERS:
        return _DEVICE_QUANTIZERS[kind]
    _DEVICE_QUANTIZERS[kind] = _native_torch
    _QUANTIZER_STATUS[kind] = "eager torch ops (no compiled path on this device type)"
    if kind == "cuda" or compile_fn is not None:
        if os.environ.get("TRIAGE_NVFP4_COMPILE", "1") == "0":
            _QUANTIZER_STATUS[kind] = "eager torch ops: TRIAGE_NVFP4_COMPILE=0"
            return _native_torch
        try:
            _e2m1_tables(torch.empty(0, device=device).device)   # built before tracing: the trace only reads them
            if compile_fn is None:
                _one_compile_worker()
                compiled = torch.compile(_native_torch, dynamic=True)
            else:
                compiled = compile_fn(_native_torch)
            guarded = _Guarded(compiled, kind, device)
            first = _check_compiled(compiled, device, 1, True)
            guarded.checked[(1, True)] = first
            _DEVICE_QUANTIZERS[kind] = guarded
            _QUANTIZER_STATUS[kind] = f"compiled (torch.compile): {first}"
        except Exception as exc:   # no compiler, or outside the tolerance: the eager ops (same numerics, more launches)
            _fall_back(kind, exc)
    return _DEVICE_QUANTIZERS[kind]


class _Guarded:
    """A compiled quantizer used while it holds: each new (rows, two_level) is checked at its first use
    (:func:`_check_compiled`); a failed check or a call that raises sends ``kind`` to the eager ops for good."""

    def __init__(self, compiled, kind: str, device):
        self.compiled, self.kind, self.device = compiled, kind, device
        self.checked: dict = {}

    def __call__(self, xf: Tensor, rows: int, two_level: bool) -> Tensor:
        if _DEVICE_QUANTIZERS.get(self.kind) is not self:      # fell back earlier (a copy of this object kept)
            return _native_torch(xf, rows, two_level)
        try:
            key = (rows, bool(two_level))
            if key not in self.checked:
                self.checked[key] = _check_compiled(self.compiled, self.device, rows, two_level)
                _QUANTIZER_STATUS[self.kind] += f"; {self.checked[key]}"
            return self.compiled(xf, rows, two_level)
        except Exception as exc:   # e.g. a recompilation that fails, or a new key outside the tolerance
            _fall_back(self.kind, f"the compiled quantizer failed: {exc}")
            return _native_torch(xf, rows, two_level)


def quantizer_status(device) -> str:
    """One line: which NVFP4 quantizer the native backend runs on ``device`` and why.

    On the CPU: the compiled numba kernel.  Elsewhere this builds the device's quantizer (on CUDA it compiles and
    checks it against the eager ops: seconds the first time) and returns its status: ``compiled (torch.compile):
    bit-identical ...``, ``... within tolerance ...: N of M values differ ...`` or ``eager torch ops: <why>``.

    Args:
        device: a torch device or its name (``"cuda"``, ``"cuda:0"``, ``"cpu"``).
    """
    kind = torch.device(device).type
    if kind == "cpu":
        return "numba kernel (one compiled pass on the CPU; bit-identical to the eager ops)"
    _device_quantizer(device)
    return _QUANTIZER_STATUS[kind]


def fake_quantize_ste(x: Tensor, **kwargs) -> Tensor:
    """:func:`nvfp4_fake_quantize` with a straight-through estimator.

    Forward: the NVFP4 values; backward: the identity (∂out/∂x = 1), the
    standard estimator for training through a rounding function.  Same shape,
    dtype and keyword arguments as :func:`nvfp4_fake_quantize`.  Without a
    gradient to pass (``torch.no_grad`` or an ``x`` that does not require
    one, e.g. the sampler path) it returns :func:`nvfp4_fake_quantize` itself
    (two ops fewer, and exactly the grid values).
    """
    if not (torch.is_grad_enabled() and x.requires_grad):   # nothing to pass a gradient to: the exact values
        return nvfp4_fake_quantize(x, **kwargs)
    return x + (nvfp4_fake_quantize(x, **kwargs) - x).detach()


@dataclass(frozen=True)
class NVFP4Recipe:
    """The numeric recipe of one computation path's quantized linears (W4A4).

    Attributes:
        name: label written to run manifests.
        weight_block: ``"1x16"`` or ``"16x16"`` weight scale blocks.
        weight_two_level, act_two_level: use the FP32 per-tensor scale
            (per weight tensor; per activation tensor of each call).
        quantize_activations: ``False`` gives weight-only W4A16-style emulation.
        backend: ``"torchao"`` or ``"native"`` (see :func:`nvfp4_fake_quantize`).
    """

    name: str
    weight_block: str = "1x16"
    weight_two_level: bool = True
    act_two_level: bool = True
    quantize_activations: bool = True
    backend: str = "torchao"

    def __post_init__(self):
        if self.weight_block not in BLOCK_SHAPES:
            raise ValueError(f"NVFP4Recipe.weight_block must be one of {BLOCK_SHAPES}, got {self.weight_block!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"NVFP4Recipe.backend must be one of {BACKENDS}, got {self.backend!r}")


#: Named recipes.  ``None`` means full precision (no quantization).
RECIPES: dict[str, Optional[NVFP4Recipe]] = {
    "fp32": None,
    # inference-engine style: 1x16 blocks everywhere, two-level scaling (docs/metrics.md#nvfp4), through torchao
    "nvfp4": NVFP4Recipe("nvfp4"),
    # training style: 16x16 weight tiles, single-level E4M3 scales for weights and activations
    "nvfp4_16x16": NVFP4Recipe("nvfp4_16x16", weight_block="16x16", weight_two_level=False, act_two_level=False,
                               backend="native"),
}


def get_recipe(name: str) -> Optional[NVFP4Recipe]:
    """Look up a recipe in :data:`RECIPES` by name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in RECIPES:
        raise ValueError(f"unknown numeric recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name]


class NVFP4Linear(nn.Linear):
    """``nn.Linear`` whose weight and input are NVFP4 fake-quantized (W4A4) when a recipe is set.

    Input ``(..., in_features)``, output ``(..., out_features)``, both in the
    module's dtype; ``in_features % 16 == 0`` (and ``out_features % 16 == 0``
    for 16x16 weight tiles).  The weight is quantized per tensor, the
    activation per call (its per-tensor amax is that call's, so the numerics
    depend on the batch, as in a real engine).  Gradients pass straight through
    both quantizers.  Under ``torch.no_grad`` the quantized weight is cached
    until the weight changes (tracked by its in-place version counter).

    Attributes:
        recipe: the active :class:`NVFP4Recipe`, or ``None`` for full precision.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Optional[NVFP4Recipe] = None, **factory):
        super().__init__(in_features, out_features, bias=bias, **factory)
        self.recipe = recipe
        #: (weight version, data pointer, recipe) and the quantized weight of that key
        self._wcache: Optional[tuple[tuple[int, int, NVFP4Recipe], Tensor]] = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[NVFP4Recipe] = None) -> "NVFP4Linear":
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe, new._wcache = recipe, None
        return new

    def _quantized_weight(self, r: NVFP4Recipe) -> Tensor:
        """The weight quantized under ``r`` (this layer's :attr:`recipe`), cached under ``torch.no_grad``."""
        kw: dict[str, Any] = dict(block_shape=r.weight_block, two_level=r.weight_two_level, backend=r.backend)
        if torch.is_grad_enabled():
            return fake_quantize_ste(self.weight, **kw)
        key = (self.weight._version, self.weight.data_ptr(), r)
        if self._wcache is None or self._wcache[0] != key:
            self._wcache = (key, nvfp4_fake_quantize(self.weight, **kw))
        return self._wcache[1]

    def forward(self, x: Tensor) -> Tensor:
        if self.recipe is None:
            return F.linear(x, self.weight, self.bias)
        if self.recipe.quantize_activations:
            x = fake_quantize_ste(x, two_level=self.recipe.act_two_level, backend=self.recipe.backend)
        return F.linear(x, self._quantized_weight(self.recipe), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name if self.recipe else 'fp32'}"


@torch.no_grad()
def prepare_quantized_weights(model: nn.Module) -> int:
    """Quantize, now, the weights of every :class:`NVFP4Linear` of ``model`` that has a recipe (its scales and
    4-bit values, cached until the weight changes), so that the generation after it reuses them: what an inference
    engine does when it receives new weights.  Separates this conversion's cost from the generation's
    (docs/metrics.md#step-time-and-the-full-cycle); the values are the same as when computed on first use.

    Returns:
        The number of layers quantized (0 under full precision).
    """
    n = 0
    for m in model.modules():
        if isinstance(m, NVFP4Linear) and m.recipe is not None:
            m._quantized_weight(m.recipe)
            n += 1
    return n


def quantize_linears_(model: nn.Module, patterns: Sequence[str] = ("*mlp*",),
                      recipe: Optional[NVFP4Recipe] = None) -> list[str]:
    """Swap, in place, each ``nn.Linear`` whose qualified name matches a glob in ``patterns`` for an NVFP4Linear.

    The default pattern picks the MLP projections, the layers the published
    native-NVFP4 runs quantized (docs/metrics.md#nvfp4); attention, norms, embeddings and
    the LM head stay in full precision.  Parameters are shared, so optimizers
    and state dicts are unaffected.

    Returns:
        The qualified names of the swapped modules, in module order.

    Raises:
        ValueError: no module matched, or a matched linear's ``in_features``
            is not a multiple of 16.
    """
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and not isinstance(mod, NVFP4Linear)
               and any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    if not targets:
        raise ValueError(f"quantize_linears_: no nn.Linear matches {list(patterns)}")
    for name, mod in targets:
        if mod.in_features % 16:
            raise ValueError(f"quantize_linears_: {name}.in_features = {mod.in_features} is not a multiple of 16")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, NVFP4Linear.from_linear(mod, recipe))
    return [name for name, _ in targets]


@contextlib.contextmanager
def use_recipe(model: nn.Module, recipe: Optional[NVFP4Recipe]) -> Iterator[nn.Module]:
    """Run ``model``'s :class:`NVFP4Linear` layers under ``recipe`` inside the block (``None`` = full precision).

    The previous recipes are restored on exit, also after an exception.
    """
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    saved = [m.recipe for m in layers]
    try:
        for m in layers:
            m.recipe = recipe
        yield model
    finally:
        for m, r in zip(layers, saved):
            m.recipe = r
