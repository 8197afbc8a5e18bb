"""The token-level definitions of docs/metrics.md, each written once: the segment a token falls in, a tail token,
a response with A < 0.

Every pass that needs one calls these functions: the compiled state update and C_tok shuffle null (numba,
``njit(inline="always")`` of the same functions), the torch segment cutter of the Gate and Repair, the offline tail
layout and the dashboard's drill-down.  Plain arithmetic, so one body serves Python integers and floats, numpy
arrays and torch tensors alike.  The standard library only (the dashboard's first charts import it).

Editing a definition: numba's on-disk cache (``cache=True``) of a compiled caller is keyed by the caller's own file,
so after changing a function here delete the ``__pycache__/*.nbi``/``*.nbc`` files of ``metrics/`` and
``offline/`` (or touch ``state_kernel.py``, ``segments.py`` and ``stages.py``) before measuring.
"""

from __future__ import annotations


def segment_shift(width: int) -> int:
    """``log2(width)`` when the segment width is a power of two (the segment number is then a shift), else -1.

    Args:
        width: segment width W > 0 (tokens).
    """
    shift = -1
    if width & (width - 1) == 0:
        shift = 0
        while (1 << shift) < width:
            shift += 1
    return shift


def segment_number(position, width, shift=-1):
    """The segment of a token at ``position`` (docs/metrics.md#localisation): ``k = position // W``, segment k holding
    positions ``[k·W, (k+1)·W)``.

    Args:
        position: int64 position(s) in the response (scalar, numpy array or torch tensor), ≥ 0.
        width: W > 0 (tokens).
        shift: :func:`segment_shift` of ``width`` (a shift instead of a division when W is a power of two; -1: divide).

    Returns:
        The segment number(s), same type as ``position``.
    """
    return position >> shift if shift >= 0 else position // width


def is_tail(advantage, delta, tau):
    """An amplifying-tail token (docs/metrics.md#tau_tail): A < 0 and δ < τ_tail (δ = learner − sampler log-prob,
    nats; compared in δ's dtype, float32 as recorded).

    Args:
        advantage, delta: per-token values (scalars, numpy arrays or torch tensors of one shape).
        tau: τ_tail (nats).

    Returns:
        bool (or a bool array / tensor).
    """
    return (advantage < 0) & (delta < tau)


def is_negative_response(positive_mass, negative_mass):
    """A response with A < 0 (docs/metrics.md#localisation): the |A| mass of its A > 0 tokens minus that of its A < 0
    tokens is negative (float64 sums; equivalently, the mean advantage over its valid tokens is negative).

    Args:
        positive_mass: Σ A over the response's tokens with A > 0 (float64, ≥ 0).
        negative_mass: Σ |A| over its tokens with A < 0 (float64, ≥ 0).
    """
    return positive_mass - negative_mass < 0.0
