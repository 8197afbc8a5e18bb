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
backend runs the same arithmetic in a few vectorised torch ops (an order of
magnitude faster on CPU) and is the only one for 16x16 tiles; the tests check it bit for
bit against torchao and against a hand implementation.

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
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
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

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; scaling by
    the spacing and ``torch.round`` (half to even) gives round-to-nearest-even
    on the code, because the even codes {0, 1, 2, 4} land on even multiples.
    """
    a = v.abs()
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(q, v)


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
            reference) or ``"native"`` (the same arithmetic in a few vectorised
            torch ops here, an order of magnitude faster on CPU; bit-identical,
            see the tests).  16x16 tiles always use the native code (torchao has none).

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
        amax = xf.abs().amax()
        if not bool(amax > 0):
            return torch.zeros_like(x) if bool(amax == 0) else x.detach() * float("nan")
        if two_level:
            tensor_scale = amax / (E2M1_MAX * E4M3_MAX)  # torchao's per_tensor_amax_to_scale
        if block_shape == "1x16" and backend == "torchao":
            nvfp4_tensor = _torchao()
            flat = xf.reshape(-1, x.shape[-1]).contiguous()
            scale = nvfp4_tensor.per_tensor_amax_to_scale(amax) if two_level else None
            q = nvfp4_tensor.NVFP4Tensor.to_nvfp4(flat, block_size=16, per_tensor_scale=scale)
            return q.dequantize(torch.float32).reshape(x.shape).to(x.dtype)
        # native: tiles (..., R/rows, rows, K/16, 16), the arithmetic of torchao's nvfp4_quantize
        rows = 16 if block_shape == "16x16" else 1
        K = x.shape[-1]
        R = x.shape[-2] if x.dim() > 1 else 1
        tiles = xf.reshape(-1, R // rows, rows, K // 16, 16)
        block_scale = tiles.abs().amax(dim=(-3, -1), keepdim=True) / E2M1_MAX
        if two_level:
            block_scale = block_scale / tensor_scale
        s8 = block_scale.clamp(E4M3_MIN_SCALE, E4M3_MAX).to(torch.float8_e4m3fn).float()
        recip = (1.0 / tensor_scale) / s8 if two_level else 1.0 / s8
        elems = _round_e2m1((tiles * recip).clamp(-E2M1_MAX, E2M1_MAX))
        hp_scale = s8 * tensor_scale if two_level else s8
        return (elems * hp_scale).reshape(x.shape).to(x.dtype)


def fake_quantize_ste(x: Tensor, **kwargs) -> Tensor:
    """:func:`nvfp4_fake_quantize` with a straight-through estimator.

    Forward: the NVFP4 values; backward: the identity (∂out/∂x = 1), the
    standard estimator for training through a rounding function.  Same shape,
    dtype and keyword arguments as :func:`nvfp4_fake_quantize`.
    """
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
        self._wcache: Optional[tuple] = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[NVFP4Recipe] = None) -> "NVFP4Linear":
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe, new._wcache = recipe, None
        return new

    def _quantized_weight(self) -> Tensor:
        r = self.recipe
        kw = dict(block_shape=r.weight_block, two_level=r.weight_two_level, backend=r.backend)
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
        return F.linear(x, self._quantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name if self.recipe else 'fp32'}"


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
