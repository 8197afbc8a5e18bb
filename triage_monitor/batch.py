"""TokenBatch: one step's valid tokens in the canonical flat layout.

Every framework lays its per-token tensors out differently (docs/hooks.md):
padded ``(B, T)`` with a loss mask, packed 1-D with ``cu_seqlens``, or a list
of 1-D per-sample tensors.  :class:`TokenBatch` turns each of them into one
flat layout that metrics, records and the controller share:

* ``N`` valid (masked-in) tokens, ordered by sample then position;
* ``S`` responses (samples), ordered by ``sample_id``;
* per token: ``learner_logp``, ``sampler_logp``, ``advantage`` (float, nats
  for the log-probs), ``sample_index`` (int64 in ``[0, S)``) and ``position``
  (zero-based index inside the response *before* masking, docs/metrics.md#terms);
* per sample: ``sample_id``, ``group_id`` (int64) and ``num_valid`` (n_i).

The batch remembers where each flat token came from, so per-token results
(Gate weights, ...) can be scattered back to the caller's layout with
:meth:`TokenBatch.scatter`.

Validation follows docs/reliability.md: shapes, dtypes and devices are checked with
errors naming the argument and the shapes; invalid values (non-finite or
positive log-probs, padding sentinels, non-finite advantages) either raise a
:class:`InvalidTokenError` naming the field, the sample, the position and the
value (``on_invalid="raise"``, the default) or are quarantined
(``on_invalid="quarantine"``): excluded from the flat tokens, counted in
:attr:`TokenBatch.quarantine_counts` and kept visible in
:attr:`TokenBatch.quarantine_rows` for the records.  Nothing is silently
neutralised.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
from numba import njit

from .errors import TriageMonitorError

Tensor = torch.Tensor

#: A log-probability above this is impossible (log p <= 0); the slack allows
#: for bf16 rounding of log p = 0.
POSITIVE_LOGP_TOLERANCE = 1e-3
#: A finite log-prob at or below this (nats) is read as a fill value, not as a log-probability: −1e9 (TRL's pad
#: when it gathers per-token values across ranks), −1e10, −1e20, the dtype minimum that verl and transformers
#: write into attention masks (float32 −3.4028e38, bfloat16 −3.3895e38, float64 −1.798e308), and a log-softmax
#: over logits masked with any of them.  A real log-softmax has no floor (``torch.log_softmax([0, 1500])`` gives
#: exactly −1500: a learner that has diverged), but no trained model puts 10⁸ nats between two logits.
SENTINEL_LOGP_BELOW = -1e8
#: Exact fill values above :data:`SENTINEL_LOGP_BELOW`: −9999.0 (what vLLM's OpenAI-compatible server writes
#: for a −inf log-prob) and −65504.0 (the float16 minimum).  They are matched exactly, also as rounded to
#: float16 / bfloat16 (:data:`SENTINEL_LOGP_EXACT`), so a real log-prob next to them (−9998.5) stays valid.
SENTINEL_LOGP_VALUES = (-9999.0, -65504.0)


def _rounded_sentinels() -> tuple[float, ...]:
    """:data:`SENTINEL_LOGP_VALUES` and their roundings to each float dtype above :data:`SENTINEL_LOGP_BELOW`,
    sorted."""
    out = set()
    for v in SENTINEL_LOGP_VALUES:
        for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            r = float(torch.tensor(v, dtype=dt))
            if r > SENTINEL_LOGP_BELOW and r != float("-inf"):
                out.add(r)
    return tuple(sorted(out))


#: :data:`SENTINEL_LOGP_VALUES` and their float16 / bfloat16 roundings (−10000, −9999, −9984, −65536, −65504).
SENTINEL_LOGP_EXACT = _rounded_sentinels()

INVALID_REASONS = (
    "nonfinite_learner_logp",
    "nonfinite_sampler_logp",
    "positive_learner_logp",
    "positive_sampler_logp",
    "sentinel_learner_logp",
    "sentinel_sampler_logp",
    "nonfinite_advantage",
)


class InvalidTokenError(TriageMonitorError, ValueError):
    """A valid (masked-in) token carries an impossible value (docs/reliability.md).

    Attributes: ``field`` (argument name), ``sample`` (caller's row / sample
    index; the ``sample_id`` for :meth:`TokenBatch.from_flat`), ``position`` (token position inside the response), ``value``
    (the offending float) and ``reason`` (one of :data:`INVALID_REASONS`).
    """

    def __init__(self, field: str, sample: int, position: int, value: float, reason: str, count: int):
        self.field, self.sample, self.position, self.value, self.reason, self.count = (
            field, sample, position, value, reason, count)
        super().__init__(
            f"{field}[sample={sample}, position={position}] = {value!r}: {reason.replace('_', ' ')} "
            f"({count} such token(s) in this batch; pass on_invalid='quarantine' to exclude and count them)")


@dataclass(frozen=True)
class SourceLayout:
    """The caller's layout a :class:`TokenBatch` was built from (for :meth:`TokenBatch.scatter` / ``gather``).

    Attributes:
        kind: ``"padded"`` | ``"packed"`` | ``"list"`` | ``"flat"``.
        size: elements of the caller's flattened tensor (``B·T``, ``N_total``; 0 for ``flat``).
        shape: ``(B, T)`` for ``padded``, the per-sample lengths for ``list``.
    """

    kind: str
    size: int = 0
    shape: Optional[tuple[int, ...]] = None


class HostTokens(NamedTuple):
    """A :class:`TokenBatch`'s columns on the host (:meth:`TokenBatch.host`): float32 ``(N,)`` log-probs (nats) and
    advantages, int64 ``(N,)`` sample_index / position, int64 ``(S,)`` sample_id / group_id, CPU tensors."""

    learner_logp: Tensor
    sampler_logp: Tensor
    advantage: Tensor
    sample_index: Tensor
    position: Tensor
    sample_id: Tensor
    group_id: Tensor

    @property
    def delta(self) -> Tensor:
        """``(N,)`` float32 δ = learner − sampler (the same IEEE subtraction as :attr:`TokenBatch.delta`)."""
        return self.learner_logp - self.sampler_logp


def _pack(cols: Sequence[Tensor]) -> Tensor:
    """The columns' bytes, concatenated into one contiguous uint8 tensor on their device."""
    return torch.cat([c.contiguous().reshape(-1).view(torch.uint8) for c in cols])


def _unpack(buf: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split a :func:`_pack` buffer (now on the host) back into tensors of the dtypes and lengths of ``like``."""
    out, at = [], 0
    for c in like:
        n = c.numel() * c.element_size()
        out.append(buf[at:at + n].view(c.dtype).reshape(c.shape))
        at += n
    return out


@dataclass
class TokenBatch:
    """One step's valid tokens, flat (see module docstring).

    Attributes (N valid tokens, S samples):
        learner_logp: ``(N,)`` float, nats.  Keeps the caller's dtype and
            autograd graph, so the controller's Repair term can back-propagate.
        sampler_logp: ``(N,)`` float, nats, detached.
        advantage: ``(N,)`` float, detached (per-sample advantages broadcast).
        sample_index: ``(N,)`` int64 in ``[0, S)``.
        position: ``(N,)`` int64, position inside the response before masking.
        sample_id: ``(S,)`` int64, unique within the step, ascending.
        group_id: ``(S,)`` int64 (prompt / GRPO group); ``-1`` when unknown.
        num_valid: ``(S,)`` int64, valid tokens per sample (n_i); can be 0.
        quarantine_counts: counts of quarantined tokens per reason.
        quarantine_rows: ``dict`` of flat tensors (sample_id, position,
            learner_logp, sampler_logp, advantage, reason code) of the
            quarantined tokens, for the records.
        offset_responses: responses of a :meth:`from_padded` batch built without ``positions=`` whose
            first unmasked token (quarantined tokens included) is not in column 0: the sign of left
            padding or a prompt kept in the tensor (docs/reliability.md).  0 for the other layouts, whose
            positions are response-relative by construction (a masked leading span there is a real
            masked span), and for explicit positions.
    """

    learner_logp: Tensor
    sampler_logp: Tensor
    advantage: Tensor
    sample_index: Tensor
    position: Tensor
    sample_id: Tensor
    group_id: Tensor
    num_valid: Tensor
    quarantine_counts: dict = field(default_factory=dict)
    quarantine_rows: Optional[dict] = None
    offset_responses: int = 0
    # where each flat token sits in the caller's flattened layout, and what that layout was
    _source_index: Optional[Tensor] = None
    _layout: "SourceLayout" = field(default_factory=lambda: SourceLayout("flat"))
    # the step's token columns on the host (:meth:`host`), copied once and shared by the metrics and the writer
    _host: Optional["HostTokens"] = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        """N, the number of valid tokens."""
        return int(self.learner_logp.shape[0])

    @property
    def num_samples(self) -> int:
        """S, the number of responses."""
        return int(self.sample_id.shape[0])

    @property
    def device(self) -> torch.device:
        return self.learner_logp.device

    def host(self) -> "HostTokens":
        """The batch's token columns on the host, copied once per batch (cached) and shared by the metrics and the
        record writer.

        A CPU batch's columns are returned as they are (``learner_logp`` detached and, like the others, as
        float32).  A batch on another device is packed into one byte buffer there and copied to the host in one
        transfer (one synchronisation a step); the float32 values are bit-identical to ``.float().cpu()`` of each.

        Returns:
            :class:`HostTokens`: float32 ``(N,)`` learner / sampler log-probs and advantages (nats), int64 ``(N,)``
            sample_index and position, int64 ``(S,)`` sample_id and group_id, all CPU tensors.
        """
        if self._host is None:
            cols = (self.learner_logp.detach().float(), self.sampler_logp.detach().float(),
                    self.advantage.detach().float(), self.sample_index.long(), self.position.long(),
                    self.sample_id.long(), self.group_id.long())
            if all(c.device.type == "cpu" for c in cols):
                self._host = HostTokens(*cols)
            else:
                self._host = HostTokens(*_unpack(_pack(cols).cpu(), cols))
        return self._host

    @property
    def delta(self) -> Tensor:
        """``(N,)`` float32, detached: δ = learner_logp − sampler_logp (nats, docs/metrics.md#terms)."""
        return self.learner_logp.detach().float() - self.sampler_logp.float()

    def detach(self) -> "TokenBatch":
        """A copy whose ``learner_logp`` carries no autograd graph."""
        out = TokenBatch(**{k: getattr(self, k) for k in self.__dataclass_fields__ if k != "_host"})
        out.learner_logp = self.learner_logp.detach()
        return out                  # without the host copy: the monitor detaches each step, so each step copies once

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "TokenBatch":
        """Move every tensor (not the scatter map's meaning) to ``device``."""
        kw: dict[str, Any] = {}
        for k in self.__dataclass_fields__:
            v = getattr(self, k)
            kw[k] = v.to(device, non_blocking=non_blocking) if isinstance(v, Tensor) else v
        return TokenBatch(**kw)

    # ---------------------------------------------------------------- scatter
    def _source_map(self) -> Tensor:
        """``(N,)`` int64: where each valid token sits in the caller's flattened layout (set by every layout
        constructor but :meth:`from_flat`; read for the other layouts only)."""
        index = self._source_index
        assert index is not None, f"a {self._layout.kind!r} batch without its source index"
        return index

    def _layout_shape(self) -> tuple[int, ...]:
        """The caller's ``(B, T)`` (padded) or per-sample lengths (list): :attr:`SourceLayout.shape`, set for both."""
        shape = self._layout.shape
        assert shape is not None, f"a {self._layout.kind!r} batch without its source shape"
        return shape

    def scatter(self, values: Tensor, fill: float = 0.0) -> Union[Tensor, list[Tensor]]:
        """Scatter per-token ``values`` ``(N,)`` back to the caller's layout.

        Returns a ``(B, T)`` tensor for :meth:`from_padded`, an ``(N_total,)``
        tensor for :meth:`from_packed`, a list of 1-D tensors for
        :meth:`from_list`, and ``values`` itself for :meth:`from_flat`.
        Positions that held no valid token get ``fill``.  Differentiable.

        Raises:
            ValueError: ``values`` is not of shape ``(N,)``.
        """
        if values.shape != (self.num_tokens,):
            raise ValueError(f"scatter: values has shape {tuple(values.shape)}, expected ({self.num_tokens},)")
        kind = self._layout.kind
        if kind == "flat":
            return values
        out = torch.full((self._layout.size,), fill, dtype=values.dtype, device=values.device)
        out = out.index_put((self._source_map().to(values.device),), values)
        if kind == "padded":
            return out.view(self._layout_shape())
        if kind == "packed":
            return out
        return list(torch.split(out, list(self._layout_shape())))

    def gather(self, values: Union[Tensor, Sequence[Tensor]]) -> Tensor:
        """Read a tensor laid out like the caller's input at the batch's valid tokens: ``(N,)``.

        The inverse of :meth:`scatter`: ``values`` has the shape the batch was
        built from (``(B, T)``, ``(N_total,)``, a list of 1-D tensors, or
        ``(N,)`` for :meth:`from_flat`); the result is in the batch's flat
        order (e.g. the caller's old log-probs for PPO).  Differentiable.

        Raises:
            ValueError: ``values`` does not have the caller's layout size.
        """
        if isinstance(values, (list, tuple)):
            values = torch.cat(list(values))
        assert isinstance(values, Tensor)
        if self._layout.kind == "flat":
            if values.shape != (self.num_tokens,):
                raise ValueError(f"gather: values has shape {tuple(values.shape)}, expected ({self.num_tokens},)")
            return values
        flat = values.reshape(-1)
        if flat.numel() != self._layout.size:
            raise ValueError(f"gather: values has {flat.numel()} elements, the batch was built from {self._layout.size}")
        return torch.index_select(flat, 0, self._source_map().to(values.device))     # 1-D: ~4x faster than flat[i]

    # ----------------------------------------------------------- constructors
    @classmethod
    def cat(cls, parts: Sequence["TokenBatch"]) -> "TokenBatch":
        """One flat :class:`TokenBatch` holding the micro-batches ``parts`` of one step, in order.

        Tokens, per-sample ``group_id`` / ``num_valid`` (responses without valid tokens included) and the
        quarantine counts and rows are concatenated; sample ids are renumbered ``0 … S−1`` over the parts
        (a running sample counter, so equal row indices of two micro-batches stay distinct responses).
        ``group_id`` is taken as given: it must mean the same prompt in every part (e.g. a rollout-wide
        prompt index), or be −1.  Built field by field rather than via ``from_flat``: the parts are
        validated and in canonical order already, and ``from_flat`` would drop zero-token responses.
        ``learner_logp`` is detached.

        Raises:
            ValueError: ``parts`` is empty.
        """
        if not parts:
            raise ValueError("TokenBatch.cat: no batches to concatenate")
        counts = [b.num_samples for b in parts]
        offsets = [0, *accumulate(counts)][:-1]
        cat = lambda name: torch.cat([getattr(b, name) for b in parts])  # noqa: E731
        quarantine: Counter = Counter()
        rows = []
        for b, off in zip(parts, offsets):
            quarantine.update(b.quarantine_counts)
            if b.quarantine_rows is not None:             # caller's sample ids → merged ids (rank in the part + offset)
                q = dict(b.quarantine_rows)
                q["sample_id"] = torch.searchsorted(b.sample_id.cpu(), q["sample_id"]) + int(off)
                rows.append(q)
        quarantined = {k: torch.cat([q[k] for q in rows]) for k in rows[0]} if rows else None
        dev = parts[0].device
        return cls(
            learner_logp=torch.cat([b.learner_logp.detach() for b in parts]), sampler_logp=cat("sampler_logp"),
            advantage=cat("advantage"), position=cat("position"),
            sample_index=torch.cat([b.sample_index + int(off) for b, off in zip(parts, offsets)]),
            sample_id=torch.arange(sum(counts), device=dev), group_id=cat("group_id"), num_valid=cat("num_valid"),
            quarantine_counts=dict(quarantine), quarantine_rows=quarantined,
            offset_responses=sum(b.offset_responses for b in parts))

    @classmethod
    def from_padded(
        cls,
        learner_logp: Tensor,
        sampler_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        sample_ids: Optional[Tensor] = None,
        group_ids: Optional[Tensor] = None,
        positions: Optional[Tensor] = None,
        on_invalid: str = "raise",
    ) -> "TokenBatch":
        """Build from padded ``(B, T)`` tensors (verl, TRL, OpenRLHF, SkyRL, NeMo RL).

        Args:
            learner_logp, sampler_logp: ``(B, T)`` float log-probs (nats).
            advantages: ``(B, T)`` per token or ``(B,)`` per sample (GRPO).
            mask: ``(B, T)`` bool or 0/1 loss mask (1 = token carries loss).
                Padded positions must be masked out; their values are never read.
            sample_ids, group_ids: optional ``(B,)`` int ids (default: row index, -1).
            positions: optional ``(B, T)`` int positions; default is the column
                index, right for right-padded response tensors.  Pass positions
                for left-padded layouts.
            on_invalid: ``"raise"`` or ``"quarantine"`` (see module docstring).

        Raises:
            ValueError: shapes, dtypes or devices disagree (the message names
                the argument and the shapes); InvalidTokenError on bad values.
        """
        _check_float("learner_logp", learner_logp)
        _check_float("sampler_logp", sampler_logp)
        if learner_logp.dim() != 2:
            raise ValueError(f"learner_logp must be (B, T), got shape {tuple(learner_logp.shape)}")
        B, T = learner_logp.shape
        _check_shape("sampler_logp", sampler_logp, (B, T), "learner_logp")
        mask = _check_mask("mask", mask, (B, T), "learner_logp")
        _check_same_device(learner_logp, sampler_logp=sampler_logp, advantages=advantages, mask=mask)
        default_positions = positions is None
        if not default_positions:
            _check_shape("positions", positions, (B, T), "learner_logp")
        adv = _advantage_source(advantages, B, T)
        dev = learner_logp.device
        fast = _gather_padded(learner_logp, sampler_logp, adv, mask, positions)
        if fast is not None:                # the CPU's one compiled pass: the same tokens, rows, positions, values
            learner, sampler, adv_tokens, rows, pos, source, counts = fast
            offset = int(((counts > 0) & ~mask[:, 0]).sum()) if default_positions and T else 0
            return cls._build(
                learner, sampler, adv_tokens, rows, pos, B, sample_ids, group_ids, on_invalid, source,
                SourceLayout("padded", B * T, (B, T)), offset=offset, num_valid=counts,
                positions_nonnegative=default_positions)
        # the valid tokens' flat indices (row-major: grouped by row, ascending), each one's row and column from its
        # index (no (B, T) row / position / advantage tensor is built), and each row's count from where its
        # tokens start among them
        source = torch.nonzero(mask.reshape(-1), as_tuple=False).squeeze(1)
        if T:
            rows = torch.div(source, T, rounding_mode="floor")
            pos = source % T if positions is None else positions.reshape(-1)[source].long()
            counts = torch.diff(torch.searchsorted(source, torch.arange(0, (B + 1) * T, T, device=dev)))  # per row
        else:                                                               # no column, no token
            rows = pos = source
            counts = torch.zeros(B, dtype=torch.long, device=dev)
        adv_tokens = adv.reshape(-1)[source] if tuple(adv.shape) == (B, T) else adv.reshape(-1)[rows]
        # left padding without positions=: a row whose first unmasked column is not 0 (read before quarantine,
        # so a bad token in column 0 is not mistaken for padding)
        offset = int(((counts > 0) & ~mask[:, 0]).sum()) if default_positions and T else 0
        return cls._build(
            learner_logp.reshape(-1)[source], sampler_logp.reshape(-1)[source], adv_tokens, rows, pos, B,
            sample_ids, group_ids, on_invalid, source, SourceLayout("padded", B * T, (B, T)), offset=offset,
            num_valid=counts, positions_nonnegative=default_positions)

    @classmethod
    def from_packed(
        cls,
        learner_logp: Tensor,
        sampler_logp: Tensor,
        advantages: Tensor,
        cu_seqlens: Tensor,
        mask: Optional[Tensor] = None,
        *,
        sample_ids: Optional[Tensor] = None,
        group_ids: Optional[Tensor] = None,
        on_invalid: str = "raise",
    ) -> "TokenBatch":
        """Build from packed 1-D tensors with ``cu_seqlens`` (varlen / remove-padding layouts).

        Args:
            learner_logp, sampler_logp: ``(N_total,)`` float log-probs (nats).
            advantages: ``(N_total,)`` per token or ``(S,)`` per sample.
            cu_seqlens: ``(S + 1,)`` int cumulative lengths, starting at 0 and
                ending at ``N_total``; position = index − ``cu_seqlens[s]``.
            mask: optional ``(N_total,)`` loss mask (default: all tokens valid).

        Raises:
            ValueError: malformed ``cu_seqlens`` or shapes; InvalidTokenError.
        """
        _check_float("learner_logp", learner_logp)
        _check_float("sampler_logp", sampler_logp)
        if learner_logp.dim() != 1:
            raise ValueError(f"learner_logp must be 1-D packed (N_total,), got shape {tuple(learner_logp.shape)}")
        n_total = learner_logp.shape[0]
        _check_shape("sampler_logp", sampler_logp, (n_total,), "learner_logp")
        cu = torch.as_tensor(cu_seqlens, device=learner_logp.device)
        if torch.is_floating_point(cu):
            raise TypeError(f"cu_seqlens must be an integer tensor, got dtype {cu.dtype}")
        cu = cu.long()
        if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != n_total or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to N_total={n_total}, got {cu.tolist()[:8]}...")
        S = cu.numel() - 1
        lengths = cu[1:] - cu[:-1]
        rows = torch.repeat_interleave(torch.arange(S, device=cu.device), lengths)
        pos = torch.arange(n_total, device=cu.device) - cu[:-1][rows]
        if mask is None:
            mask = torch.ones(n_total, dtype=torch.bool, device=learner_logp.device)
        mask = _check_mask("mask", mask, (n_total,), "learner_logp")
        _check_same_device(learner_logp, sampler_logp=sampler_logp, advantages=advantages, mask=mask)
        adv = torch.as_tensor(advantages)
        if adv.shape == (S,) and S != n_total:
            adv = adv[rows]
        elif adv.shape != (n_total,):
            raise ValueError(f"advantages must be ({n_total},) per token or ({S},) per sample, got {tuple(adv.shape)}")
        source = torch.nonzero(mask, as_tuple=False).squeeze(1)
        return cls._build(
            learner_logp[source], sampler_logp[source], adv[source], rows[source], pos[source], S,
            sample_ids, group_ids, on_invalid, source, SourceLayout("packed", n_total))

    @classmethod
    def from_list(
        cls,
        learner_logp: Sequence[Tensor],
        sampler_logp: Sequence[Tensor],
        advantages: Union[Sequence[Tensor], Sequence[float], Tensor],
        masks: Optional[Sequence[Tensor]] = None,
        *,
        sample_ids: Optional[Tensor] = None,
        group_ids: Optional[Tensor] = None,
        on_invalid: str = "raise",
    ) -> "TokenBatch":
        """Build from lists of 1-D per-sample tensors (slime, prime-rl).

        Args:
            learner_logp, sampler_logp: ``S`` tensors of shape ``(L_i,)``.
            advantages: ``S`` tensors ``(L_i,)``, or ``S`` scalars / ``(S,)`` tensor.  A ``(S,)`` tensor keeps
                its float dtype (as in :meth:`from_padded`); scalars and per-token sequences become float32.
            masks: optional ``S`` loss masks ``(L_i,)``.

        Raises:
            TypeError: an element is not a floating-point tensor (the message names it).
            ValueError: list lengths or per-sample shapes disagree; InvalidTokenError.
        """
        S = len(learner_logp)
        if len(sampler_logp) != S:
            raise ValueError(f"sampler_logp has {len(sampler_logp)} samples, learner_logp has {S}")
        for i, (a, b) in enumerate(zip(learner_logp, sampler_logp)):
            _check_float(f"learner_logp[{i}]", a)
            _check_float(f"sampler_logp[{i}]", b)
            _check_not_meta(f"learner_logp[{i}]", a)
            _check_not_meta(f"sampler_logp[{i}]", b)
            if a.dim() != 1 or b.shape != a.shape:
                raise ValueError(f"sample {i}: learner_logp shape {tuple(a.shape)} and sampler_logp shape "
                                 f"{tuple(b.shape)} must be equal and 1-D")
        lengths = [int(t.shape[0]) for t in learner_logp]
        if isinstance(advantages, Tensor) and advantages.dim() == 1 and advantages.shape[0] == S:
            adv_list = [advantages[i].expand(lengths[i]) for i in range(S)]
        elif len(advantages) == S:
            adv_list = []
            for i, a in enumerate(advantages):
                a = torch.as_tensor(a, dtype=torch.float32)
                if a.dim() == 0:
                    a = a.expand(lengths[i])
                if a.shape != (lengths[i],):
                    raise ValueError(f"advantages[{i}] has shape {tuple(a.shape)}, expected ({lengths[i]},) or a scalar")
                adv_list.append(a)
        else:
            raise ValueError(f"advantages must hold {S} entries, got {len(advantages)}")
        if masks is not None:
            if len(masks) != S:
                raise ValueError(f"masks has {len(masks)} samples, learner_logp has {S}")
            for i, m in enumerate(masks):
                if tuple(m.shape) != (lengths[i],):
                    raise ValueError(f"masks[{i}] has shape {tuple(m.shape)}, expected ({lengths[i]},)")
            mask = torch.cat([torch.as_tensor(m) for m in masks]) if S else torch.zeros(0, dtype=torch.bool)
        else:
            mask = None
        dev = learner_logp[0].device if S else torch.device("cpu")
        cu = torch.tensor([0] + lengths, device=dev).cumsum(0)
        cat = (lambda ts: torch.cat(list(ts)) if S else torch.zeros(0))
        batch = cls.from_packed(cat(learner_logp), cat(sampler_logp), cat(adv_list).to(dev), cu,
                                None if mask is None else mask.to(dev),
                                sample_ids=sample_ids, group_ids=group_ids, on_invalid=on_invalid)
        return dataclasses.replace(batch, _layout=SourceLayout("list", batch._layout.size, tuple(lengths)))

    @classmethod
    def from_flat(
        cls,
        learner_logp: Tensor,
        sampler_logp: Tensor,
        advantage: Tensor,
        sample_id: Tensor,
        position: Tensor,
        *,
        group_id: Optional[Tensor] = None,
        on_invalid: str = "raise",
    ) -> "TokenBatch":
        """Build from flat token rows, as stored in the Parquet records.

        Args: all ``(N,)``: log-probs (nats), advantage, ``sample_id`` (int64)
        and ``position`` (int64) per token; ``group_id`` per token or None.
        Rows may come in any order; the batch sorts them by (sample_id, position).

        Raises:
            ValueError: shapes disagree or a (sample_id, position) pair repeats; InvalidTokenError
                (its ``sample`` is the ``sample_id``).
        """
        _check_not_meta("learner_logp", learner_logp)
        _check_not_meta("sampler_logp", sampler_logp)
        n = learner_logp.shape[0]
        for name, t in (("sampler_logp", sampler_logp), ("advantage", advantage), ("sample_id", sample_id),
                        ("position", position)):
            _check_shape(name, t, (n,), "learner_logp")
        sid = sample_id.long()
        pos = position.long()
        uniq, inverse = torch.unique(sid, sorted=True, return_inverse=True)
        order = _order_by_row_then_position(inverse, pos)
        r, p = inverse[order], pos[order]
        if n > 1 and bool(((r[1:] == r[:-1]) & (p[1:] == p[:-1])).any()):
            raise ValueError("from_flat: a (sample_id, position) pair occurs twice")
        gid = None
        if group_id is not None:
            g = torch.full((uniq.numel(),), -1, dtype=torch.long)
            g[inverse] = group_id.long()
            gid = g
        return cls._build(learner_logp[order], sampler_logp[order], advantage[order], inverse[order], pos[order],
                          uniq.numel(), uniq, gid, on_invalid, None, SourceLayout("flat"), presorted=True)

    # ------------------------------------------------------------------ core
    @classmethod
    def _build(cls, learner, sampler, adv, rows, pos, num_rows, sample_ids, group_ids, on_invalid, source, layout,
               presorted: bool = False, offset: int = 0, num_valid: Optional[Tensor] = None,
               positions_nonnegative: bool = False) -> "TokenBatch":
        """The batch of the gathered tokens ``(N,)`` (rows ascending, positions ascending within a row): ids, the
        value validation and quarantine, the canonical order.  ``num_valid``: the tokens per row when the caller
        has counted them (used while no token is quarantined and the order stays); ``positions_nonnegative``:
        the positions are column indices (no check needed)."""
        if on_invalid not in ("raise", "quarantine"):
            raise ValueError(f"on_invalid must be 'raise' or 'quarantine', got {on_invalid!r}")
        dev = learner.device
        sampler = sampler.detach()
        adv = adv.detach().to(dev)
        if not torch.is_floating_point(adv):
            adv = adv.float()
        ids = (torch.arange(num_rows, device=dev) if sample_ids is None
               else torch.as_tensor(sample_ids, device=dev).long().reshape(-1))
        if ids.shape != (num_rows,):
            raise ValueError(f"sample_ids must have shape ({num_rows},), got {tuple(ids.shape)}")
        gids = (torch.full((num_rows,), -1, dtype=torch.long, device=dev) if group_ids is None
                else torch.as_tensor(group_ids, device=dev).long().reshape(-1))
        if gids.shape != (num_rows,):
            raise ValueError(f"group_ids must have shape ({num_rows},), got {tuple(gids.shape)}")
        # segments are cut by position: a negative one corrupts them
        if not positions_nonnegative and pos.numel() and int(pos.min()) < 0:
            i = int(torch.argmin(pos))
            raise ValueError(f"positions must be >= 0 (index inside the response), got {int(pos[i])} "
                             f"for a valid token of sample {int(rows[i])}")

        # --- value validation (docs/reliability.md): one min/max pass per field, reasons only when something is wrong ---
        ld = learner.detach()
        counts = {}
        quarantined = None
        # None: every token valid (the usual case, no full check)
        codes = invalid_codes(ld, sampler, adv) if not _all_valid(ld, sampler, adv) else None
        if codes is not None and bool((bad := codes >= 0).any()):
            for c, name in enumerate(INVALID_REASONS):
                n = int((codes == c).sum())
                if n:
                    counts[name] = n
            first = int(torch.nonzero(bad)[0])
            reason = INVALID_REASONS[int(codes[first])]
            if on_invalid == "raise":
                fld = {"learner": "learner_logp", "sampler": "sampler_logp", "advantage": "advantages"}[
                    reason.split("_")[1] if "logp" in reason else "advantage"]
                val = {"learner_logp": learner, "sampler_logp": sampler, "advantages": adv}[fld][first]
                # the caller's sample: its row / list index, or its sample_id for flat rows (from_flat)
                sample = int(ids[rows[first]]) if layout.kind == "flat" else int(rows[first])
                raise InvalidTokenError(fld, sample, int(pos[first]), float(val), reason, int(bad.sum()))
            quarantined = {
                "sample_id": ids[rows[bad]].cpu(), "position": pos[bad].cpu(),
                "learner_logp": learner.detach()[bad].float().cpu(), "sampler_logp": sampler[bad].float().cpu(),
                "advantage": adv[bad].float().cpu(), "reason": codes[bad].cpu(),
            }
            keep = ~bad
            learner, sampler, adv, rows, pos = learner[keep], sampler[keep], adv[keep], rows[keep], pos[keep]
            if source is not None:
                source = source[keep]

        # --- canonical order: samples by sample_id ascending ---
        reordered = False
        if num_rows > 1 and not presorted and sample_ids is not None:     # default ids: 0 … S−1, in order
            if torch.unique(ids).numel() != num_rows:
                raise ValueError(f"sample_ids must be unique within a step, got {ids.tolist()[:16]}")
            if bool((ids[1:] < ids[:-1]).any()):
                perm = torch.argsort(ids, stable=True)
                reordered = True
                rank = torch.empty_like(perm)
                rank[perm] = torch.arange(num_rows, device=dev)
                ids, gids = ids[perm], gids[perm]
                rows = rank[rows]
                order = _order_by_row_then_position(rows, pos)
                learner, sampler, adv, rows, pos = learner[order], sampler[order], adv[order], rows[order], pos[order]
                if source is not None:
                    source = source[order]
        if num_valid is None or quarantined is not None or reordered:
            num_valid = torch.bincount(rows, minlength=num_rows) if rows.numel() else torch.zeros(
                num_rows, dtype=torch.long, device=dev)
        return cls(learner_logp=learner, sampler_logp=sampler, advantage=adv, sample_index=rows.long(),
                   position=pos.long(), sample_id=ids, group_id=gids, num_valid=num_valid, quarantine_counts=counts,
                   quarantine_rows=quarantined, offset_responses=offset, _source_index=source, _layout=layout)


def _order_by_row_then_position(rows: Tensor, pos: Tensor) -> Tensor:
    """The stable permutation that sorts tokens by (row, position), both int64 ≥ 0.  One sort of the key
    ``row · (max position + 1) + position`` while it fits in int64, else a stable sort by position then a
    stable sort by row (a lexicographic sort): positions near 2⁶² would overflow the key."""
    if not rows.numel():
        return torch.zeros(0, dtype=torch.long, device=rows.device)
    span = int(pos.max()) + 1
    if (int(rows.max()) + 1) * span <= 2 ** 63:             # the largest key, row_max · span + span − 1, fits
        return torch.argsort(rows * span + pos, stable=True)
    by_pos = torch.argsort(pos, stable=True)
    return by_pos[torch.argsort(rows[by_pos], stable=True)]


# ------------------------------------------------------------ padded gather
#: Whether CPU tensors of float32 / float64 take the compiled gather of :meth:`TokenBatch.from_padded`
#: (:func:`_gather_padded`); False: the torch operations everywhere (the tests compare both).
COMPILED_ON_CPU = True


@njit(nogil=True, cache=True)
def _gather_padded_kernel(mask, learner, sampler, adv, positions, with_learner, adv_per_token, with_positions):
    # pragma: no cover - compiled
    """The valid tokens of ``mask`` (B, T) in row-major order: flat index, row, position (the column, or
    ``positions``), learner and sampler log-probs, advantage (``adv`` (B, T) per token or (B, 1)), and each row's
    count; two passes over the mask, no intermediate array."""
    B, T = mask.shape
    counts = np.zeros(B, np.int64)
    for b in range(B):
        c = 0
        for t in range(T):
            if mask[b, t]:
                c += 1
        counts[b] = c
    n = counts.sum()
    source = np.empty(n, np.int64)
    rows = np.empty(n, np.int64)
    pos = np.empty(n, np.int64)
    lo = np.empty(n if with_learner else 0, learner.dtype)
    so = np.empty(n, sampler.dtype)
    ao = np.empty(n, adv.dtype)
    k = 0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                source[k] = b * T + t
                rows[k] = b
                pos[k] = positions[b, t] if with_positions else t
                if with_learner:
                    lo[k] = learner[b, t]
                so[k] = sampler[b, t]
                ao[k] = adv[b, t] if adv_per_token else adv[b, 0]
                k += 1
    return lo, so, ao, rows, pos, source, counts


def _gather_padded(learner: Tensor, sampler: Tensor, adv: Tensor, mask: Tensor, positions: Optional[Tensor]):
    """:meth:`TokenBatch.from_padded`'s gathers in one compiled pass on the CPU: ``(learner, sampler, advantage,
    rows, positions, flat indices, per-row counts)``, the learner's by torch indexing when it carries a gradient
    (autograd); None where the torch operations run instead (another device, a dtype other than float32 /
    float64, integer positions of another type)."""
    B, T = mask.shape
    floats = (torch.float32, torch.float64)
    if (not COMPILED_ON_CPU or not T or learner.device.type != "cpu" or learner.dtype not in floats
            or sampler.dtype not in floats or adv.dtype not in floats or adv.device.type != "cpu"
            or (positions is not None and positions.dtype != torch.int64)):
        return None
    grad = learner.requires_grad
    host = (lambda t: t.detach().contiguous().numpy())
    per_token = tuple(adv.shape) == (B, T)
    lo, so, ao, rows, pos, source, counts = (torch.from_numpy(x) for x in _gather_padded_kernel(
        host(mask), host(learner), host(sampler), host(adv if per_token else adv.reshape(B, 1)),
        host(positions) if positions is not None else np.zeros((1, 1), np.int64), not grad, per_token,
        positions is not None))
    if grad:
        lo = torch.index_select(learner.reshape(-1), 0, source)     # its backward an index_add, not an index_put
    return lo, so, ao, rows, pos, source, counts


# ---------------------------------------------------------------- validation
_SENTINEL_CANDIDATE = max(SENTINEL_LOGP_EXACT)


def _all_valid(learner: Tensor, sampler: Tensor, adv: Tensor) -> bool:
    """Whether every token passes the value checks of :func:`invalid_codes` (the usual case), from each field's
    min and max (one read of each tensor): log-probs in (largest exact sentinel, +tolerance], advantages finite.
    A NaN makes min and max NaN (``torch.aminmax`` propagates it), so it fails here and the full check decides;
    a value at or below the largest exact sentinel (possibly one) also goes to the full check.  The bounds are
    compared as the element-wise checks compare them, rounded to each tensor's dtype: on the CPU as six floats,
    elsewhere as tensors (one synchronisation)."""
    if not learner.numel():
        return True
    ext = [torch.aminmax(t) for t in (learner, sampler, adv)]
    if learner.device.type != "cpu":
        return _all_valid_tensors(ext)
    (lmin, lmax), (smin, smax), (amin, amax) = ((float(a), float(b)) for a, b in ext)
    (tol_l, cand_l), (tol_s, cand_s) = _bounds(learner.dtype), _bounds(sampler.dtype)
    return (lmax <= tol_l and lmin > cand_l and smax <= tol_s and smin > cand_s and math.isfinite(amin)
            and math.isfinite(amax))


def _all_valid_tensors(ext: list) -> bool:
    """:func:`_all_valid` from the ``(min, max)`` tensors of learner, sampler and advantage, on their device."""
    (lmin, lmax), (smin, smax), (amin, amax) = ext
    ok = torch.stack([lmax <= POSITIVE_LOGP_TOLERANCE, lmin > _SENTINEL_CANDIDATE, smax <= POSITIVE_LOGP_TOLERANCE,
                      smin > _SENTINEL_CANDIDATE, torch.isfinite(amin), torch.isfinite(amax)])
    return bool(ok.all())


@functools.lru_cache(maxsize=None)
class Bounds(NamedTuple):
    """:func:`_bounds`: the positive log-prob tolerance and the largest exact sentinel, rounded to a dtype."""

    tolerance: float
    sentinel: float


def _bounds(dtype: torch.dtype) -> Bounds:
    """(tolerance, largest exact sentinel) rounded to ``dtype``, as a comparison of a ``dtype`` tensor with them
    rounds them."""
    return Bounds(float(torch.tensor(POSITIVE_LOGP_TOLERANCE, dtype=dtype)),
                  float(torch.tensor(_SENTINEL_CANDIDATE, dtype=dtype)))


def is_sentinel(logp: Tensor) -> Tensor:
    """``(N,)`` bool: which log-probs are padding fill values (docs/reliability.md#padding-sentinels): finite and
    at or below :data:`SENTINEL_LOGP_BELOW` (−1e8 nats), or exactly one of :data:`SENTINEL_LOGP_EXACT`.  −inf and
    NaN are not sentinels here: they are non-finite (their own reason).  Any float dtype; compared exactly (in
    float64)."""
    x = logp.detach()
    exact = torch.tensor(SENTINEL_LOGP_EXACT, dtype=torch.float64, device=x.device)
    return torch.isfinite(x) & ((x <= SENTINEL_LOGP_BELOW) | torch.isin(x.double(), exact))


def invalid_codes(learner: Tensor, sampler: Tensor, adv: Tensor) -> Tensor:
    """Per-token invalid-reason code ``(N,)`` int64: index into :data:`INVALID_REASONS`, or −1 if valid.

    The first matching reason wins, in the order of :data:`INVALID_REASONS`.
    """
    codes = torch.full(learner.shape, -1, dtype=torch.long, device=learner.device)
    checks = (
        ~torch.isfinite(learner), ~torch.isfinite(sampler),
        learner > POSITIVE_LOGP_TOLERANCE, sampler > POSITIVE_LOGP_TOLERANCE,
        is_sentinel(learner), is_sentinel(sampler),
        ~torch.isfinite(adv),
    )
    for c in reversed(range(len(checks))):
        codes = torch.where(checks[c], torch.full_like(codes, c), codes)
    return codes


def _check_float(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not torch.is_floating_point(t):
        raise TypeError(f"{name} must be a floating-point tensor of log-probs (nats), got dtype {t.dtype}")


def _check_not_meta(name: str, t) -> None:
    """Raise ValueError when ``t`` is on the meta device (no values to read)."""
    if isinstance(t, Tensor) and t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (a shape without values, e.g. a model built under "
                         "torch.device('meta') and never materialised): pass the log-probs on a real device")


def _check_shape(name: str, t, shape: tuple, ref: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, but {ref} has shape {tuple(shape)}")


def _check_mask(name: str, mask, shape: tuple, ref: str) -> Tensor:
    _check_shape(name, mask, shape, ref)
    if mask.dtype == torch.bool:
        return mask
    if torch.is_floating_point(mask) or mask.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            idx = tuple(int(i) for i in torch.nonzero(bad)[0])
            raise ValueError(f"{name} must be boolean-like (0/1), found {float(mask[idx])} at index {idx}")
        return mask != 0
    raise TypeError(f"{name} must be bool or 0/1 numeric, got dtype {mask.dtype}")


def _check_same_device(ref: Tensor, **others) -> None:
    for name, t in others.items():
        if isinstance(t, Tensor) and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, but learner_logp is on {ref.device}")
    _check_not_meta("learner_logp", ref)


def _advantage_source(advantages, B: int, T: int) -> Tensor:
    """``advantages`` as a tensor of shape ``(B, T)`` (per token), ``(B,)`` or ``(B, 1)`` (per sample).

    Raises:
        ValueError: any other shape (the message names the accepted ones)."""
    adv = torch.as_tensor(advantages)
    if adv.shape in ((B, T), (B,), (B, 1)):
        return adv
    raise ValueError(f"advantages must be ({B}, {T}) per token or ({B},) per sample, got {tuple(adv.shape)}")
