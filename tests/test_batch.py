"""TokenBatch: layouts, canonical order, scatter back, validation with named errors."""

import math

import pytest
import torch

from triage_monitor.batch import InvalidTokenError, TokenBatch


def _padded():
    lp = -torch.arange(1, 13, dtype=torch.float32).reshape(3, 4) / 10
    s = lp - 0.01
    m = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    return lp, s, torch.tensor([1., -1., 2.]), m


def test_padded_flat_order_positions_and_scatter():
    lp, s, a, m = _padded()
    b = TokenBatch.from_padded(lp, s, a, m, sample_ids=torch.tensor([9, 2, 5]), group_ids=torch.tensor([0, 0, 1]))
    # samples sorted by id: 2 (row 1), 5 (row 2), 9 (row 0)
    assert b.sample_id.tolist() == [2, 5, 9]
    assert b.group_id.tolist() == [0, 1, 0]
    assert b.num_valid.tolist() == [2, 1, 3]
    assert b.position.tolist() == [1, 2, 0, 0, 1, 3]
    assert b.learner_logp.tolist() == pytest.approx([-.6, -.7, -.9, -.1, -.2, -.4])
    assert b.advantage.tolist() == [-1., -1., 2., 1., 1., 1.]
    back = b.scatter(b.learner_logp, fill=7.0)
    assert torch.equal(back, torch.where(m, lp, torch.tensor(7.0)))


def test_packed_and_list_scatter_round_trip():
    lp, s, a, m = _padded()
    pk = TokenBatch.from_packed(lp.reshape(-1), s.reshape(-1), a, torch.tensor([0, 4, 8, 12]), m.reshape(-1))
    assert torch.equal(pk.scatter(pk.sampler_logp), torch.where(m, s, torch.tensor(0.)).reshape(-1))
    ls = TokenBatch.from_list([lp[0, :3], lp[1], lp[2, :1]], [s[0, :3], s[1], s[2, :1]], [1., -1., 2.])
    out = ls.scatter(ls.learner_logp)
    assert [t.shape[0] for t in out] == [3, 4, 1]
    assert torch.equal(out[1], lp[1])


def test_gradient_flows_through_learner_logp_and_scatter():
    lp, s, a, m = _padded()
    lp = lp.clone().requires_grad_(True)
    b = TokenBatch.from_padded(lp, s, a, m)
    b.scatter(b.learner_logp * 2).sum().backward()
    assert torch.equal(lp.grad, m.float() * 2)


@pytest.mark.parametrize("field,value,reason", [
    ("learner_logp", float("nan"), "nonfinite"),
    ("sampler_logp", float("-inf"), "nonfinite"),
    ("learner_logp", 0.5, "positive"),
    ("sampler_logp", -1e10, "sentinel"),
    ("advantages", float("nan"), "nonfinite advantage"),
])
def test_invalid_values_raise_with_field_sample_position(field, value, reason):
    lp, s, a, m = _padded()
    tensors = {"learner_logp": lp, "sampler_logp": s, "advantages": a.clone()}
    if field == "advantages":
        tensors["advantages"][1] = value
        pos = 1
    else:
        tensors[field][1, 2] = value
        pos = 2
    with pytest.raises(InvalidTokenError) as ei:
        TokenBatch.from_padded(tensors["learner_logp"], tensors["sampler_logp"], tensors["advantages"], m)
    e = ei.value
    assert e.field == field and e.sample == 1 and e.position == pos
    assert reason in str(e) and field in str(e)
    # row 1 has 2 valid tokens (columns 1, 2): a per-sample advantage poisons both
    count = 2 if field == "advantages" else 1
    full = {"nonfinite": f"nonfinite_{field}", "positive": f"positive_{field}", "sentinel": f"sentinel_{field}",
            "nonfinite advantage": "nonfinite_advantage"}[reason]
    assert (e.reason, e.count) == (full, count) and (e.value == value or math.isnan(e.value) and math.isnan(value))
    assert str(e) == (f"{field}[sample=1, position={pos}] = {value!r}: {full.replace('_', ' ')} ({count} such "
                      "token(s) in this batch; pass on_invalid='quarantine' to exclude and count them)")


def test_padding_values_outside_mask_are_never_read():
    lp, s, a, m = _padded()
    lp = torch.where(m, lp, torch.tensor(0.0))          # 0.0 padding
    s = torch.where(m, s, torch.tensor(-1e10))          # sentinel padding
    b = TokenBatch.from_padded(lp, s, a, m)
    assert b.num_tokens == int(m.sum()) and not b.quarantine_counts


def test_quarantine_counts_and_keeps_bad_tokens_visible():
    lp, s, a, m = _padded()
    lp[0, 1] = float("nan")
    s[1, 2] = -9999.0
    b = TokenBatch.from_padded(lp, s, a, m, on_invalid="quarantine")
    assert b.num_tokens == int(m.sum()) - 2
    assert b.quarantine_counts == {"nonfinite_learner_logp": 1, "sentinel_sampler_logp": 1}
    assert sorted(b.quarantine_rows["position"].tolist()) == [1, 2]
    # scatter still maps the kept tokens to their own places
    back = b.scatter(torch.ones(b.num_tokens), fill=0.0)
    assert back[0, 1] == 0 and back[1, 2] == 0 and back[0, 0] == 1


def test_shape_dtype_mask_errors_name_the_argument():
    lp, s, a, m = _padded()
    with pytest.raises(ValueError, match=r"sampler_logp has shape \(3, 3\)"):
        TokenBatch.from_padded(lp, s[:, :3], a, m)
    with pytest.raises(TypeError, match="learner_logp must be a floating-point"):
        TokenBatch.from_padded(lp.long(), s, a, m)
    with pytest.raises(ValueError, match="mask must be boolean-like"):
        TokenBatch.from_padded(lp, s, a, m.float() * 2)
    with pytest.raises(ValueError, match="advantages must be"):
        TokenBatch.from_padded(lp, s, torch.ones(5), m)
    with pytest.raises(ValueError, match="sample_ids must be unique"):
        TokenBatch.from_padded(lp, s, a, m, sample_ids=torch.tensor([1, 1, 2]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        TokenBatch.from_packed(lp.reshape(-1), s.reshape(-1), a, torch.tensor([0, 4, 7]))
    with pytest.raises(ValueError, match=r"positions must be >= 0 .*got -1 for a valid token of sample 1"):
        shifted = torch.arange(4).expand(3, 4) - 2 * (torch.arange(3) == 1)[:, None]    # row 1 starts at -2
        TokenBatch.from_padded(lp, s, a, m, positions=shifted)
    with pytest.raises(TypeError, match=r"sampler_logp\[1\] must be a torch.Tensor, got ndarray"):
        TokenBatch.from_list([lp[0], lp[1]], [s[0], s[1].numpy()], [1., -1.])


def test_padded_refuses_another_device_and_misshapen_positions_and_broadcasts_column_advantages():
    """``from_padded``: an argument on another device than ``learner_logp`` (the meta device: no accelerator
    needed) is refused naming it and both devices; ``positions`` of another shape or type is refused naming it
    and ``learner_logp``; advantages of shape (B, 1) spread over each response as (B,) do (by hand: row 0 has 3
    valid tokens of A = 1, row 1 two of A = −1, row 2 one of A = 2).  Messages typed out."""
    lp, s, a, m = _padded()
    for name, args in (("sampler_logp", (lp, s.to("meta"), a, m)), ("advantages", (lp, s, a.to("meta"), m)),
                       ("mask", (lp, s, a, m.to("meta")))):
        with pytest.raises(ValueError) as err:
            TokenBatch.from_padded(*args)
        assert str(err.value) == f"{name} is on meta, but learner_logp is on cpu"
    with pytest.raises(ValueError) as err:
        TokenBatch.from_padded(lp, s, a, m, positions=torch.arange(3).expand(3, 3))
    assert str(err.value) == "positions has shape (3, 3), but learner_logp has shape (3, 4)"
    with pytest.raises(TypeError) as err:
        TokenBatch.from_padded(lp, s, a, m, positions=[[0, 1, 2, 3]] * 3)
    assert str(err.value) == "positions must be a torch.Tensor, got list"
    column = TokenBatch.from_padded(lp, s, a[:, None], m)
    assert column.advantage.tolist() == [1., 1., 1., -1., -1., 2.]


def test_an_empty_response_is_not_counted_as_left_padded():
    """``offset_responses`` counts the responses whose first valid column is not 0 (left padding without
    ``positions=``): of a left-padded row, an empty (fully masked) row and a right-padded row, only the first."""
    lp, s, a, _ = _padded()
    m = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert TokenBatch.from_padded(lp, s, a, m).offset_responses == 1


def _refused(build, cases):
    """Each ``(args, error type, message)`` of ``cases``: ``build(*args)`` raises that error with exactly that text."""
    for args, error, message in cases:
        with pytest.raises(error) as err:
            build(*args)
        assert str(err.value) == message, args


def test_from_list_errors_name_the_list_and_sample_and_its_advantage_forms():
    """``from_list`` (responses of 3, 4 and 1 tokens): a list of the wrong length, a non-float sample and a
    per-sample advantage of the wrong shape are refused naming the list and the sample (messages typed out).  A
    ``(S,)`` tensor of advantages spreads over each response keeping its dtype, as ``from_padded``'s advantages
    do; numbers and per-token arrays become float32 tensors.  An empty list with empty masks is an empty batch.
    ``on_invalid`` reaches the validation (a NaN quarantined or refused); ``from_packed`` names a non-float
    ``learner_logp``."""
    import numpy as np

    lp, s, _, m = _padded()
    learner, sampler, masks = [lp[0, :3], lp[1], lp[2, :1]], [s[0, :3], s[1], s[2, :1]], [m[0, :3], m[1], m[2, :1]]
    cases = [
        ((learner, sampler[:2], [1., -1., 2.]), ValueError, "sampler_logp has 2 samples, learner_logp has 3"),
        (([learner[0], learner[1].long(), learner[2]], sampler, [1., -1., 2.]), TypeError,
         "learner_logp[1] must be a floating-point tensor of log-probs (nats), got dtype torch.int64"),
        ((learner, sampler, torch.ones(3, 1)), ValueError, "advantages[0] has shape (1,), expected (3,) or a scalar"),
        ((learner, sampler, [1., 2.]), ValueError, "advantages must hold 3 entries, got 2"),
        ((learner, sampler, [1., -1., 2.], masks[:2]), ValueError, "masks has 2 samples, learner_logp has 3"),
    ]
    _refused(TokenBatch.from_list, cases)
    per_sample = TokenBatch.from_list(learner, sampler, torch.tensor([1., -1., 2.], dtype=torch.float64))
    assert per_sample.advantage.dtype == torch.float64
    assert per_sample.advantage.tolist() == [1., 1., 1., -1., -1., -1., -1., 2.]
    mixed = TokenBatch.from_list(learner, sampler, [np.full(3, 0.1), 0.2, torch.tensor([0.3], dtype=torch.float64)])
    assert mixed.advantage.dtype == torch.float32
    assert mixed.advantage.tolist() == np.array([0.1] * 3 + [0.2] * 4 + [0.3], dtype=np.float32).tolist()
    empty = TokenBatch.from_list([], [], [], [])
    assert (empty.num_tokens, empty.num_samples, empty.quarantine_counts) == (0, 0, {})
    bad = [learner[0], learner[1].clone(), learner[2]]
    bad[1][2] = float("nan")                         # sample 1, position 2: quarantined when asked, else refused
    kept = TokenBatch.from_list(bad, sampler, [1., -1., 2.], on_invalid="quarantine")
    assert kept.quarantine_counts == {"nonfinite_learner_logp": 1}
    assert kept.num_tokens == 7 and kept.quarantine_rows["position"].tolist() == [2]
    with pytest.raises(InvalidTokenError):
        TokenBatch.from_list(bad, sampler, [1., -1., 2.])
    with pytest.raises(TypeError) as err:
        TokenBatch.from_packed(lp.reshape(-1).long(), s.reshape(-1), torch.ones(12), torch.tensor([0, 4, 8, 12]))
    assert str(err.value) == "learner_logp must be a floating-point tensor of log-probs (nats), got dtype torch.int64"


def test_from_packed_errors_name_the_argument_and_cu_seqlens_may_hold_an_empty_response():
    """``from_packed`` (12 tokens in responses of 4, 4 and 4): each malformed argument is refused naming it
    (messages typed out; ``cu_seqlens`` shows its first 8 entries; another device is the meta one); equal
    consecutive ``cu_seqlens`` entries are an empty response, not an error."""
    lp, s, a, _ = _padded()
    lp, s = lp.reshape(-1), s.reshape(-1)
    cu = torch.tensor([0, 4, 8, 12])
    bad_cu = "cu_seqlens must be non-decreasing from 0 to N_total=12, got {}..."
    cases = [
        ((lp, s.long(), a, cu), TypeError,
         "sampler_logp must be a floating-point tensor of log-probs (nats), got dtype torch.int64"),
        ((lp.reshape(3, 4), s, a, cu), ValueError, "learner_logp must be 1-D packed (N_total,), got shape (3, 4)"),
        ((lp, s[:11], a, cu), ValueError, "sampler_logp has shape (11,), but learner_logp has shape (12,)"),
        ((lp, s, a, cu.float()), TypeError, "cu_seqlens must be an integer tensor, got dtype torch.float32"),
        ((lp, s, a, torch.tensor([[0, 12]])), ValueError, bad_cu.format([[0, 12]])),
        ((lp, s, a, torch.tensor([], dtype=torch.long)), ValueError, bad_cu.format([])),
        ((lp, s, a, torch.tensor([1, 4, 12])), ValueError, bad_cu.format([1, 4, 12])),
        ((lp, s, a, torch.tensor([0, 4, 11])), ValueError, bad_cu.format([0, 4, 11])),
        ((lp, s, a, torch.tensor([0, 8, 4, 12])), ValueError, bad_cu.format([0, 8, 4, 12])),
        ((lp, s, a, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 13])), ValueError,
         bad_cu.format([0, 1, 2, 3, 4, 5, 6, 7])),
        ((lp, s, torch.ones(5), cu), ValueError, "advantages must be (12,) per token or (3,) per sample, got (5,)"),
        ((lp, s, a, cu, torch.ones(11, dtype=torch.bool)), ValueError,
         "mask has shape (11,), but learner_logp has shape (12,)"),
        ((lp, s, a, cu, torch.tensor([1, 1, 2] + [0] * 9)), ValueError,
         "mask must be boolean-like (0/1), found 2.0 at index (2,)"),
        ((lp, s.to("meta"), a, cu), ValueError, "sampler_logp is on meta, but learner_logp is on cpu"),
        ((lp, s, a.to("meta"), cu), ValueError, "advantages is on meta, but learner_logp is on cpu"),
        ((lp, s, a, cu, torch.ones(12, dtype=torch.bool, device="meta")), ValueError,
         "mask is on meta, but learner_logp is on cpu"),
    ]
    _refused(TokenBatch.from_packed, cases)
    b = TokenBatch.from_packed(lp, s, a, torch.tensor([0, 4, 4, 12]))
    assert (b.num_samples, b.num_valid.tolist()) == (3, [4, 0, 8])
    assert b.advantage.tolist() == [1.] * 4 + [2.] * 8


def test_a_mask_of_any_integer_or_float_dtype_counts_as_its_0_1_values_and_others_are_refused():
    """A loss mask may be bool or 0/1 in any integer or float dtype (frameworks store it as int64, float or
    uint8): each builds the same batch.  A value other than 0 and 1 is refused with its value and 2-D index, and
    a dtype that is neither (complex) by name (messages typed out)."""
    lp, s, a, m = _padded()
    expected = TokenBatch.from_padded(lp, s, a, m)
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.float16, torch.float32):
        b = TokenBatch.from_padded(lp, s, a, m.to(dtype))
        assert b.position.tolist() == expected.position.tolist() and b.sample_index.tolist() == \
            expected.sample_index.tolist(), dtype
    for value, shown in ((2, "2.0"), (-1, "-1.0"), (0.5, "0.5")):
        bad = m.float()
        bad[1, 2] = value
        with pytest.raises(ValueError) as err:
            TokenBatch.from_padded(lp, s, a, bad)
        assert str(err.value) == f"mask must be boolean-like (0/1), found {shown} at index (1, 2)"
    with pytest.raises(TypeError) as err:
        TokenBatch.from_padded(lp, s, a, m.to(torch.complex64))
    assert str(err.value) == "mask must be bool or 0/1 numeric, got dtype torch.complex64"
    with pytest.raises(TypeError) as err:
        TokenBatch.from_padded(lp, s, a, m.tolist())
    assert str(err.value) == "mask must be a torch.Tensor, got list"


def test_build_checks_its_options_ids_and_integer_advantages():
    """Common to every layout: ``on_invalid`` other than raise / quarantine, and sample or group ids of another
    length than the responses, are refused naming the value (messages typed out); integer advantages become
    float32; responses without group ids are in group −1 (int64).  From flat rows an invalid token names its
    ``sample_id``, from other layouts its row."""
    lp, s, a, m = _padded()
    _refused(lambda kwargs: TokenBatch.from_padded(lp, s, a, m, **kwargs), [
        (({"on_invalid": "skip"},), ValueError, "on_invalid must be 'raise' or 'quarantine', got 'skip'"),
        (({"sample_ids": torch.tensor([4, 5])},), ValueError, "sample_ids must have shape (3,), got (2,)"),
        (({"group_ids": torch.tensor([0, 0, 1, 1])},), ValueError, "group_ids must have shape (3,), got (4,)")])
    b = TokenBatch.from_padded(lp, s, torch.tensor([1, -1, 2]), m)
    assert b.advantage.dtype == torch.float32 and b.advantage.tolist() == [1., 1., 1., -1., -1., 2.]
    assert b.group_id.dtype == torch.int64 and b.group_id.tolist() == [-1, -1, -1]
    with pytest.raises(InvalidTokenError) as err:
        TokenBatch.from_flat(torch.tensor([-0.5, 0.5]), torch.tensor([-0.5, -0.5]), torch.ones(2),
                             torch.tensor([70, 90]), torch.tensor([0, 3]))
    assert (err.value.sample, err.value.position, err.value.value) == (90, 3, 0.5)


def test_from_flat_sorts_rows_and_rejects_duplicates():
    b = TokenBatch.from_flat(torch.tensor([-.1, -.2, -.3]), torch.tensor([-.1, -.1, -.1]), torch.ones(3),
                             torch.tensor([7, 3, 7]), torch.tensor([5, 0, 2]))
    assert b.sample_id.tolist() == [3, 7] and b.position.tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match="occurs twice"):
        TokenBatch.from_flat(torch.zeros(2) - .1, torch.zeros(2) - .1, torch.ones(2), torch.tensor([1, 1]),
                             torch.tensor([0, 0]))
    with pytest.raises(InvalidTokenError, match=r"learner_logp\[sample=1007, position=2\] = nan"):   # the id, not 1
        TokenBatch.from_flat(torch.tensor([-.1, float("nan")]), torch.zeros(2) - .1, torch.ones(2),
                             torch.tensor([1003, 1007]), torch.tensor([0, 2]))


def test_gather_is_the_inverse_of_scatter():
    lp, s, a, m = _padded()
    b = TokenBatch.from_padded(lp, s, a, m, sample_ids=torch.tensor([9, 2, 5]))
    assert torch.equal(b.gather(lp), b.learner_logp)
    assert torch.equal(b.gather(b.scatter(b.sampler_logp)), b.sampler_logp)
    ls = TokenBatch.from_list([lp[0, :3], lp[1]], [s[0, :3], s[1]], [1., -1.])
    assert torch.equal(ls.gather([lp[0, :3], lp[1]]), ls.learner_logp)
    with pytest.raises(ValueError, match="built from 12"):
        b.gather(lp[:, :2])


def test_flat_batch_scatter_and_gather_are_the_identity_and_name_the_expected_shape():
    """A :meth:`TokenBatch.from_flat` batch is already in the caller's layout: scatter and gather return the values
    themselves; a wrong length names both shapes."""
    b = TokenBatch.from_flat(torch.tensor([-.1, -.2, -.3]), torch.tensor([-.1, -.1, -.1]), torch.ones(3),
                             torch.tensor([4, 4, 8]), torch.tensor([0, 1, 0]))
    v = torch.tensor([1.5, 2.5, 3.5], dtype=torch.float64)
    assert b.scatter(v) is v and b.gather(v) is v
    with pytest.raises(ValueError, match=r"^gather: values has shape \(2,\), expected \(3,\)$"):
        b.gather(v[:2])
    with pytest.raises(ValueError, match=r"^scatter: values has shape \(2,\), expected \(3,\)$"):
        b.scatter(v[:2])


def test_scatter_keeps_the_dtype_of_the_values():
    """float64 weights scattered into a padded layout stay float64 (and exact), filled with ``fill`` elsewhere."""
    lp, s, a, m = _padded()
    b = TokenBatch.from_padded(lp, s, a, m)
    w = torch.arange(1, b.num_tokens + 1, dtype=torch.float64) / 3
    out = b.scatter(w, fill=-1.0)
    assert out.dtype == torch.float64
    # row-major valid cells: (0,0) (0,1) (0,3) (1,1) (1,2) (2,0)
    expect = torch.full((3, 4), -1.0, dtype=torch.float64)
    expect[m] = w
    assert torch.equal(out, expect)


def test_from_flat_orders_by_sample_then_position():
    """Rows (sample 1, position 0), (sample 0, position 0), (sample 0, position 1): sorted by sample first, so
    sample 0's position 1 comes before sample 1's position 0 (a key that mixed the two would interleave them or
    call two different tokens duplicates)."""
    b = TokenBatch.from_flat(torch.tensor([-.3, -.1, -.2]), torch.full((3,), -.5), torch.tensor([3., 1., 2.]),
                             torch.tensor([1, 0, 0]), torch.tensor([0, 0, 1]))
    assert b.sample_id.tolist() == [0, 1]
    assert b.sample_index.tolist() == [0, 0, 1] and b.position.tolist() == [0, 1, 0]
    assert b.learner_logp.tolist() == pytest.approx([-.1, -.2, -.3]) and b.advantage.tolist() == [1., 2., 3.]
    assert b.num_valid.tolist() == [2, 1]


@pytest.mark.parametrize("field", ["sampler_logp", "advantage", "sample_id", "position"])
def test_from_flat_shape_error_names_the_field(field):
    args = {"learner_logp": torch.full((3,), -.1), "sampler_logp": torch.full((3,), -.2), "advantage": torch.ones(3),
            "sample_id": torch.tensor([0, 0, 1]), "position": torch.tensor([0, 1, 0])}
    args[field] = args[field][:2]
    with pytest.raises(ValueError, match=rf"^{field} has shape \(2,\), but learner_logp has shape \(3,\)$"):
        TokenBatch.from_flat(**args)


def _quarantined_part(ids, bad, reason_value, offset_row=None):
    """A padded micro-batch (rows ``ids``, 3 columns, all valid) with one impossible learner value at ``bad`` =
    (row, column), quarantined; ``offset_row`` starts one row at column 1 (left padding)."""
    B = len(ids)
    lp = -torch.arange(1, 3 * B + 1, dtype=torch.float32).reshape(B, 3) / 10
    m = torch.ones(B, 3, dtype=torch.bool)
    if offset_row is not None:
        m[offset_row, 0] = False
    lp[bad] = reason_value
    return TokenBatch.from_padded(lp, lp - 0.01, torch.arange(B, dtype=torch.float32) + 1, m,
                                  sample_ids=torch.tensor(ids), group_ids=torch.tensor(ids) // 10,
                                  on_invalid="quarantine")


def test_cat_renumbers_responses_and_merges_the_quarantine():
    """Two micro-batches of one step: ids (20, 10) and (9, 5, 7) become responses 0..4 in part order (each part
    sorted by its own ids: 10, 20 | 5, 7, 9); a quarantined token keeps pointing at its response under the new
    numbering (id 20 → 1, id 9 → 2 + 2 = 4); counts per reason add up, and so do the left-padded responses."""
    a = _quarantined_part([20, 10], (0, 2), float("nan"), offset_row=1)        # row 0 = id 20, row 1 = id 10
    b = _quarantined_part([9, 5, 7], (0, 1), float("inf"))                      # row 0 = id 9
    b2 = _quarantined_part([9, 5, 7], (1, 0), 0.5)                              # row 1 = id 5: positive log-prob
    c = TokenBatch.cat([a, b])
    assert c.sample_id.tolist() == [0, 1, 2, 3, 4]
    assert c.num_valid.tolist() == [2, 2, 3, 3, 2]             # id 10 left-padded, id 20 and id 9 lost one token
    assert c.sample_index.tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]
    assert c.group_id.tolist() == [1, 2, 0, 0, 0]
    assert c.quarantine_counts == {"nonfinite_learner_logp": 2}
    assert c.quarantine_rows["sample_id"].tolist() == [1, 4]
    assert c.quarantine_rows["position"].tolist() == [2, 1]
    assert c.offset_responses == 1
    assert torch.equal(c.learner_logp, torch.cat([a.learner_logp, b.learner_logp]))
    c3 = TokenBatch.cat([a, b2, b])
    assert c3.quarantine_counts == {"nonfinite_learner_logp": 2, "positive_learner_logp": 1}
    assert c3.quarantine_rows["sample_id"].tolist() == [1, 2, 4 + 3]
    one = TokenBatch.cat([b])
    assert one.sample_id.tolist() == [0, 1, 2] and one.quarantine_rows["sample_id"].tolist() == [2]
    with pytest.raises(ValueError, match="^TokenBatch.cat: no batches to concatenate$"):
        TokenBatch.cat([])


def test_from_flat_group_ids_per_response_and_a_later_duplicate():
    """Per-token group ids become one per response (in sample-id order); a repeated (sample_id, position) pair is
    refused wherever it sits in the rows, not only next to the first one."""
    b = TokenBatch.from_flat(torch.full((4,), -.1), torch.full((4,), -.2), torch.ones(4),
                             torch.tensor([9, 4, 9, 4]), torch.tensor([0, 0, 1, 1]),
                             group_id=torch.tensor([7, 3, 7, 3]))
    assert b.sample_id.tolist() == [4, 9] and b.group_id.tolist() == [3, 7] and b.group_id.dtype == torch.int64
    assert TokenBatch.from_flat(torch.full((2,), -.1), torch.full((2,), -.2), torch.ones(2), torch.tensor([1, 2]),
                                torch.tensor([0, 0])).group_id.tolist() == [-1, -1]
    with pytest.raises(ValueError, match=r"^from_flat: a \(sample_id, position\) pair occurs twice$"):
        TokenBatch.from_flat(torch.full((3,), -.1), torch.full((3,), -.2), torch.ones(3), torch.tensor([0, 1, 1]),
                             torch.tensor([0, 3, 3]))


def test_to_moves_every_tensor_and_keeps_the_rest():
    """``to("meta")`` moves each tensor field (the meta device needs no accelerator); counts, layout and the
    scatter map's meaning are kept."""
    lp, s, a, m = _padded()
    lp[0, 1] = float("nan")
    b = TokenBatch.from_padded(lp, s, a, m, on_invalid="quarantine")
    moved = b.to("meta")
    for name in ("learner_logp", "sampler_logp", "advantage", "sample_index", "position", "sample_id", "group_id",
                 "num_valid", "_source_index"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(moved, name).shape == getattr(b, name).shape, name
    assert moved.quarantine_counts == b.quarantine_counts and moved._layout == b._layout
    back = b.to("cpu")
    assert torch.equal(back.learner_logp, b.learner_logp) and torch.equal(back._source_index, b._source_index)


def test_invalid_codes_at_the_exact_bounds():
    """A log-prob of exactly +1e-3 nats (the tolerance, as float32) is still valid; exactly −1e8 nats is a sentinel
    (log p ≤ −1e8), the next float32 above it (−99,999,992) is not; −9999 (vLLM's −inf) is, −9998.5 is not:
    codes index INVALID_REASONS (0 non-finite learner, 4 sentinel learner, 5 sentinel sampler), −1 valid."""
    from triage_monitor.batch import invalid_codes
    below = float(torch.nextafter(torch.tensor(-1e8), torch.tensor(0.0)))
    assert below == -99999992.0
    learner = torch.tensor([1e-3, -1.0, -1e8, -1.0, below, -1500.0, -9999.0, -9998.5, -1.0, -1e10,
                            torch.finfo(torch.float32).min, float("-inf")])
    sampler = torch.tensor([-1.0, 1e-3, -1.0, -1e8, -1.0, -1.0, -1.0, -1.0, -65504.0, -1.0, -1.0, -1.0])
    assert invalid_codes(learner, sampler, torch.zeros(12)).tolist() == [-1, -1, 4, 5, -1, -1, 4, -1, 5, 4, 4, 0]
    # the batch's own check agrees at the bounds: the valid edge values build a batch, −1e8 nats is refused
    keep = [0, 1, 4, 5, 7]
    edge = TokenBatch.from_flat(learner[keep], sampler[keep], torch.ones(5), torch.arange(5),
                                torch.zeros(5, dtype=torch.long))
    assert edge.num_tokens == 5 and edge.quarantine_counts == {}
    for lp, sp, reason in ((-1e8, -1.0, "sentinel_learner_logp"), (-1.0, -1e8, "sentinel_sampler_logp")):
        zero = torch.zeros(1, dtype=torch.long)
        with pytest.raises(InvalidTokenError) as err:
            TokenBatch.from_flat(torch.tensor([lp]), torch.tensor([sp]), torch.ones(1), zero, zero)
        assert err.value.reason == reason


def test_canonical_order_checks_every_neighbouring_pair_and_names_the_first_16_duplicate_ids():
    """Ids (0, 2, 1) are out of order only between their last two: the batch is still sorted to 0, 1, 2 (row 2's
    token comes before row 1's).  Duplicate ids are refused with the first 16 ids typed out.  Unsorted ids with no
    valid token at all (every mask entry 0) give an empty batch of 2 responses, not an error; a last response
    without a valid token still has its count, 0."""
    lp = torch.tensor([[-.1], [-.2], [-.3]])
    b = TokenBatch.from_padded(lp, lp, torch.ones(3), torch.ones(3, 1), sample_ids=torch.tensor([0, 2, 1]))
    assert b.sample_id.tolist() == [0, 1, 2] and b.learner_logp.tolist() == pytest.approx([-.1, -.3, -.2])
    ids = list(range(19)) + [3]
    lp20 = torch.full((20, 1), -.1)
    with pytest.raises(ValueError) as err:
        TokenBatch.from_padded(lp20, lp20, torch.ones(20), torch.ones(20, 1), sample_ids=torch.tensor(ids))
    assert str(err.value) == f"sample_ids must be unique within a step, got {list(range(16))}"
    empty = TokenBatch.from_padded(lp[:2], lp[:2], torch.ones(2), torch.zeros(2, 1), sample_ids=torch.tensor([1, 0]))
    assert empty.sample_id.tolist() == [0, 1] and empty.num_valid.tolist() == [0, 0]
    assert empty.learner_logp.numel() == 0
    last_empty = TokenBatch.from_padded(lp[:2], lp[:2], torch.ones(2), torch.tensor([[1], [0]]))
    assert last_empty.num_valid.tolist() == [1, 0]         # the last response has no valid token: still counted


def test_an_invalid_value_of_a_padded_batch_names_its_row_not_its_sample_id():
    """Rows with sample_ids (40, 30) and a NaN at row 1, column 2: the error names sample 1 (the row the caller
    passed), as for every layout but from_flat, whose rows are identified by their sample_id."""
    lp = torch.full((2, 3), -.5)
    lp[1, 2] = float("nan")
    with pytest.raises(InvalidTokenError) as err:
        TokenBatch.from_padded(lp, torch.full((2, 3), -.5), torch.ones(2), torch.ones(2, 3),
                               sample_ids=torch.tensor([40, 30]))
    assert (err.value.field, err.value.sample, err.value.position) == ("learner_logp", 1, 2)


def test_a_diverged_learners_log_prob_is_valid_and_fill_values_are_sentinels():
    """torch.log_softmax([0, 1500]) gives exactly −1500 nats: a learner that has diverged, valid (it used to be read
    as a sentinel, |log p| ≥ 1000, which stopped the training step).  Fill values as frameworks write them stay
    sentinels: −1e9 (TRL's pad when it gathers per-token values across ranks), −1e10, the dtype minimum written into
    attention masks (float32, bfloat16), a log-softmax over logits masked with −1e9 or the float32 minimum, −9999
    (vLLM's −inf), also after rounding to bfloat16 (−9984) and float16 (−10000), and −65504 (float16 minimum)."""
    lp = torch.log_softmax(torch.tensor([[0.0, 1500.0]]), -1)
    assert lp[0, 0].item() == -1500.0
    b = TokenBatch.from_padded(lp, torch.tensor([[-3.0, -0.5]]), torch.ones(1), torch.ones(1, 2))
    assert b.learner_logp.tolist() == [-1500.0, 0.0] and b.quarantine_counts == {}
    assert b.delta.tolist() == [-1497.0, 0.5]
    masked = torch.log_softmax(torch.tensor([0.0, -1e9, 30.0, torch.finfo(torch.float32).min]), -1)
    assert masked[1].item() == -1e9 and masked[3].item() == torch.finfo(torch.float32).min
    fills = [-1e9, -1e10, torch.finfo(torch.float32).min, masked[1].item(), masked[3].item(), -9999.0, -65504.0]
    for dtype, values in ((torch.float32, fills), (torch.bfloat16, [-9999.0, -1e9, torch.finfo(torch.bfloat16).min]),
                          (torch.float16, [-9999.0, -65504.0])):
        x = torch.tensor(values, dtype=dtype)
        n = len(values)
        q = TokenBatch.from_flat(x, torch.full((n,), -1.0, dtype=dtype), torch.ones(n), torch.arange(n),
                                 torch.zeros(n, dtype=torch.long), on_invalid="quarantine")
        assert q.quarantine_counts == {"sentinel_learner_logp": n}, (dtype, x.tolist())
    assert torch.tensor(-9999.0, dtype=torch.bfloat16).item() == -9984.0
    assert torch.tensor(-9999.0, dtype=torch.float16).item() == -10000.0
    # a real bfloat16 / float16 log-prob far below −1000 stays valid
    for dtype in (torch.bfloat16, torch.float16):
        ok = TokenBatch.from_flat(torch.tensor([-1500.0, -9000.0], dtype=dtype), torch.full((2,), -1.0, dtype=dtype),
                                  torch.ones(2), torch.arange(2), torch.zeros(2, dtype=torch.long))
        assert ok.quarantine_counts == {} and ok.num_tokens == 2


P62 = 2 ** 62


def test_from_flat_orders_positions_near_two_to_the_62():
    """Positions near 2⁶² used to overflow the sort key row · (max position + 1) + position (int64) and come back out
    of order with no error.  Rows (sample 1, 2⁶²+3), (0, 2⁶²), (1, 5), (0, 2⁶²+1): sample 0 first, its positions
    2⁶², 2⁶²+1, then sample 1's 5, 2⁶²+3; a repeated pair near 2⁶² is still refused."""
    b = TokenBatch.from_flat(torch.tensor([-.1, -.2, -.3, -.4]), torch.full((4,), -.5), torch.tensor([1., 2., 3., 4.]),
                             torch.tensor([1, 0, 1, 0]), torch.tensor([P62 + 3, P62, 5, P62 + 1]))
    assert b.sample_id.tolist() == [0, 1] and b.sample_index.tolist() == [0, 0, 1, 1]
    assert b.position.tolist() == [P62, P62 + 1, 5, P62 + 3]
    assert b.advantage.tolist() == [2., 4., 3., 1.] and b.num_valid.tolist() == [2, 2]
    with pytest.raises(ValueError, match="occurs twice"):
        TokenBatch.from_flat(torch.full((3,), -.1), torch.full((3,), -.1), torch.ones(3), torch.tensor([0, 1, 0]),
                             torch.tensor([P62 + 9, P62 + 9, P62 + 9]))
    # the largest int64 position, once in each of two samples: two tokens in sample order, not a duplicate
    two = TokenBatch.from_flat(torch.full((2,), -.1), torch.full((2,), -.1), torch.ones(2), torch.tensor([1, 0]),
                               torch.tensor([2 ** 63 - 1, 2 ** 63 - 1]))
    assert two.sample_index.tolist() == [0, 1]


def test_padded_rows_reordered_by_sample_id_keep_positions_near_two_to_the_62_in_order():
    """The canonical re-sort of rows whose sample ids are not ascending uses the same (row, position) order: ids
    (5, 1), positions ((2⁶²+1, 2⁶²), (2⁶²+7, 3)) give sample 1's positions 3, 2⁶²+7, then sample 5's 2⁶², 2⁶²+1, and
    scatter puts every value back in its own cell."""
    lp = torch.tensor([[-.1, -.2], [-.3, -.4]])
    pos = torch.tensor([[P62 + 1, P62], [P62 + 7, 3]])
    b = TokenBatch.from_padded(lp, lp - 0.5, torch.ones(2), torch.ones(2, 2), sample_ids=torch.tensor([5, 1]),
                               positions=pos)
    assert b.sample_id.tolist() == [1, 5]
    assert b.position.tolist() == [3, P62 + 7, P62, P62 + 1]
    assert b.learner_logp.tolist() == pytest.approx([-.4, -.3, -.2, -.1])
    assert torch.equal(b.scatter(b.learner_logp), lp)


_EDGE_LOGPS = (1e-3, 1.5e-3, 0.0, -0.0, -9984.0, -9983.0, -9985.0, -9999.0, -1e8, -99999992.0, -3.4e38,
               float("nan"), float("inf"), float("-inf"), -65504.0, -1500.0)


def _edge_values(dtype, n, g, p):
    """``(n,)`` log-probs of ``dtype``: ordinary values, and with probability ``p`` each one of the bounds of the
    value checks or the float next to one in ``dtype`` (above and below)."""
    base = -torch.rand(n, generator=g, dtype=torch.float64) * 5
    edges = torch.tensor(_EDGE_LOGPS, dtype=torch.float64).to(dtype)
    near = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, math.inf)),
                      torch.nextafter(edges, torch.full_like(edges, -math.inf))])
    pick = near[torch.randint(len(near), (n,), generator=g)].double()
    return torch.where(torch.rand(n, generator=g) < p, pick, base).to(dtype)


def _reference_padded(lp, s, adv, m, positions, sample_ids):
    """What ``from_padded`` must hold, token by token in plain Python (rows in sample-id order, columns in order):
    learner, sampler, advantage, row rank, position and flat source index of every valid token."""
    B, T = m.shape
    ids = list(range(B)) if sample_ids is None else sample_ids.tolist()
    rows = sorted(range(B), key=lambda b: ids[b])
    out = {k: [] for k in ("learner", "sampler", "advantage", "rank", "position", "source")}
    for rank, b in enumerate(rows):
        for t in range(T):
            if m[b, t]:
                out["learner"].append(lp[b, t])
                out["sampler"].append(s[b, t])
                out["advantage"].append(adv[b, t] if adv.dim() == 2 and adv.shape[1] == T else adv.reshape(-1)[b])
                out["rank"].append(rank)
                out["position"].append(t if positions is None else int(positions[b, t]))
                out["source"].append(b * T + t)
    return out


def _check_from_padded(lp, s, adv, m, positions, sample_ids):
    """``from_padded`` of these tensors against :func:`_reference_padded` and the full element-wise check
    (``invalid_codes``): see the test below."""
    from triage_monitor.batch import INVALID_REASONS, invalid_codes

    dtype = lp.dtype
    B, T = m.shape
    ref = _reference_padded(lp.detach(), s, adv, m, positions, sample_ids)
    n = len(ref["learner"])
    col = (lambda k, dt: torch.tensor([float(v) for v in ref[k]], dtype=dt) if n else torch.zeros(0, dtype=dt))
    learner, sampler = col("learner", dtype), col("sampler", dtype)
    advantage = col("advantage", dtype if dtype.is_floating_point else torch.float32)
    codes = invalid_codes(learner, sampler, advantage) if n else torch.zeros(0, dtype=torch.long)
    ok = codes < 0
    kwargs = dict(positions=positions, sample_ids=sample_ids)
    if bool(ok.all()):
        b = TokenBatch.from_padded(lp, s, adv, m, **kwargs)
        assert b.quarantine_counts == {} and b.quarantine_rows is None
    else:
        b = TokenBatch.from_padded(lp, s, adv, m, on_invalid="quarantine", **kwargs)
        want = {INVALID_REASONS[c]: int((codes == c).sum()) for c in range(len(INVALID_REASONS))
                if int((codes == c).sum())}
        assert b.quarantine_counts == want
        assert sorted(b.quarantine_rows["reason"].tolist()) == sorted(codes[~ok].tolist())
        # the first invalid token in row order (rows by index, not by sample id) is the one the error names
        order = sorted(range(n), key=lambda i: (ref["source"][i] // T, ref["source"][i]))
        first = next(i for i in order if not ok[i])
        with pytest.raises(InvalidTokenError) as err:
            TokenBatch.from_padded(lp, s, adv, m, **kwargs)
        assert err.value.reason == INVALID_REASONS[int(codes[first])]
        assert (err.value.sample, err.value.position) == (ref["source"][first] // T, ref["position"][first])
        assert err.value.count == int((~ok).sum())
    keep = ok.nonzero().squeeze(1).tolist()
    pick = (lambda t: t[keep] if keep else t[:0])
    bits = (lambda t: t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]))
    assert torch.equal(bits(b.learner_logp.detach()), bits(pick(learner))) and b.learner_logp.dtype == dtype
    assert b.learner_logp.requires_grad == lp.requires_grad
    assert torch.equal(bits(b.sampler_logp), bits(pick(sampler)))
    assert torch.equal(bits(b.advantage), bits(pick(advantage))) and b.advantage.dtype == advantage.dtype
    assert b.sample_index.tolist() == [ref["rank"][i] for i in keep]
    assert b.position.tolist() == [ref["position"][i] for i in keep]
    assert b._source_index.tolist() == [ref["source"][i] for i in keep]
    assert b.num_valid.tolist() == [sum(1 for i in keep if ref["rank"][i] == r) for r in range(B)]
    assert b.sample_id.tolist() == (sorted(sample_ids.tolist()) if sample_ids is not None else list(range(B)))
    left = sum(1 for r in range(B) if bool(m[r].any()) and not bool(m[r, 0])) if T else 0
    assert b.offset_responses == (left if positions is None else 0)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_from_padded_equals_a_token_by_token_reference_and_its_checks_equal_the_full_check(dtype, compiled,
                                                                                         monkeypatch):
    """``from_padded`` against a plain-Python reference on random batches of each dtype, through the compiled CPU
    gather (float32 / float64) and through the torch operations (``COMPILED_ON_CPU`` off: what an accelerator
    runs, and float16 / bfloat16 always), with and without a gradient on the learner log-probs (0-9 columns, random masks
    with empty and left-padded rows, per-sample / per-token / column advantages, given positions and shuffled
    sample ids): the kept tokens are bit-identical, in the same order, with the same rows, positions and scatter
    map; the quarantine counts, rows and reasons equal those of ``invalid_codes`` (the full element-wise check)
    token by token, and with ``on_invalid="raise"`` the error names the first invalid token in row order with its
    reason and the count.  200 random batches (half without an invalid value, half with several), then every bound
    of the value checks and the floats next to it in ``dtype``, alone in an otherwise valid batch, in each of the
    three fields: the fast min/max check must send each invalid one to the full check and let the valid ones by."""
    from triage_monitor import batch as batch_module

    monkeypatch.setattr(batch_module, "COMPILED_ON_CPU", compiled)
    g = torch.Generator().manual_seed(27)
    for case in range(200):
        B, T = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(0, 10, (1,), generator=g))
        p = 0.08 if case % 2 == 0 else 0.0
        lp = _edge_values(dtype, B * T, g, p).reshape(B, T)
        s = _edge_values(dtype, B * T, g, p).reshape(B, T)
        m = torch.rand(B, T, generator=g) < 0.7
        if case % 5 == 0 and T:
            m[0, :T // 2] = False                                           # a left-padded row
        form = case % 3
        adv = (torch.randn(B, generator=g) if form == 0 else torch.randn(B, T, generator=g) if form == 1
               else torch.randn(B, 1, generator=g)).to(dtype)
        if case % 4 == 0 and adv.numel():
            adv.view(-1)[0] = float("nan")
        # given positions rise along each row (left padding: the column minus the row's offset, or gaps)
        positions = torch.randint(1, 4, (B, T), generator=g).cumsum(1) - 1 if case % 7 == 0 else None
        sample_ids = torch.randperm(B, generator=g) * 3 if case % 3 == 0 else None
        if case % 6 == 1:
            lp.requires_grad_(True)                     # the learner's gather keeps the graph (torch indexing)
        _check_from_padded(lp, s, adv, m, positions, sample_ids)
    edges = torch.tensor(_EDGE_LOGPS, dtype=torch.float64).to(dtype)
    edges = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, math.inf)),
                       torch.nextafter(edges, torch.full_like(edges, -math.inf))])
    m = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    for value in edges.tolist():
        for field in range(3):
            lp, s = -torch.rand(3, 4, generator=g).to(dtype), -torch.rand(3, 4, generator=g).to(dtype)
            adv = torch.randn(3, generator=g).to(dtype)
            (lp, s, adv)[field].view(-1)[1] = value                        # row 0, column 1 (or row 1's advantage)
            _check_from_padded(lp, s, adv, m, None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_fast_value_check_on_the_cpu_and_on_a_device_agree_with_the_full_check(dtype):
    """The batch's fast check from min and max, as the CPU computes it (six floats against the bounds rounded to the
    dtype) and as an accelerator does (tensor comparisons, one synchronisation), gives the same answer at every bound
    and next to it, in each field; True only when the element-wise check (``invalid_codes``) finds no invalid token,
    and True for every valid value above the largest exact sentinel (−9,984 nats: at or below it the full check
    decides, as a value there may be a fill value)."""
    from triage_monitor.batch import _all_valid, _all_valid_tensors, invalid_codes

    edges = torch.tensor(_EDGE_LOGPS, dtype=torch.float64).to(dtype)
    edges = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, math.inf)),
                       torch.nextafter(edges, torch.full_like(edges, -math.inf))])
    for value in edges.tolist():
        for field in range(3):
            tensors = [torch.tensor([-0.5, -1.0, -2.0], dtype=dtype) for _ in range(3)]
            tensors[field][1] = value
            valid = bool((invalid_codes(*tensors) < 0).all())
            fast = _all_valid(*tensors)
            assert fast == _all_valid_tensors([torch.aminmax(t) for t in tensors]), (value, field)
            assert fast <= valid and fast == (valid and (field == 2 or value > -9984.0)), (value, field)


def test_one_host_copy_a_step_shared_by_the_metrics_and_the_writer(tmp_path, monkeypatch):
    """log_step copies a batch's tokens to the host once (TokenBatch.host), for the metrics and the record writer
    alike, and a later step copies its own (the cache never outlives the step); the packed copy of a batch off the
    CPU is bit-identical to each column's .float().cpu() (checked here on a meta-free path: the pack and unpack of
    CPU tensors of mixed dtypes)."""
    import triage_monitor.batch as batch_mod
    from triage_monitor import MismatchMonitor, MonitorConfig

    copies = []
    real = batch_mod.TokenBatch.host

    def counted(self):
        if self._host is None:
            copies.append(self.num_tokens)
        return real(self)

    monkeypatch.setattr(batch_mod.TokenBatch, "host", counted)
    g = torch.Generator().manual_seed(0)
    mon = MismatchMonitor(tmp_path / "run", MonitorConfig(window=2, tau_tail=-1.0))
    for step, n in enumerate((5, 7)):
        s = -torch.rand(3, n, generator=g)
        b = TokenBatch.from_padded(s - 0.1 * torch.rand(3, n, generator=g), s, torch.tensor([1.0, -1.0, 0.5]),
                                   torch.ones(3, n))
        mon.log_step(step, b)
    mon.close()
    assert copies == [15, 21]
    cols = [torch.tensor([-1.5, -0.25], dtype=torch.float32), torch.tensor([3, 9], dtype=torch.int64),
            torch.tensor([-2.0, 0.5, 7.0], dtype=torch.bfloat16).float()]
    back = batch_mod._unpack(batch_mod._pack(cols), cols)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(cols, back))
