"""slime and Miles ``--save-debug-train-data`` dumps read as steps: the readers of ``triage-monitor import slime``
and ``import miles`` (docs/hooks.md, "Importing existing logs"; named in :data:`.frameworks.DUMP_READERS`, each a
:class:`triage_monitor.offline.importers.StepReader`).

* ``slime`` — the one-file-per-rollout ``format_version 2`` dumps (2026-08 on) and the per-rank files of slime
  v0.3.1 (every rank writes, tensor-parallel replicas are imported once); :func:`slime_steps`.  One ``rollout_id``
  is one step.  slime's ``--save-debug-rollout-data`` files hold only the sampler side (no learner log-probs, no
  advantages) and cannot be imported alone.
* ``miles`` — Miles' per-rank files (every rank writes; replicas imported once, Megatron context-parallel slices
  put back together, :func:`cp_response_slices`); :func:`miles_steps`.  Miles shares slime's v0.3.1 replica logic.

Files are read with ``torch.load(weights_only=True)``: tensors, lists, dicts and numbers only.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch

from triage_monitor.batch import TokenBatch


# ------------------------------------------------------------------- slime
#: Per-sample keys an importable slime train dump must carry (learner, sampler, advantage).
SLIME_REQUIRED = ("log_probs", "rollout_log_probs", "advantages")


def _cpu_list(values) -> List[torch.Tensor]:
    return [torch.as_tensor(v).detach().to("cpu", torch.float32).reshape(-1) for v in values]


def _load_slime_dump(path: str) -> dict[str, Any]:
    try:   # tensors, lists, dicts and numbers only: a dump is never unpickled as arbitrary code
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError / RuntimeError for disallowed types
        raise ValueError(f"{path}: cannot be read as plain tensors/lists/dicts ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a slime train dump (a {type(obj).__name__}, not a dict)")
    return obj


class RolloutSamples(NamedTuple):
    """:func:`_slime_part_v2`: a ``format_version 2`` file's rollout id and its samples (dicts, with ``_where``)."""

    rollout_id: int
    samples: List[dict]


class DumpParts(NamedTuple):
    """One rollout's samples from its per-rank files, each once, in sample order; ``{"replica_files_dropped": n}``."""

    samples: List[dict]
    extra: Dict[str, int]


def _slime_part_v2(path: str, obj: dict) -> RolloutSamples:
    """Samples of one ``format_version 2`` file: one file per rollout, every DP shard, CP restored."""
    samples = obj.get("samples")
    if not isinstance(samples, (list, tuple)) or "rollout_id" not in obj:
        raise ValueError(f"{path}: format_version 2 dump without a 'samples' list or 'rollout_id' "
                         f"(keys: {sorted(obj)})")
    out = []
    for i, smp in enumerate(samples):
        missing = [k for k in SLIME_REQUIRED if k not in smp]
        if missing:
            raise ValueError(f"{path}: samples[{i}] has no {missing} (keys: {sorted(smp)}); "
                             + _NO_LOG_PROBS_HINT * ("log_probs" in missing))
        out.append(dict(smp, _where=f"{path}: samples[{i}]"))
    return RolloutSamples(int(obj["rollout_id"]), out)


_NO_LOG_PROBS_HINT = ("slime skips the learner log-prob pass in some configurations (one micro-batch, "
                      "--use-rollout-logprobs); dumps written since format_version 2 capture it during training")


class SampleKey(NamedTuple):
    """:func:`_sample_key`: a dump sample's identity (the token ids and log-probs as float64 bytes; None: absent)."""

    sample_index: Optional[int]
    response_length: int
    tokens: Optional[bytes]
    sampler_logp: Optional[bytes]


def _sample_key(data: dict, i: int, probe: Optional[str] = "rollout_log_probs") -> SampleKey:
    """Identity of the i-th sample of a per-rank dump: index, response length, token ids, sampler log-probs
    (the last two come from the rollout, equal on every replica of a data-parallel shard; ``probe=None`` leaves the
    sampler log-probs out, which Miles slices per context-parallel rank)."""
    def values(key: Optional[str]) -> Optional[bytes]:
        col = data.get(key) if key else None
        return None if col is None else torch.as_tensor(col[i]).reshape(-1).double().numpy().tobytes()
    idx = data.get("sample_indices")
    index = None if idx is None or idx[i] is None else int(idx[i])
    return SampleKey(index, int(data["response_lengths"][i]), values("tokens"), values(probe))


def _slime_parts_v031(files: List[Tuple[str, dict]]) -> DumpParts:
    """Samples of the per-rank files of one rollout, each sample once.

    The v0.3.1 writer saves ``rollout_data`` on **every** rank: tensor-parallel ranks (and pipeline stages)
    of one data-parallel shard hold the same samples.  Files are grouped by their samples' identity
    (:func:`_sample_key`); of each group the lowest rank with learner log-probs is kept (the last
    pipeline stage computes them; earlier stages hold none).  A context-parallel shard holds only a slice of
    each response and is refused.
    """
    groups: Dict[Tuple[SampleKey, ...], List[Tuple[int, str, dict]]] = {}
    for path, obj in files:
        data = obj["rollout_data"]
        if not isinstance(data, dict) or "response_lengths" not in data:
            raise ValueError(f"{path}: rollout_data has no 'response_lengths' "
                             f"(keys: {sorted(data) if isinstance(data, dict) else type(data).__name__})")
        n = len(data["response_lengths"])
        key = tuple(_sample_key(data, i) for i in range(n))
        groups.setdefault(key, []).append((int(obj.get("rank", 0)), path, data))
    samples, dropped = [], 0
    for members in groups.values():
        members.sort(key=lambda m: m[0])
        with_lp = [m for m in members if all(k in m[2] for k in SLIME_REQUIRED)]
        if not with_lp:
            rank, path, data = members[0]
            missing = [k for k in SLIME_REQUIRED if k not in data]
            raise ValueError(f"{path}: rollout_data has no {missing} (keys: {sorted(data)}), nor has any other "
                             f"rank's file with the same samples ({', '.join(m[1] for m in members[1:]) or 'none'}); "
                             + _NO_LOG_PROBS_HINT)
        rank, path, data = with_lp[0]
        dropped += len(members) - 1
        lens = [int(x) for x in data["response_lengths"]]
        for i, length in enumerate(lens):
            got = int(torch.as_tensor(data["log_probs"][i]).numel())
            if got != length:
                raise ValueError(f"{path}: rollout_data log_probs[{i}] has {got} values for a response of {length} "
                                 "tokens: a context-parallel shard (the v0.3.1 writer saves each CP rank's slice); "
                                 "re-dump with context parallel size 1 or with slime's format_version 2 writer, which "
                                 "restores full responses")
            samples.append(_dump_sample({k: data[k][i] for k in (*SLIME_REQUIRED, "loss_masks") if k in data},
                                        data, i, path, rank))
    return DumpParts(_in_sample_order(samples), {"replica_files_dropped": dropped})


def _dump_sample(smp: dict, data: dict, i: int, path: str, rank: int) -> dict[str, Any]:
    """A per-rank dump's i-th sample with its identity: ``sample_index``, where it came from, its order."""
    idx = data.get("sample_indices")
    return dict(smp, sample_index=None if idx is None else idx[i], _where=f"{path}: sample {i}", _order=(rank, i))


def _in_sample_order(samples: List[dict]) -> List[dict]:
    """By ``sample_index`` where every sample has one, else by (rank, position in the file)."""
    if all(s["sample_index"] is not None for s in samples):
        return sorted(samples, key=lambda s: int(s["sample_index"]))
    return sorted(samples, key=lambda s: s["_order"])


def _step_batch(samples: List[dict], on_invalid: str, step: int, files: str) -> TokenBatch:
    """The step's :class:`TokenBatch`; a refusal names the file holding the sample (``files`` when none is known)."""
    try:
        return _slime_batch(samples, on_invalid)
    except (ValueError, TypeError) as exc:   # TokenBatch's messages name a sample index: say which file holds it
        if str(exc).split(":", 1)[0] in {str(smp["_where"]).split(":", 1)[0] for smp in samples}:
            raise                                   # already names its file
        index = getattr(exc, "sample", None)
        where = samples[index]["_where"] if isinstance(index, int) and 0 <= index < len(samples) else files
        raise ValueError(f"{where}: rollout_id {step}: {exc}") from exc


def _slime_batch(samples: List[dict], on_invalid: str) -> TokenBatch:
    lp, rlp, adv, masks, ids = [], [], [], [], []
    for s in samples:
        a, b = _cpu_list([s["log_probs"], s["rollout_log_probs"]])
        if a.shape != b.shape:
            raise ValueError(f"{s['_where']}: log_probs has {a.numel()} values, rollout_log_probs {b.numel()}")
        lp.append(a)
        rlp.append(b)
        adv.append(_cpu_list([s["advantages"]])[0])
        m = s.get("loss_masks")
        masks.append(torch.ones(a.numel(), dtype=torch.bool) if m is None else _cpu_list([m])[0] != 0)
        pos = s.get("rollout_position", s.get("sample_index"))
        ids.append(None if pos is None else int(pos))
    sample_ids = torch.tensor(ids, dtype=torch.int64) if ids and None not in ids and len(set(ids)) == len(ids) else None
    return TokenBatch.from_list(lp, rlp, adv, masks, sample_ids=sample_ids, on_invalid=on_invalid)


def slime_steps(paths: Iterable[str], on_invalid: str = "quarantine",
                info: Optional[dict] = None) -> Iterator[Tuple[int, TokenBatch]]:
    """Yield ``(rollout_id, TokenBatch)`` per rollout from slime ``--save-debug-train-data`` files.

    Two writers are read (docs/hooks.md#slime):

    * ``format_version 2`` (slime's ``observability/train_data_utils.py``, since 2026-08): one file per
      rollout, ``{"format_version": 2, "rollout_id", "rank", "samples": [per-sample dict], "dp_shards", ...}``,
      every data-parallel shard gathered, context-parallel slices restored, written by tensor-parallel rank 0
      of the last pipeline stage only.  ``sample_ids`` are the samples' ``rollout_position``.
    * per-rank files (slime v0.3.1 ``utils/train_dump_utils.py``): ``{"rollout_id", "rank", "rollout_data"}``
      on **every** rank; replicas of one data-parallel shard (tensor-parallel ranks, pipeline stages) are
      imported once (:func:`_slime_parts_v031`).

    Per sample: ``log_probs`` (learner, nats), ``rollout_log_probs`` (sampler, nats), ``advantages`` (per token),
    ``loss_masks`` (optional; 0 drops the token), all 1-D over the response tokens.

    Args:
        paths: dump files (a rollout may mix nothing: all its files of one format).
        on_invalid: ``"quarantine"`` or ``"raise"`` (:class:`TokenBatch`).
        info: filled with ``{"formats": [...], "replica_files_dropped": n}`` when given.

    Raises:
        ValueError: a file cannot be read, is not a slime train dump, lacks a per-sample key, holds a
            context-parallel slice, has an unknown ``format_version``, or two files claim one rollout in
            format 2.  Every message starts with the file's path.
    """
    v2: Dict[int, Tuple[str, List[dict]]] = {}
    v031: Dict[int, List[Tuple[str, dict]]] = {}
    for p in sorted(set(paths)):
        obj = _load_slime_dump(p)
        version = obj.get("format_version")
        if version == 2:
            step, samples = _slime_part_v2(p, obj)
            if step in v2:
                raise ValueError(f"{p}: rollout_id {step} is also in {v2[step][0]} (format_version 2 writes one "
                                 "file per rollout)")
            v2[step] = (p, samples)
        elif version is not None:
            raise ValueError(f"{p}: unknown slime dump format_version {version!r} (readable: 2, and the per-rank "
                             "files without format_version)")
        elif "rollout_data" in obj and "rollout_id" in obj:
            v031.setdefault(int(obj["rollout_id"]), []).append((p, obj))
        else:
            raise ValueError(f"{p}: not a slime --save-debug-train-data file (no 'samples' with format_version 2, "
                             f"no 'rollout_data'; keys: {sorted(obj)}); --save-debug-rollout-data dumps hold no "
                             "learner log-probs and cannot be imported alone")
    clash = sorted(set(v2) & set(v031))
    if clash:
        raise ValueError(f"{v031[clash[0]][0][0]}: rollout_id {clash[0]} is also in the format_version 2 file "
                         f"{v2[clash[0]][0]}; import one of the two dumps")
    if info is not None:
        info.update(formats=[f for f, on in (("format_version_2", v2), ("per_rank_v0.3.1", v031)) if on],
                    replica_files_dropped=0)
    for step in sorted(set(v2) | set(v031)):
        if step in v2:
            samples = v2[step][1]
        else:
            samples, extra = _slime_parts_v031(v031[step])
            if info is not None:
                info["replica_files_dropped"] += extra["replica_files_dropped"]
        files = v2[step][0] if step in v2 else ", ".join(p for p, _ in v031[step])
        yield step, _step_batch(samples, on_invalid, step, files)


# ------------------------------------------------------------------- Miles
#: Per-sample fields Miles' dump holds as each context-parallel rank's slice (the rest is full-length).
MILES_CP_SLICED = ("log_probs", "rollout_log_probs", "advantages")


def cp_response_slices(total_length: int, response_length: int, cp_rank: int, cp_size: int, qkv_format: str = "thd",
                       max_seq_len: Optional[int] = None) -> List[Tuple[int, int]]:
    """The ``(start, stop)`` ranges of a response's tokens that context-parallel rank ``cp_rank`` of ``cp_size``
    holds, in response positions, in the order its slice stores them (Miles' zigzag split: two chunks of
    ``ceil(L / 2·cp)`` tokens, ``L`` the total length, or ``max_seq_len`` under ``qkv_format="bshd"``; Miles
    ``cp_utils.get_logits_and_tokens_offset_with_cp`` / ``slice_log_prob_with_cp`` at commit 31f1ca96).

    Raises:
        ValueError: ``bshd`` without ``max_seq_len``.
    """
    prompt = total_length - response_length
    if qkv_format == "thd":
        chunk = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    elif max_seq_len is None:
        raise ValueError("qkv_format 'bshd' needs max_seq_lens")
    else:
        chunk = (int(max_seq_len) + 2 * cp_size - 1) // (2 * cp_size)
    out = []
    for lo, hi in ((cp_rank * chunk, (cp_rank + 1) * chunk),
                   ((2 * cp_size - cp_rank - 1) * chunk, (2 * cp_size - cp_rank) * chunk)):
        a, b = max(lo, prompt - 1), min(hi, total_length - 1)
        if a < b:
            out.append((a - (prompt - 1), b - (prompt - 1)))
    return out


def _miles_parts(files: List[Tuple[str, dict]]) -> DumpParts:
    """Samples of one rollout's per-rank Miles files, each sample once, context-parallel slices put back together.

    Replicas (tensor-parallel ranks, pipeline stages without learner log-probs) are dropped as for slime v0.3.1
    (:func:`_slime_parts_v031`); the files of one data-parallel shard's ``cp_size`` context-parallel ranks are then
    joined: each per-token field of :data:`MILES_CP_SLICED` is rebuilt from the ranks' slices
    (:func:`cp_response_slices`); ``loss_masks`` are full-length in the dump.
    """
    groups: Dict[tuple, List[Tuple[int, str, dict, int, int]]] = {}
    for path, obj in files:
        data = obj["rollout_data"]
        if not isinstance(data, dict) or "response_lengths" not in data:
            raise ValueError(f"{path}: rollout_data has no 'response_lengths' "
                             f"(keys: {sorted(data) if isinstance(data, dict) else type(data).__name__})")
        cp_rank, cp_size = int(obj.get("cp_rank", 0) or 0), int(obj.get("cp_size", 1) or 1)
        key = (cp_rank, tuple(_sample_key(data, i, probe=None) for i in range(len(data["response_lengths"]))))
        groups.setdefault(key, []).append((int(obj.get("rank", 0)), path, data, cp_size, obj.get("qkv_format", "thd")))
    shards: Dict[tuple, Dict[int, tuple]] = {}
    dropped = 0
    for (cp_rank, ident), members in groups.items():
        members.sort(key=lambda m: m[0])
        with_lp = [m for m in members if all(k in m[2] for k in SLIME_REQUIRED)]
        if not with_lp:
            rank, path, data = members[0][:3]
            missing = [k for k in SLIME_REQUIRED if k not in data]
            raise ValueError(f"{path}: rollout_data has no {missing} (keys: {sorted(data)}), nor has any other "
                             f"rank's file with the same samples ({', '.join(m[1] for m in members[1:]) or 'none'})")
        dropped += len(members) - 1
        shards.setdefault(ident, {})[cp_rank] = with_lp[0]
    samples = []
    for ident, by_cp in shards.items():
        first = by_cp[min(by_cp)]
        cp_size, qkv = first[3], first[4]
        if sorted(by_cp) != list(range(cp_size)):
            raise ValueError(f"{first[1]}: context-parallel ranks {sorted(by_cp)} of {cp_size} found for these samples; "
                             "import every rank's file of the rollout")
        rank, path, data = first[:3]
        for i, length in enumerate(int(x) for x in data["response_lengths"]):
            smp = {"loss_masks": data["loss_masks"][i]} if "loss_masks" in data else {}
            for field in MILES_CP_SLICED:
                if cp_size == 1:
                    smp[field] = data[field][i]
                    continue
                full = torch.zeros(length, dtype=torch.float64)
                for r, (_, p_r, d_r, _, _) in sorted(by_cp.items()):
                    msl = d_r.get("max_seq_lens")
                    ranges = cp_response_slices(int(d_r["total_lengths"][i]), length, r, cp_size, qkv,
                                                None if msl is None else int(msl[i]))
                    part = torch.as_tensor(d_r[field][i]).reshape(-1).double()
                    if part.numel() != sum(b - a for a, b in ranges):
                        raise ValueError(f"{p_r}: rollout_data {field}[{i}] has {part.numel()} values; context-parallel "
                                         f"rank {r} of {cp_size} holds {sum(b - a for a, b in ranges)} of this response")
                    taken = 0
                    for a, b in ranges:
                        full[a:b] = part[taken:taken + b - a]
                        taken += b - a
                smp[field] = full
            got = int(torch.as_tensor(smp["log_probs"]).numel())
            if got != length:
                raise ValueError(f"{path}: rollout_data log_probs[{i}] has {got} values for a response of {length} "
                                 "tokens (a context-parallel slice without cp_rank / cp_size in the file?)")
            samples.append(_dump_sample(smp, data, i, path, rank))
    return DumpParts(_in_sample_order(samples), {"replica_files_dropped": dropped})


def miles_steps(paths: Iterable[str], on_invalid: str = "quarantine",
                info: Optional[dict] = None) -> Iterator[Tuple[int, TokenBatch]]:
    """Yield ``(rollout_id, TokenBatch)`` per rollout from Miles ``--save-debug-train-data`` files.

    Miles (``miles/utils/train_dump_utils.py``, commit 31f1ca96) saves on **every** rank ``{"rollout_id", "rank",
    "rollout_data", "cp_rank", "cp_size", "qkv_format"}``; with context parallelism each rank's ``log_probs``,
    ``rollout_log_probs`` and ``advantages`` are its slice of every response.  Replicas are imported once, slices put
    back together (:func:`_miles_parts`).  Per sample as for slime (:func:`slime_steps`).

    Raises:
        ValueError: a file cannot be read, is not a Miles train dump, lacks a per-sample key, misses a
            context-parallel rank, or holds a slice whose length does not fit; every message starts with the file.
    """
    by_step: Dict[int, List[Tuple[str, dict]]] = {}
    for p in sorted(set(paths)):
        obj = _load_slime_dump(p)
        if "rollout_data" not in obj or "rollout_id" not in obj:
            raise ValueError(f"{p}: not a Miles --save-debug-train-data file (no 'rollout_data' / 'rollout_id'; keys: "
                             f"{sorted(obj)}); --save-debug-rollout-data dumps hold no learner log-probs")
        by_step.setdefault(int(obj["rollout_id"]), []).append((p, obj))
    if info is not None:
        info.update(formats=["miles_per_rank"], replica_files_dropped=0,
                    cp_sizes=sorted({int(o.get("cp_size", 1) or 1) for fs in by_step.values() for _, o in fs}))
    for step in sorted(by_step):
        samples, extra = _miles_parts(by_step[step])
        if info is not None:
            info["replica_files_dropped"] += extra["replica_files_dropped"]
        yield step, _step_batch(samples, on_invalid, step, ", ".join(p for p, _ in by_step[step]))


__all__ = ["SLIME_REQUIRED", "MILES_CP_SLICED", "slime_steps", "miles_steps", "cp_response_slices"]
