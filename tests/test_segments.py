"""Position-based segments (docs/metrics.md#localisation) worked out by hand."""

import pytest
import torch

from triage_monitor.metrics.segments import segment_tokens


def test_segments_by_position_with_masked_gaps_and_predecessors():
    """W = 4.  Response 0: positions 0,1,2,3,4,9 → segments k = 0 (4 tokens), 1 (1), 2 (1); k = 1 and 2 are
    consecutive.  Response 1: positions 0, 8 → k = 0 and k = 2 (no k = 1: not consecutive).  Response 2: none.
    Response 3: positions 5, 9 → k = 1 and k = 2, consecutive."""
    sample = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 3, 3])
    pos = torch.tensor([0, 1, 2, 3, 4, 9, 0, 8, 5, 9])
    seg = segment_tokens(sample, pos, 4)
    assert seg.index.tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6]
    assert seg.sample.tolist() == [0, 0, 0, 1, 1, 3, 3]
    assert seg.number.tolist() == [0, 1, 2, 0, 2, 1, 2]
    assert seg.count.tolist() == [4, 1, 1, 1, 1, 1, 1]
    assert seg.num_segments == 7 and seg.width == 4
    prev = seg.predecessor()
    assert prev.dtype == torch.long and prev.tolist() == [-1, 0, 1, -1, -1, -1, 5]
    v = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    assert seg.sum(v).tolist() == [10.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert seg.mean(v).tolist() == [2.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert seg.broadcast(torch.arange(7.0)).tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6]


def test_single_segment_and_empty_and_errors():
    seg = segment_tokens(torch.tensor([2, 2]), torch.tensor([0, 63]), 64)
    assert seg.num_segments == 1 and seg.predecessor().tolist() == [-1] and seg.count.tolist() == [2]
    seg = segment_tokens(torch.tensor([2, 2]), torch.tensor([63, 64]), 64)
    assert seg.number.tolist() == [0, 1] and seg.predecessor().tolist() == [-1, 0]
    empty = segment_tokens(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 8)
    assert empty.num_segments == 0 and empty.width == 8 and empty.predecessor().tolist() == []
    with pytest.raises(ValueError, match="positive"):
        segment_tokens(torch.tensor([0]), torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="differ"):
        segment_tokens(torch.tensor([0, 0]), torch.tensor([0]), 4)


def test_width_one_float64_sums_and_empty_fields():
    """W = 1 is a valid width (one segment per position); sums keep the values' dtype (float64 stays float64);
    an empty batch has empty index, sample, number and count."""
    seg = segment_tokens(torch.tensor([0, 0, 1]), torch.tensor([0, 2, 0]), 1)
    assert seg.number.tolist() == [0, 2, 0] and seg.sample.tolist() == [0, 0, 1]
    v = torch.tensor([0.5, 0.25, 1e-300], dtype=torch.float64)
    s = seg.sum(v)
    assert s.dtype == torch.float64 and s.tolist() == [0.5, 0.25, 1e-300]
    assert seg.mean(v).dtype == torch.float64
    empty = segment_tokens(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 4)
    assert [t.tolist() for t in (empty.index, empty.sample, empty.number, empty.count)] == [[], [], [], []]


def test_an_empty_batch_has_int64_fields_and_broadcasts_to_no_token():
    """The documented int64 of index, sample, number and count holds for an empty batch too, so a per-segment value
    broadcasts to an empty (0,) tensor of its own dtype and a sum over no segment is empty."""
    empty = segment_tokens(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 4)
    assert [t.dtype for t in (empty.index, empty.sample, empty.number, empty.count)] == [torch.int64] * 4
    b = empty.broadcast(torch.zeros(0, dtype=torch.float64))
    assert b.shape == (0,) and b.dtype == torch.float64
    assert empty.sum(torch.zeros(0)).shape == (0,)


def _sorted_tokens(g, responses: int, max_len: int):
    """Tokens in TokenBatch order: responses ascending, each with ascending positions with gaps (masked tokens)."""
    sample, pos = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)]
    for s in range(responses):
        n = int(torch.randint(0, max_len, (1,), generator=g))
        p = torch.randint(1, 4, (n,), generator=g).cumsum(0) - 1
        sample.append(torch.full((n,), s, dtype=torch.long))
        pos.append(p)
    return torch.cat(sample), torch.cat(pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segment_sums_are_the_token_order_sums_of_index_add_bit_for_bit(dtype):
    """``Segments.sum`` (on the CPU a sum over each segment's run of tokens) equals ``index_add`` (each token added
    to its segment in token order: the reference) bit for bit, on values spanning 24 orders of magnitude with both
    signs and signed zeros, so that any other order or precision of the additions shows; and so does the gradient
    of a weighted sum of them.  A batch without segments gives an empty sum."""
    g = torch.Generator().manual_seed(0)
    sample, pos = _sorted_tokens(g, 40, 300)
    seg = segment_tokens(sample, pos, 16)
    n = sample.numel()
    v = (torch.randn(n, generator=g, dtype=torch.float64)
         * 10.0 ** torch.randint(-12, 12, (n,), generator=g).double()).to(dtype)
    v[::7] = -0.0
    v[::11] = 0.0
    v.requires_grad_(True)
    ref = torch.zeros(seg.num_segments, dtype=dtype).index_add(0, seg.index, v)
    got = seg.sum(v)
    bits = (lambda t: t.detach().view(torch.int64 if dtype == torch.float64 else torch.int32))
    assert torch.equal(bits(got), bits(ref))
    w = torch.randn(seg.num_segments, generator=g, dtype=dtype)
    (grad_ref,) = torch.autograd.grad((ref * w).sum(), v)
    (grad_got,) = torch.autograd.grad((got * w).sum(), v)
    assert torch.equal(bits(grad_got), bits(grad_ref))
    empty = segment_tokens(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 4)
    assert empty.sum(torch.zeros(0, dtype=dtype)).shape == (0,)


@pytest.mark.parametrize("narrow,wide", [(64, 128), (64, 192), (4, 4), (4, 12), (1, 7)])
def test_coarsened_segments_equal_the_segments_cut_at_the_wider_width(narrow, wide):
    """``coarsen(segment_tokens(..., W), m·W)`` equals ``segment_tokens(..., m·W)`` field by field (token index,
    response, segment number, count) on responses with masked gaps, empty responses and a lone token; a width that
    is not a multiple is refused."""
    from triage_monitor.metrics.segments import coarsen

    g = torch.Generator().manual_seed(narrow * wide)
    for responses, max_len in ((30, 700), (3, 2), (1, 1), (0, 1)):
        sample, pos = _sorted_tokens(g, responses, max_len)
        want = segment_tokens(sample, pos, wide)
        got = coarsen(segment_tokens(sample, pos, narrow), wide)
        for name in ("index", "sample", "number", "count"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.width == wide
    with pytest.raises(ValueError, match="not a positive multiple"):
        coarsen(segment_tokens(sample, pos, 4), 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_gate_pass_equals_the_torch_operations_bit_for_bit(dtype):
    """``segment_sums`` (one compiled pass on the CPU) gives the segments of ``segment_tokens`` and the sums of
    ``Segments.sum`` bit for bit (values over 24 orders of magnitude, signed zeros); ``broadcast_where_negative``
    equals ``torch.where(values < 0, seg.broadcast(w), fill)`` with NaN, −0.0 and exact zeros among the values;
    an empty batch and a width below 1 behave like the torch operations."""
    from triage_monitor.metrics.segments import broadcast_where_negative, segment_sums

    g = torch.Generator().manual_seed(3)
    bits = (lambda t: t.view(torch.int64 if t.dtype == torch.float64 else torch.int32))
    for responses, max_len, width in ((50, 400, 64), (7, 3, 1), (1, 1, 128)):
        sample, pos = _sorted_tokens(g, responses, max_len)
        n = sample.numel()
        a = (torch.randn(n, generator=g, dtype=torch.float64)
             * 10.0 ** torch.randint(-12, 12, (n,), generator=g).double()).to(dtype)
        b = torch.randn(n, generator=g, dtype=dtype)
        a[2::5], b[4::9] = -0.0, 0.0
        flag = b < -0.7
        seg, sa, sb, k = segment_sums(sample, pos, width, a, b, flag)
        ref = segment_tokens(sample, pos, width)
        for name in ("index", "sample", "number", "count"):
            assert torch.equal(getattr(seg, name), getattr(ref, name)), name
        assert torch.equal(bits(sa), bits(ref.sum(a))) and torch.equal(bits(sb), bits(ref.sum(b)))
        assert torch.equal(bits(k), bits(ref.sum(flag.to(dtype))))
        b[::13] = float("nan")
        b[::17] = -0.0
        w = torch.rand(seg.num_segments, generator=g, dtype=dtype)
        want = torch.where(b < 0, ref.broadcast(w), torch.full_like(b, 0.75))
        assert torch.equal(bits(broadcast_where_negative(seg, w, b, 0.75)), bits(want))
    empty = torch.zeros(0, dtype=torch.long)
    seg, sa, sb, k = segment_sums(empty, empty, 8, torch.zeros(0, dtype=dtype), torch.zeros(0, dtype=dtype),
                                  torch.zeros(0, dtype=torch.bool))
    assert seg.num_segments == 0 and sa.shape == sb.shape == k.shape == (0,)
    with pytest.raises(ValueError, match="positive"):
        segment_sums(torch.tensor([0]), torch.tensor([0]), 0, torch.ones(1, dtype=dtype), torch.ones(1, dtype=dtype),
                     torch.ones(1, dtype=torch.bool))
