"""NVFP4 emulation: grid membership, bit-exactness against a hand implementation, idempotence, STE."""

import math

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from triage_monitor.demo.nvfp4 import (RECIPES, NVFP4Linear, NVFP4Recipe, fake_quantize_ste, get_recipe,  # noqa: E402
                                  nvfp4_fake_quantize, prepare_quantized_weights, quantize_linears_, use_recipe)

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes; list index = 3-bit code, even code = even mantissa
f32 = np.float32


# ------------------------------------------------------------ hand implementation (scalar, numpy float32)
def e2m1_rne(v: float) -> float:
    """Nearest E2M1 magnitude, ties to the even code (docs/metrics.md#nvfp4), sign kept; |v| > 6 saturates."""
    a = min(abs(v), 6.0)
    dists = [abs(a - g) for g in GRID]
    best = min(dists)
    codes = [i for i, d in enumerate(dists) if d == best]
    code = codes[0] if len(codes) == 1 else [c for c in codes if c % 2 == 0][0]
    return math.copysign(GRID[code], v)


def e4m3_rne(v: float) -> float:
    """FP8 E4M3 (3 mantissa bits) round to nearest even, for v in [2^-6, 448] (normal range)."""
    e = math.floor(math.log2(v))
    quantum = 2.0 ** (e - 3)
    return round(v / quantum) * quantum  # Python round(): half to even


def hand_quantize(x: np.ndarray, two_level: bool, tile_rows: int) -> np.ndarray:
    """NVFP4 fake quantization, element by element, float32 arithmetic as the format specifies.

    Blocks: ``tile_rows`` × 16 (1 for 1x16, 16 for 16x16 tiles) along the last dim.
    """
    x = x.astype(f32)
    out = np.zeros_like(x)
    amax = f32(np.abs(x).max())
    pts = f32(amax / f32(6.0 * 448.0)) if two_level else None
    R, K = x.shape
    for r0 in range(0, R, tile_rows):
        for c0 in range(0, K, 16):
            blk = x[r0:r0 + tile_rows, c0:c0 + 16]
            bs = f32(f32(np.abs(blk).max()) / f32(6.0))
            if two_level:
                bs = f32(bs / pts)
            s8 = f32(e4m3_rne(min(max(float(bs), 2.0 ** -6), 448.0)))
            recip = f32(f32(f32(1.0) / pts) / s8) if two_level else f32(f32(1.0) / s8)
            hp = f32(s8 * pts) if two_level else s8
            for i in range(blk.shape[0]):
                for j in range(16):
                    v = float(min(max(f32(blk[i, j] * recip), f32(-6.0)), f32(6.0)))
                    out[r0 + i, c0 + j] = f32(f32(e2m1_rne(v)) * hp)
    return out


def _inputs():
    g = torch.Generator().manual_seed(0)
    heavy = torch.randn(32, 32, generator=g) * torch.logspace(-3, 1, 32).unsqueeze(0)  # blocks of very different scale
    return {"randn": torch.randn(32, 32, generator=g), "weights": torch.randn(32, 32, generator=g) * 0.02,
            "heavy": heavy, "outlier": torch.cat([torch.randn(16, 32, generator=g),
                                                  torch.randn(16, 32, generator=g) * 300.0])}


# ------------------------------------------------------------ tests
def test_hand_rounding_helpers():
    # ties go to the even code: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4
    assert [e2m1_rne(v) for v in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 7.0)] == \
        [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0]
    assert [e4m3_rne(v) for v in (1.0, 1.0625, 1.1875, 448.0, 2.0 ** -6, 300.0)] == \
        [1.0, 1.0, 1.25, 448.0, 2.0 ** -6, 288.0]


@pytest.mark.parametrize("block_shape", ["1x16", "16x16"])
def test_single_level_ties_by_hand(block_shape):
    # block amax 6 → block scale 6/6 = 1 (exact in E4M3), so elements are rounded as given
    row = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 0.1, 5.9, 4.9, 0.74, 0.0, -6.0])
    want = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, 0.0, 6.0, 4.0, 0.5, 0.0, -6.0])
    x = row.roll(3).repeat(16, 2)  # (16, 32): every row and tile holds the same values
    got = nvfp4_fake_quantize(x, two_level=False, block_shape=block_shape)
    assert torch.equal(got, want.roll(3).repeat(16, 2))
    # scale 2 (amax 12): every value doubles
    assert torch.equal(nvfp4_fake_quantize(2 * x, two_level=False, block_shape=block_shape), 2 * got)


@pytest.mark.parametrize("name", ["randn", "weights", "heavy", "outlier"])
@pytest.mark.parametrize("two_level", [True, False])
@pytest.mark.parametrize("block_shape,backend", [("1x16", "torchao"), ("1x16", "native"), ("16x16", "native")])
def test_bit_exact_against_hand_implementation(name, two_level, block_shape, backend):
    x = _inputs()[name]
    got = nvfp4_fake_quantize(x, two_level=two_level, block_shape=block_shape, backend=backend)
    want = hand_quantize(x.numpy(), two_level, 1 if block_shape == "1x16" else 16)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("two_level", [True, False])
def test_values_lie_on_grid_times_block_scale(two_level):
    x = _inputs()["heavy"]
    q = nvfp4_fake_quantize(x, two_level=two_level)
    blocks_x, blocks_q = x.reshape(-1, 16), q.reshape(-1, 16)
    pts = x.abs().max() / 2688.0 if two_level else torch.tensor(1.0)
    bs = (blocks_x.abs().amax(1, keepdim=True) / 6.0) / pts
    s8 = bs.clamp(2.0 ** -6, 448.0).to(torch.float8_e4m3fn).float()
    codes = blocks_q / (s8 * pts)
    grid = torch.tensor(GRID)
    assert torch.allclose(codes.abs().unsqueeze(-1).sub(grid).abs().min(-1).values, torch.zeros(()), atol=1e-5)
    assert (codes.abs() <= 6 + 1e-5).all()
    # and the error is bounded by half the largest grid step (1.0) times the scale
    assert ((blocks_q - blocks_x).abs() <= (s8 * pts) * 1.0 + 1e-6).all()


@pytest.mark.parametrize("two_level", [True, False])
def test_native_backend_matches_torchao(two_level):
    g = torch.Generator().manual_seed(7)
    for shape in [(48,), (3, 7, 32), (256, 64)]:
        x = torch.randn(*shape, generator=g) * torch.rand(*shape, generator=g) ** 4 * 50
        assert torch.equal(nvfp4_fake_quantize(x, two_level=two_level, backend="native"),
                           nvfp4_fake_quantize(x, two_level=two_level, backend="torchao"))


def test_16x16_agrees_with_torchao_1x16_when_tiles_share_row_amax():
    # every row of each 16x16 tile holds the tile's amax, so 1x16 and 16x16 scales coincide:
    # our tile path must then equal torchao's NVFP4Tensor round trip bit for bit
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 48, generator=g)
    x[:, ::16] = 0.0
    tile_amax = x.abs().reshape(2, 16, 3, 16).amax(dim=(1, 3)) * 1.5
    x[:, ::16] = tile_amax.repeat_interleave(16, 0) * torch.sign(torch.randn(32, 3, generator=g))
    for two_level in (True, False):
        assert torch.equal(nvfp4_fake_quantize(x, block_shape="16x16", two_level=two_level),
                           nvfp4_fake_quantize(x, block_shape="1x16", two_level=two_level))


@pytest.mark.parametrize("block_shape", ["1x16", "16x16"])
def test_idempotent(block_shape):
    for x in _inputs().values():
        q1 = nvfp4_fake_quantize(x, two_level=False, block_shape=block_shape)
        assert torch.equal(nvfp4_fake_quantize(q1, two_level=False, block_shape=block_shape), q1)
        # two-level: the per-tensor scale is recomputed from amax(q1), which can move by an ulp
        q1 = nvfp4_fake_quantize(x, two_level=True, block_shape=block_shape)
        q2 = nvfp4_fake_quantize(q1, two_level=True, block_shape=block_shape)
        assert torch.allclose(q2, q1, rtol=1e-6, atol=0)


def test_shapes_dtypes_and_special_inputs():
    x = torch.randn(2, 3, 32)
    q = nvfp4_fake_quantize(x)
    assert q.shape == x.shape and torch.equal(q.reshape(6, 32), nvfp4_fake_quantize(x.reshape(6, 32)))
    xb = x.to(torch.bfloat16)
    assert nvfp4_fake_quantize(xb).dtype == torch.bfloat16
    assert torch.equal(nvfp4_fake_quantize(torch.zeros(4, 16)), torch.zeros(4, 16))
    assert nvfp4_fake_quantize(torch.full((1, 16), float("nan"))).isnan().all()
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_fake_quantize(torch.randn(4, 20))
    with pytest.raises(ValueError, match="dim -2"):
        nvfp4_fake_quantize(torch.randn(20, 16), block_shape="16x16")
    with pytest.raises(ValueError, match="block_size must be 16"):
        nvfp4_fake_quantize(torch.randn(4, 32), block_size=32)
    with pytest.raises(ValueError, match="block_shape"):
        nvfp4_fake_quantize(torch.randn(4, 32), block_shape="2x16")
    with pytest.raises(ValueError, match="backend"):
        nvfp4_fake_quantize(torch.randn(4, 32), backend="cuda")
    with pytest.raises(ValueError, match="float"):
        nvfp4_fake_quantize(torch.ones(4, 16, dtype=torch.int64))


def test_ste_gradient_is_identity():
    x = (torch.randn(4, 32) * 3).requires_grad_()
    y = fake_quantize_ste(x)
    assert torch.equal(y.detach(), nvfp4_fake_quantize(x))
    w = torch.randn(4, 32)
    (y * w).sum().backward()
    assert torch.equal(x.grad, w)


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4_16x16"])
def test_nvfp4_linear_forward_and_backward(recipe):
    r = get_recipe(recipe)
    torch.manual_seed(0)
    lin = NVFP4Linear(32, 16, recipe=r)
    x = torch.randn(3, 5, 32, requires_grad=True)
    out = lin(x)
    # reference: a plain linear on the quantized tensors, with the quantized tensors as leaves
    qx = nvfp4_fake_quantize(x.detach(), two_level=r.act_two_level, backend="torchao").requires_grad_()
    qw = nvfp4_fake_quantize(lin.weight.detach(), two_level=r.weight_two_level,
                             block_shape=r.weight_block, backend="native").requires_grad_()
    ref = nn.functional.linear(qx, qw, lin.bias.detach())
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, qx.grad) and torch.equal(lin.weight.grad, qw.grad)
    # the quantized layer really differs from full precision, and recipe=None is full precision
    with use_recipe(lin, None):
        full = lin(x.detach())
    assert torch.equal(full, nn.functional.linear(x.detach(), lin.weight, lin.bias))
    assert not torch.equal(full, out.detach())


def test_weight_cache_follows_in_place_updates():
    lin = NVFP4Linear(16, 16, recipe=get_recipe("nvfp4"))
    x = torch.randn(2, 16)
    with torch.no_grad():
        a = lin(x)
        lin.weight.mul_(2.0)
        b = lin(x)
    assert not torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(b, nn.functional.linear(nvfp4_fake_quantize(x), nvfp4_fake_quantize(lin.weight), lin.bias))


def test_prepared_weights_are_the_ones_the_forward_uses():
    """prepare_quantized_weights quantizes each layer with a recipe once (the demo times it as the sampler's weight
    conversion); the forward then reuses exactly those values, and a full-precision layer has nothing to prepare."""
    model = nn.Sequential(NVFP4Linear(16, 32), NVFP4Linear(32, 16))
    x = torch.randn(3, 16)
    with torch.no_grad():
        plain = model(x)
    assert prepare_quantized_weights(model) == 0                        # no recipe: full precision
    with use_recipe(model, get_recipe("nvfp4")):
        assert prepare_quantized_weights(model) == 2
        cached = [m._wcache[1] for m in model]
        assert torch.equal(cached[0], nvfp4_fake_quantize(model[0].weight))
        with torch.no_grad():
            out = model(x)
        assert all(m._wcache[1] is c for m, c in zip(model, cached))    # reused, not recomputed
    fresh = nn.Sequential(NVFP4Linear(16, 32), NVFP4Linear(32, 16))
    fresh.load_state_dict(model.state_dict())
    with use_recipe(fresh, get_recipe("nvfp4")), torch.no_grad():
        assert torch.equal(fresh(x), out) and not torch.equal(out, plain)


def test_quantize_linears_swaps_only_matching_and_shares_parameters():
    model = nn.Sequential()
    model.add_module("attn", nn.Linear(32, 32))
    mlp = nn.Sequential()
    mlp.add_module("fc", nn.Linear(32, 64))
    mlp.add_module("proj", nn.Linear(64, 32))
    model.add_module("mlp", mlp)
    w_fc = model.mlp.fc.weight
    names = quantize_linears_(model, ("mlp.*",), recipe=RECIPES["nvfp4"])
    assert names == ["mlp.fc", "mlp.proj"]
    assert isinstance(model.mlp.fc, NVFP4Linear) and not isinstance(model.attn, NVFP4Linear)
    assert model.mlp.fc.weight is w_fc
    assert len(list(model.parameters())) == 6
    with use_recipe(model, None):
        assert model.mlp.fc.recipe is None
    assert model.mlp.proj.recipe is RECIPES["nvfp4"]
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_linears_(model, ("nothing*",))
    bad = nn.Sequential(nn.Linear(20, 16))
    with pytest.raises(ValueError, match="in_features = 20"):
        quantize_linears_(bad, ("*",))
    with pytest.raises(ValueError, match="unknown numeric recipe"):
        get_recipe("fp8")
    with pytest.raises(ValueError, match="weight_block"):
        NVFP4Recipe("x", weight_block="4x4")


# ------------------------------------------------------------ the two native paths (CPU kernel, torch ops elsewhere)
def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().numpy().view(np.uint32)


@pytest.mark.parametrize("name", ["randn", "weights", "heavy", "outlier"])
@pytest.mark.parametrize("two_level", [True, False])
@pytest.mark.parametrize("rows", [1, 16])
def test_cpu_kernel_and_torch_ops_agree_bit_for_bit(name, two_level, rows):
    from triage_monitor.demo.nvfp4 import _native_torch

    x = _inputs()[name]
    want = hand_quantize(x.numpy(), two_level, rows)
    kernel = nvfp4_fake_quantize(x, two_level=two_level, block_shape="1x16" if rows == 1 else "16x16",
                                 backend="native")                  # CPU: the compiled kernel
    ops = _native_torch(x, rows, two_level).reshape(x.shape)        # what a CUDA tensor runs
    # the same bits, signs of zero included (-0.25 rounds to -0)
    np.testing.assert_array_equal(_bits(kernel), want.view(np.uint32))
    np.testing.assert_array_equal(_bits(ops), want.view(np.uint32))


def test_torch_ops_round_ties_and_special_inputs_without_a_sync():
    from triage_monitor.demo.nvfp4 import _native_torch, _round_e2m1

    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 0.7499999, 0.7500001, 5.9, -6.0, 0.0])
    assert _round_e2m1(v).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, 0.5, 1.0, 6.0, -6.0, 0.0]
    assert torch.signbit(_round_e2m1(torch.tensor([-0.25]))).item()
    assert torch.equal(_native_torch(torch.zeros(2, 16), 1, True), torch.zeros(1, 2, 1, 1, 16).expand(1, 2, 1, 1, 16))
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 32)
        x[1, 3] = bad
        assert _native_torch(x, 1, True).isnan().all()
        assert nvfp4_fake_quantize(x, backend="native").isnan().all()   # the kernel: NaN everywhere too
    assert torch.equal(nvfp4_fake_quantize(torch.zeros(3, 32), backend="native"), torch.zeros(3, 32))


def test_kernel_handles_batched_tiles_and_other_dtypes():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, 48, generator=g)
    got = nvfp4_fake_quantize(x, block_shape="16x16", two_level=False, backend="native")
    # two matrices tiled on their own rows: the same as quantizing the stacked (64, 48) matrix
    assert torch.equal(got, nvfp4_fake_quantize(x.reshape(64, 48), block_shape="16x16", two_level=False,
                                                backend="native").reshape(2, 32, 48))
    xb = x.to(torch.bfloat16)
    assert torch.equal(nvfp4_fake_quantize(xb, backend="native"), nvfp4_fake_quantize(xb, backend="torchao"))
    nc = torch.randn(32, 64, generator=g).t()          # not contiguous
    assert torch.equal(nvfp4_fake_quantize(nc, backend="native"), nvfp4_fake_quantize(nc.contiguous()))


def test_ste_without_a_gradient_returns_the_grid_values():
    x = torch.randn(8, 32) * 3
    with torch.no_grad():
        assert torch.equal(fake_quantize_ste(x.requires_grad_()), nvfp4_fake_quantize(x))
    assert torch.equal(fake_quantize_ste(x.detach(), backend="native"), nvfp4_fake_quantize(x, backend="native"))
    y = fake_quantize_ste(x.detach().requires_grad_())
    assert y.requires_grad and y.grad_fn is not None


def test_device_quantizer_uses_a_compiled_function_only_when_it_is_bit_exact(monkeypatch, caplog):
    import triage_monitor.demo.nvfp4 as nv

    monkeypatch.setattr(nv, "_DEVICE_QUANTIZERS", {})
    x = torch.randn(4, 1, 64)
    # a "compiler" returning the same function: accepted, and the result is the eager ops' bits
    fn = nv._device_quantizer("cpu", compile_fn=lambda f: f)
    assert fn is not nv._native_torch and torch.equal(fn(x, 1, True), nv._native_torch(x, 1, True))
    assert nv._device_quantizer("cpu") is fn                        # cached per device type
    # one that is off by an ulp is refused at first use: the eager ops, with a warning
    monkeypatch.setattr(nv, "_DEVICE_QUANTIZERS", {})
    off = lambda f: (lambda xf, rows, tl: torch.nextafter(f(xf, rows, tl), torch.tensor(10.0)))
    assert nv._device_quantizer("cpu", compile_fn=off) is nv._native_torch
    assert "eager torch ops" in caplog.text
    # one that compiles but raises later falls back for good
    monkeypatch.setattr(nv, "_DEVICE_QUANTIZERS", {})
    armed = []

    def flaky(f):
        def run(xf, rows, tl):
            if armed:
                raise RuntimeError("recompile failed")
            return f(xf, rows, tl)
        return run
    fn = nv._device_quantizer("cpu", compile_fn=flaky)
    armed.append(1)                                                   # passed its check; now every call raises
    assert torch.equal(fn(x, 1, True), nv._native_torch(x, 1, True))    # the call raises, answered eagerly
    assert nv._DEVICE_QUANTIZERS["cpu"] is nv._native_torch
    monkeypatch.setenv("TRIAGE_NVFP4_COMPILE", "0")
    monkeypatch.setattr(nv, "_DEVICE_QUANTIZERS", {})
    assert nv._device_quantizer("cpu", compile_fn=lambda f: f) is nv._native_torch


def test_compiled_quantizer_within_the_tolerance_is_kept_and_says_how_far(monkeypatch, caplog):
    import triage_monitor.demo.nvfp4 as nv

    monkeypatch.setattr(nv, "_DEVICE_QUANTIZERS", {})
    monkeypatch.setattr(nv, "_QUANTIZER_STATUS", {})

    def one_neighbour(f):   # what an approximate division does near a rounding boundary: one value, one grid step
        def run(xf, rows, tl):
            out = f(xf, rows, tl).clone()
            i = int(out.abs().argmax())
            out.view(-1)[i] = out.view(-1)[i] * (4.0 / 6.0)          # ±6·s → ±4·s, its neighbour on the grid
            return out
        return run
    fn = nv._device_quantizer("cpu", compile_fn=one_neighbour)
    assert isinstance(fn, nv._Guarded)
    status = nv._QUANTIZER_STATUS["cpu"]
    assert "within tolerance" in status and "4 of 10912 values differ" in status and "0.333" in status
    assert "eager torch ops" not in caplog.text
    # each differing value by more than 0.4 of its block's amax, or more than 0.1 % of the values: refused
    for bad in (lambda f: (lambda xf, rows, tl: f(xf, rows, tl) * 0.5),
                lambda f: (lambda xf, rows, tl: f(xf, rows, tl).reshape(xf.shape) * (1 + (xf.abs() > 0) * 0.01))):
        monkeypatch.setattr(nv, "_DEVICE_QUANTIZERS", {})
        monkeypatch.setattr(nv, "_WARNED", set())
        assert nv._device_quantizer("cpu", compile_fn=bad) is nv._native_torch
        assert "outside the tolerance" in nv._QUANTIZER_STATUS["cpu"]
    assert caplog.text.count("using the eager torch ops") == 2          # once per fall-back (one per process)


def test_compiled_quantizer_checks_each_new_key_at_its_first_use(monkeypatch):
    import triage_monitor.demo.nvfp4 as nv

    monkeypatch.setattr(nv, "_DEVICE_QUANTIZERS", {})
    monkeypatch.setattr(nv, "_QUANTIZER_STATUS", {})
    monkeypatch.setattr(nv, "_WARNED", set())
    wrong_tiles = lambda f: (lambda xf, rows, tl: f(xf, rows, tl) * (2.0 if rows == 16 else 1.0))
    fn = nv._device_quantizer("cpu", compile_fn=wrong_tiles)
    assert isinstance(fn, nv._Guarded) and "bit-identical" in nv._QUANTIZER_STATUS["cpu"]
    w = torch.randn(32, 64)
    assert torch.equal(fn(w, 16, False), nv._native_torch(w, 16, False))   # checked now: refused, answered eagerly
    assert nv._DEVICE_QUANTIZERS["cpu"] is nv._native_torch
    assert "outside the tolerance (rows=16, two_level=False)" in nv._QUANTIZER_STATUS["cpu"]
    assert torch.equal(fn(w, 1, True), nv._native_torch(w, 1, True))       # fell back for every key
    assert nv.quantizer_status("cpu").startswith("numba kernel")


def test_device_path_flattens_to_two_dimensions_without_changing_a_bit():
    import triage_monitor.demo.nvfp4 as nv

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 32, 64, generator=g) * torch.rand(3, 32, 64, generator=g) ** 4
    for rows in (1, 16):
        for tl in (True, False):
            flat = nv._native_torch(x.reshape(-1, 64), rows, tl).reshape(x.shape)
            whole = nv._native_torch(x, rows, tl).reshape(x.shape)
            assert torch.equal(flat.view(torch.int32), whole.view(torch.int32))


def test_compilation_uses_one_inductor_worker_unless_the_environment_says(monkeypatch):
    import torch._inductor.config as inductor_config

    import triage_monitor.demo.nvfp4 as nv

    monkeypatch.setattr(inductor_config, "compile_threads", 8)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    nv._one_compile_worker()
    assert inductor_config.compile_threads == 8
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")
    nv._one_compile_worker()
    assert inductor_config.compile_threads == 1
