"""``triage-monitor import``: turn what an unmonitored run already dumped into a run directory.

Two sources (docs/hooks.md, "Importing existing logs"):

* ``slime`` — files written by slime's ``--save-debug-train-data PATH_{rollout_id}_{rank}.pt``:
  ``torch.save(dict(rollout_id=, rank=, rollout_data=))`` where ``rollout_data`` holds per-sample
  lists over the response tokens: ``log_probs`` (learner recomputation), ``rollout_log_probs``
  (SGLang), ``advantages``, ``loss_masks`` (and ``response_lengths``, ...).  All ranks of one
  ``rollout_id`` become one step.  slime's ``--save-debug-rollout-data`` files hold only the
  sampler side (no learner log-probs, no advantages) and cannot be imported alone.
* ``table`` — a Parquet file/directory or JSONL file of per-token log-probs, long format (one row
  per token) or wide (one row per response whose log-prob columns are lists).  A column mapping
  (``--map field=column``) names the columns; required fields: ``step``, ``sample_id``,
  ``learner_logp``, ``sampler_logp``, ``advantage``; optional: ``position`` (default: order of
  the rows within a response), ``mask`` (0 rows are dropped after positions are assigned),
  ``group_id``.

The run directory is written by :class:`~triage_monitor.monitor.MismatchMonitor`, so its layout is
exactly a live run's.  Invalid tokens are quarantined (counted, kept in the records) by default.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import pandas as pd
import torch

from .batch import TokenBatch
from .monitor import MismatchMonitor, MonitorConfig

REQUIRED = ("step", "sample_id", "learner_logp", "sampler_logp", "advantage")
OPTIONAL = ("position", "mask", "group_id")


# ------------------------------------------------------------------- slime
def _cpu_list(values) -> List[torch.Tensor]:
    return [torch.as_tensor(v).detach().to("cpu", torch.float32).reshape(-1) for v in values]


def slime_steps(paths: Iterable[str], on_invalid: str = "quarantine") -> Iterator[Tuple[int, TokenBatch]]:
    """Yield ``(rollout_id, TokenBatch)`` per rollout from slime debug train-data files (ranks merged).

    Raises:
        ValueError: a file is not a slime train-data dump (names the file and the missing key).
    """
    by_step: Dict[int, list] = {}
    for p in sorted(set(paths)):
        try:   # tensors, lists, dicts and numbers only: a dump is never unpickled as arbitrary code
            obj = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises UnpicklingError / RuntimeError for disallowed types
            raise ValueError(f"{p}: cannot be read as plain tensors/lists/dicts ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0]})") from exc
        if not isinstance(obj, dict) or "rollout_data" not in obj:
            raise ValueError(f"{p}: not a slime --save-debug-train-data file (no 'rollout_data'); "
                             "rollout-data dumps hold no learner log-probs and cannot be imported alone")
        data = obj["rollout_data"]
        for key in ("log_probs", "rollout_log_probs", "advantages"):
            if key not in data:
                raise ValueError(f"{p}: rollout_data has no {key!r} (keys: {sorted(data)})")
        by_step.setdefault(int(obj["rollout_id"]), []).append((int(obj.get("rank", 0)), data))
    for step in sorted(by_step):
        parts = sorted(by_step[step], key=lambda x: x[0])
        lp, rlp, adv, masks = [], [], [], []
        for _, d in parts:
            lp += _cpu_list(d["log_probs"])
            rlp += _cpu_list(d["rollout_log_probs"])
            adv += _cpu_list(d["advantages"])
            masks += ([m.bool() for m in _cpu_list(d["loss_masks"])] if "loss_masks" in d
                      else [torch.ones(len(x), dtype=torch.bool) for x in _cpu_list(d["log_probs"])])
        yield step, TokenBatch.from_list(lp, rlp, adv, masks, on_invalid=on_invalid)


# ------------------------------------------------------------------- table
def parse_mapping(items: Optional[Iterable[str]]) -> Dict[str, str]:
    """``["learner_logp=lp_train", ...]`` → ``{field: column}``; unmapped fields map to their own name.

    Raises:
        ValueError: an item is not ``field=column`` or names an unknown field.
    """
    mapping = {f: f for f in REQUIRED}
    for item in items or ():
        if "=" not in item:
            raise ValueError(f"--map {item!r}: expected field=column")
        field, col = (s.strip() for s in item.split("=", 1))
        if field not in REQUIRED + OPTIONAL:
            raise ValueError(f"--map {item!r}: unknown field {field!r}; fields are {REQUIRED + OPTIONAL}")
        mapping[field] = col
    return mapping


def read_table(path: str, fmt: str = "auto") -> pd.DataFrame:
    """Read a Parquet file/directory or a JSONL file into a DataFrame.

    Raises:
        ValueError: unknown format or no such file.
    """
    if not Path(path).exists():
        raise ValueError(f"{path}: no such file or directory")
    if fmt == "auto":
        fmt = "jsonl" if str(path).endswith((".jsonl", ".json", ".jsonl.gz")) else "parquet"
    if fmt == "parquet":
        return pd.read_parquet(path)
    if fmt == "jsonl":
        return pd.read_json(path, lines=True)
    raise ValueError(f"unknown format {fmt!r}: use parquet or jsonl")


def table_steps(df: pd.DataFrame, mapping: Dict[str, str],
                on_invalid: str = "quarantine") -> Iterator[Tuple[int, TokenBatch]]:
    """Yield ``(step, TokenBatch)`` from a per-token (or per-response list-valued) table.

    Optional fields (``position``, ``mask``, ``group_id``) are read from ``mapping`` or, unmapped,
    from a column of the field's own name when the table has one.

    Raises:
        ValueError: a required or explicitly mapped column is missing, or list columns of one row
            differ in length.
    """
    # required fields and explicitly mapped optional ones must exist; an unmapped optional field is
    # used when the table has a column of its own name (a `mask` column is never silently ignored)
    missing = [f"{f} (column {mapping[f]!r})" for f in REQUIRED + OPTIONAL
               if f in mapping and mapping[f] not in df.columns]
    if missing:
        raise ValueError(f"table has no column for {missing}; columns are {list(df.columns)}; use --map field=column")
    cols = {f: mapping.get(f, f) for f in REQUIRED + OPTIONAL if mapping.get(f, f) in df.columns}
    df = df[list(dict.fromkeys(cols.values()))].rename(columns={v: k for k, v in cols.items()})
    list_cols = [c for c in ("learner_logp", "sampler_logp", "advantage", "mask", "position")
                 if c in df.columns and len(df) and isinstance(df[c].iloc[0], (list, np.ndarray))]
    if list_cols:                                          # wide: one row per response
        lens = np.stack([df[c].map(len).to_numpy() for c in list_cols])
        if (lens != lens[0]).any():
            bad = int(np.nonzero((lens != lens[0]).any(0))[0][0])
            raise ValueError(f"row {bad}: list columns {list_cols} have lengths {lens[:, bad].tolist()}")
        df = df.explode(list_cols, ignore_index=True)
    if "position" not in df.columns:
        df["position"] = df.groupby(["step", "sample_id"], sort=False).cumcount()
    if "mask" in df.columns:
        df = df[df["mask"].astype(float) != 0]
    for step, g in df.groupby("step", sort=True):
        t = lambda c, dt: torch.from_numpy(g[c].to_numpy(dtype=dt, copy=True))  # noqa: E731
        yield int(step), TokenBatch.from_flat(
            t("learner_logp", np.float32), t("sampler_logp", np.float32), t("advantage", np.float32),
            t("sample_id", np.int64), t("position", np.int64),
            group_id=t("group_id", np.int64) if "group_id" in g.columns else None, on_invalid=on_invalid)


# ------------------------------------------------------------------- write
def write_run(steps: Iterable[Tuple[int, TokenBatch]], run_dir, manifest: dict,
              config: Optional[MonitorConfig] = None) -> int:
    """Log every ``(step, batch)`` through a MismatchMonitor into ``run_dir``; returns the number of steps."""
    n = 0
    with MismatchMonitor(run_dir, config or MonitorConfig(), manifest=manifest) as mon:
        for step, batch in steps:
            mon.log_step(step, batch)
            n += 1
    return n


# --------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``triage-monitor import``: ``slime FILES...`` or ``table PATH --map field=column``."""
    sub = parser.add_subparsers(dest="source", required=True)
    s = sub.add_parser("slime", help="slime --save-debug-train-data files (.pt, globs allowed)")
    s.add_argument("paths", nargs="+", help="train-data files or globs, e.g. 'dump/train_*_*.pt'")
    t = sub.add_parser("table", help="Parquet/JSONL of per-token (or per-response list) log-probs")
    t.add_argument("path", help="Parquet file or directory, or JSONL file")
    t.add_argument("--format", default="auto", choices=("auto", "parquet", "jsonl"))
    t.add_argument("--map", action="append", default=[], metavar="FIELD=COLUMN",
                   help=f"column of each field; fields: {', '.join(REQUIRED + OPTIONAL)} (default: same name)")
    for p in (s, t):
        p.add_argument("--out", required=True, help="run directory to write")
        p.add_argument("--on-invalid", default="quarantine", choices=("quarantine", "raise"),
                       help="invalid tokens (NaN, positive, sentinel log-probs): count and exclude, or stop")
        p.add_argument("--window", type=int, default=25, help="trailing window in steps (default: %(default)s)")
        p.add_argument("--calibration-steps", type=int, default=25,
                       help="steps of the tau_tail reference window (default: %(default)s)")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``triage-monitor import``; prints what was written, returns an exit code (2 on bad input)."""
    cfg = MonitorConfig(window=args.window, calibration_steps=args.calibration_steps)
    try:
        if args.source == "slime":
            files = sorted({f for p in args.paths for f in (glob.glob(p) or [p])})
            missing = [f for f in files if not Path(f).exists()]
            if missing:
                raise ValueError(f"no such file: {missing[0]}")
            steps = slime_steps(files, args.on_invalid)
            manifest = {"framework": "slime", "imported_from": files[:50], "import_source": "save_debug_train_data"}
        else:
            mapping = parse_mapping(args.map)
            steps = table_steps(read_table(args.path, args.format), mapping, args.on_invalid)
            manifest = {"framework": "table", "imported_from": str(args.path), "column_map": mapping}
        n = write_run(steps, args.out, manifest, cfg)
    except (ValueError, OSError, KeyError) as exc:
        print(f"triage-monitor import: {exc}", file=sys.stderr)
        return 2
    print(f"imported {n} step(s) into {args.out}")
    return 0 if n else 2
