"""Reference-window calibration, the one implementation behind the monitor's τ_tail and the controller's Gate
thresholds (docs/metrics.md#tau_tail, docs/metrics.md#gate).

A value stream (token δ, segment-mean δ, in nats) contributes one fixed-size **part** per step: the counts of
the δ quantile sketch (:mod:`triage_monitor.metrics.sketch`) plus the minimum and maximum.  Parts merge by sum / min /
max, so ranks reduce them with one all-reduce and a window is the merge of its steps' parts.
:class:`ReferenceWindow` keeps the parts of the first ``steps`` distinct step numbers and freezes when the first
step after them arrives; quantiles are read from the merged sketch with its stated error bound.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union, overload

import numpy as np

from . import sketch

if TYPE_CHECKING:                  # parts are tensors live and numpy arrays offline (no torch import there)
    from torch import Tensor

    #: a part: a tensor live, a numpy array offline
    Part = Union[Tensor, np.ndarray]

#: Length of a part: the sketch counts, then min and max.
PART_SIZE = sketch.SIZE + 2


def part_of(values: Tensor) -> Tensor:
    """``(PART_SIZE,)`` float64 CPU part of a 1-D tensor of values (nats): sketch counts, min, max.

    An empty tensor gives zero counts, min +inf and max −inf (the identity of the merge).
    """
    import torch

    v = values.detach().reshape(-1).float()
    counts = sketch.sketch_counts(v).double().cpu()
    if v.numel():
        ext = torch.stack([v.min(), v.max()]).double().cpu()
    else:
        ext = torch.tensor([math.inf, -math.inf], dtype=torch.float64)
    return torch.cat([counts, ext])


@overload
def merge_parts(parts: Sequence[Tensor]) -> Tensor: ...
@overload
def merge_parts(parts: Sequence[np.ndarray]) -> np.ndarray: ...
@overload
def merge_parts(parts: Sequence[Part]) -> Part: ...
def merge_parts(parts: Sequence[Part]) -> Part:
    """One part holding the values of all ``parts`` (counts summed, min of mins, max of maxes): a new float64
    numpy array when ``parts[0]`` is one, else a new float64 CPU tensor."""
    out = np.array(sketch.host_array(parts[0]), dtype=np.float64)
    k = sketch.SIZE
    for part in parts[1:]:
        p = sketch.host_array(part).astype(np.float64, copy=False)
        out[:k] += p[:k]
        out[k] = min(float(out[k]), float(p[k]))
        out[k + 1] = max(float(out[k + 1]), float(p[k + 1]))
    if isinstance(parts[0], np.ndarray):
        return out
    import torch

    return torch.from_numpy(out)


def sync_part(part: Tensor, group=None) -> Tensor:
    """All-reduce a part over ``group`` (torch.distributed): SUM of the counts, MIN of min, MAX of max.
    Fixed size whatever the number of values."""
    import torch
    import torch.distributed as dist

    home = part.device
    if dist.get_backend(group) == "nccl" and home.type == "cpu":     # NCCL reduces device tensors only
        part = part.to(torch.device("cuda", torch.cuda.current_device()))
    k = sketch.SIZE
    counts = part[:k].contiguous()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    ext = torch.stack([-part[k], part[k + 1]])
    dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([counts, -ext[:1], ext[1:]]).to(home)


def part_quantiles(part: Part, qs: Sequence[float]) -> list[float]:
    """Quantiles ``qs`` (nats) of the values in ``part``, within the sketch's bound; NaN when it holds none."""
    k = sketch.SIZE
    return sketch.sketch_quantiles(part[:k], list(qs), float(part[k]), float(part[k + 1]))


def part_count(part: Part) -> float:
    """Number of values in ``part``."""
    return float(part[:sketch.SIZE].sum())


class ReferenceWindow:
    """The first ``steps`` distinct steps of one or more value streams, frozen when the next step arrives.

    Args:
        steps: reference steps (step numbers with at least one value).
        streams: number of value streams (e.g. 2: segment-mean δ and token δ for the Gate thresholds).
        repeated: what a part for the same step as the previous one does: ``"replace"`` (the monitor: a step
            logged again replaces the earlier record) or ``"accumulate"`` (the controller: one step's
            micro-batches add up).

    Raises:
        ValueError: ``steps`` < 1, ``streams`` < 1 or an unknown ``repeated``.
    """

    def __init__(self, steps: int, streams: int = 1, repeated: str = "replace"):
        if steps < 1 or streams < 1:
            raise ValueError(f"ReferenceWindow: steps and streams must be >= 1, got {steps}, {streams}")
        if repeated not in ("replace", "accumulate"):
            raise ValueError(f"ReferenceWindow: repeated must be 'replace' or 'accumulate', got {repeated!r}")
        self.size, self.streams, self.repeated = int(steps), int(streams), repeated
        self.frozen = False
        self.step_numbers: list[int] = []
        self.parts: list[list[Tensor]] = []          # per step: list of `streams` parts

    def add(self, step: int, parts: Sequence[Tensor]) -> bool:
        """Add one step's parts (one per stream); returns True when this call froze the window (``step`` is the
        first step after the reference window: its parts are not added).  A step whose first stream holds no value
        is no reference step; once frozen, nothing changes."""
        if self.frozen or part_count(parts[0]) == 0:
            return False
        if len(parts) != self.streams:
            raise ValueError(f"ReferenceWindow.add: {len(parts)} parts for {self.streams} streams")
        parts = [p.detach().cpu().double() for p in parts]
        if self.step_numbers and self.step_numbers[-1] == step:
            if self.repeated == "replace":
                self.parts[-1] = parts
            else:
                self.parts[-1] = [merge_parts([a, b]) for a, b in zip(self.parts[-1], parts)]
            return False
        if len(self.step_numbers) >= self.size:
            self.frozen = True
            return True
        self.step_numbers.append(int(step))
        self.parts.append(parts)
        return False

    def merged(self, stream: int = 0) -> Optional[Tensor]:
        """The merged part of one stream over the steps so far (None before any step)."""
        return merge_parts([p[stream] for p in self.parts]) if self.parts else None

    def quantiles(self, stream: int, qs: Sequence[float], group=None) -> list[float]:
        """Quantiles (nats) of one stream over the steps so far, summed over ``group`` first when given."""
        m = self.merged(stream)
        if m is None:
            return [math.nan] * len(qs)
        return part_quantiles(sync_part(m, group) if group is not None else m, qs)

    def state_dict(self) -> dict[str, Any]:
        """Plain values and CPU tensors (``torch.save``-able)."""
        return {"size": self.size, "streams": self.streams, "repeated": self.repeated, "frozen": self.frozen,
                "steps": list(self.step_numbers), "parts": [[p.clone() for p in ps] for ps in self.parts]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` output (the size and streams stay this window's own)."""
        self.frozen = bool(sd["frozen"])
        self.step_numbers = list(sd["steps"])
        import torch

        self.parts = [[torch.as_tensor(p, dtype=torch.float64) for p in ps] for ps in sd["parts"]]
