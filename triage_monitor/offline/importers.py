"""``triage-monitor import``: turn what an unmonitored run already dumped into a run directory.

The sources (docs/hooks.md, "Importing existing logs"):

* a framework's dumps — ``slime`` and ``miles`` ``--save-debug-train-data`` files — are read beside the
  framework's hook (``hooks/slime_dumps.py``, named in ``hooks/frameworks.py``'s ``DUMP_READERS``), by a
  :class:`StepReader` this module's :func:`write_run` takes the steps of;
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

from pathlib import Path
from typing import Dict, Iterable, Iterator, Optional, Protocol, Tuple

import numpy as np
import pandas as pd
import torch

from ..batch import TokenBatch
from ..monitor import MismatchMonitor, MonitorConfig

from ..config import TABLE_OPTIONAL_FIELDS as OPTIONAL, TABLE_REQUIRED_FIELDS as REQUIRED  # noqa: E402


# ------------------------------------------------------------------- dump readers
class StepReader(Protocol):
    """A framework's dump reader (``hooks/frameworks.py``'s ``DUMP_READERS`` name them, ``"module:function"``):
    its dump files → ``(step, TokenBatch)`` pairs, in step order, for :func:`write_run`.

    Args:
        paths: the dump files (globs already expanded).
        on_invalid: ``"quarantine"`` or ``"raise"`` (:class:`~triage_monitor.batch.TokenBatch`).
        info: filled with what run.json records of the import (``formats``, ``replica_files_dropped``, ...) when
            given.

    Raises:
        ValueError: a file cannot be read or is not a dump of the framework (the message starts with its path).
    """

    def __call__(self, paths: Iterable[str], on_invalid: str = "quarantine",
                 info: Optional[dict] = None) -> Iterator[Tuple[int, TokenBatch]]: ...


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
        ValueError: unknown format, no such file, a CSV / spreadsheet (not read; the message says how to
            convert it), or a file that is not valid Parquet / JSON Lines (the message names it).
    """
    if not Path(path).exists():
        raise ValueError(f"{path}: no such file or directory")
    name = str(path).lower()
    if fmt == "auto":
        if name.endswith((".csv", ".tsv", ".xlsx", ".xls", ".txt")):
            raise ValueError(f"{path}: {Path(name).suffix} files are not read; import table reads Parquet (a file "
                             "or a directory of files) or JSON Lines (.jsonl). Convert it first, e.g. "
                             "pandas.read_csv(path).to_parquet('tokens.parquet')")
        fmt = "jsonl" if name.endswith((".jsonl", ".json", ".jsonl.gz")) else "parquet"
    try:
        if fmt == "parquet":
            return _named(pd.read_parquet(path), path)
        if fmt == "jsonl":
            # dtype=False: values as JSON has them; pandas' inference would turn true or "1" in an integer column
            # into 1 before the checks of table_steps could see it
            return _named(pd.read_json(path, lines=True, dtype=False), path)
    except (ValueError, OSError) as exc:   # pyarrow's ArrowInvalid is a ValueError
        if isinstance(exc, (PermissionError, IsADirectoryError)):
            raise
        raise ValueError(f"{path}: not readable as {fmt} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                         "import table reads Parquet or JSON Lines (--format parquet|jsonl)") from exc
    raise ValueError(f"unknown format {fmt!r}: use parquet or jsonl")


def _named(df: pd.DataFrame, path) -> pd.DataFrame:
    df.attrs["source"] = str(path)          # what table_steps names in its errors
    return df


#: Fields whose values must be integers (an integral float such as 3.0 is one; a boolean is not).
INTEGER_FIELDS = ("step", "sample_id", "position", "group_id")
_INT64_MAX = np.iinfo(np.int64).max


def _refuse(where: str, row, field: str, column: str, value, why: str) -> ValueError:
    """The one error of a bad table value; ``value`` None: a null."""
    what = "is null" if value is None else f"= {value!r}"
    return ValueError(f"{where}: row {row}: {field} (column {column!r}) {what}: {why}")


def _integer_values(df: pd.DataFrame, field: str, column: str, where: str) -> np.ndarray:
    """``df[field]`` as int64, or ValueError naming the file, the first bad row (0-based, the table's own row for
    a wide table), the field, its column and the value: a null, a boolean, a fraction, a string, a value outside
    int64, or a negative position."""
    s = df[field].infer_objects()
    rows = df["_row"].to_numpy()
    why = "not an integer (steps, sample ids, positions and group ids are integers)"
    if s.dtype == bool:
        raise _refuse(where, rows[0], field, column, bool(s.iloc[0]), "a boolean, not an integer")
    if pd.api.types.is_integer_dtype(s.dtype):
        v = s.to_numpy()
        if v.dtype == np.uint64 and (v > _INT64_MAX).any():
            i = int(np.argmax(v > _INT64_MAX))
            raise _refuse(where, rows[i], field, column, int(v[i]), "outside int64")
        out = v.astype(np.int64)
    elif pd.api.types.is_float_dtype(s.dtype):
        v = s.to_numpy(dtype=np.float64)
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(v) | (v != np.floor(v)) | (v >= 2.0 ** 63) | (v < -2.0 ** 63)
        if bad.any():
            i = int(np.argmax(bad))
            x = float(v[i])
            raise _refuse(where, rows[i], field, column, None if np.isnan(x) else x,
                          "outside int64" if np.isfinite(x) and x == np.floor(x) else why)
        out = v.astype(np.int64)
    else:                                   # mixed / object values: each must be an integer (or integral float)
        out = np.empty(len(s), dtype=np.int64)
        for i, x in enumerate(s.tolist()):
            if x is None or (isinstance(x, float) and np.isnan(x)):
                raise _refuse(where, rows[i], field, column, None, why)
            if isinstance(x, (bool, np.bool_)):
                raise _refuse(where, rows[i], field, column, bool(x), "a boolean, not an integer")
            if isinstance(x, (int, np.integer)) and -2 ** 63 <= int(x) <= _INT64_MAX:
                out[i] = int(x)
            elif isinstance(x, (float, np.floating)) and float(x).is_integer() and abs(float(x)) < 2.0 ** 63:
                out[i] = int(x)
            else:
                raise _refuse(where, rows[i], field, column, x, "outside int64" if isinstance(x, (int, np.integer))
                              else why)
    if field == "position" and (out < 0).any():
        i = int(np.argmax(out < 0))
        raise _refuse(where, rows[i], field, column, int(out[i]), "a position is >= 0 (index inside the response)")
    return out


def _mask_values(df: pd.DataFrame, column: str, where: str) -> np.ndarray:
    """``df["mask"]`` as bool: booleans, or numbers that are exactly 0 or 1; anything else (−1, 0.0001, null,
    "no") is refused naming the file, the row, the column and the value."""
    s = df["mask"].infer_objects()
    rows = df["_row"].to_numpy()
    why = "a mask is 0 / 1 or a boolean"
    if s.dtype == bool:
        return s.to_numpy()
    if pd.api.types.is_numeric_dtype(s.dtype):
        v = s.to_numpy(dtype=np.float64)
        bad = ~((v == 0) | (v == 1))                      # NaN (a null) is neither
        if bad.any():
            i = int(np.argmax(bad))
            raise _refuse(where, rows[i], "mask", column, None if np.isnan(v[i]) else s.iloc[i].item(), why)
        return v == 1
    out = np.empty(len(s), dtype=bool)
    for i, x in enumerate(s.tolist()):
        if isinstance(x, (bool, np.bool_)):
            out[i] = bool(x)
        elif isinstance(x, (int, float, np.integer, np.floating)) and x in (0, 1):
            out[i] = x == 1
        else:
            raise _refuse(where, rows[i], "mask", column, None if x is None or x != x else x, why)
    return out


def _float_values(g: pd.DataFrame, field: str, column: str, where: str) -> torch.Tensor:
    """``g[field]`` as a float32 tensor; a null is NaN (quarantined or refused downstream as non-finite), a value
    that is not a number (a string) is refused naming the file, the row, the column and the value."""
    try:
        return torch.from_numpy(g[field].to_numpy(dtype=np.float32, na_value=np.nan, copy=True))
    except (TypeError, ValueError):
        num = pd.to_numeric(g[field], errors="coerce")
        bad = (num.isna() & g[field].notna()).to_numpy()
        i = int(np.argmax(bad))
        raise _refuse(where, g["_row"].iloc[i], field, column, g[field].iloc[i], "not a number") from None


def table_steps(df: pd.DataFrame, mapping: Dict[str, str],
                on_invalid: str = "quarantine", *, source: Optional[str] = None) -> Iterator[Tuple[int, TokenBatch]]:
    """Yield ``(step, TokenBatch)`` from a per-token (or per-response list-valued) table.

    Optional fields (``position``, ``mask``, ``group_id``) are read from ``mapping`` or, unmapped,
    from a column of the field's own name when the table has one.  ``step``, ``sample_id``, ``position``
    and ``group_id`` must be integers (:data:`INTEGER_FIELDS`: 3 and 3.0 are, 1.7, ``true``, a string
    and a null are not), ``mask`` 0 / 1 or a boolean.  Errors name ``source`` (default: the path
    :func:`read_table` read, else "table"), the row (0-based; a wide table's own row), the field, its
    column and the value.

    Raises:
        ValueError: a required or explicitly mapped column is missing, list columns of one row
            differ in length, an integer field holds anything but an integer (a negative position
            included), a mask anything but 0 / 1 or a boolean, or a log-prob / advantage a string.
    """
    where = source or df.attrs.get("source") or "table"
    # required fields and explicitly mapped optional ones must exist; an unmapped optional field is
    # used when the table has a column of its own name (a `mask` column is never silently ignored)
    missing = [f"{f} (column {mapping[f]!r})" for f in REQUIRED + OPTIONAL
               if f in mapping and mapping[f] not in df.columns]
    if missing:
        raise ValueError(f"table has no column for {missing}; columns are {list(df.columns)}; use --map field=column")
    cols = {f: mapping.get(f, f) for f in REQUIRED + OPTIONAL if mapping.get(f, f) in df.columns}
    df = df[list(dict.fromkeys(cols.values()))].rename(columns={v: k for k, v in cols.items()})
    df["_row"] = np.arange(len(df))                        # the table's own row, named in errors
    list_cols = [c for c in ("learner_logp", "sampler_logp", "advantage", "mask", "position")
                 if c in df.columns and len(df) and isinstance(df[c].iloc[0], (list, np.ndarray))]
    if list_cols:                                          # wide: one row per response
        lens = np.stack([df[c].map(len).to_numpy() for c in list_cols])
        if (lens != lens[0]).any():
            bad = int(np.nonzero((lens != lens[0]).any(0))[0][0])
            raise ValueError(f"row {bad}: list columns {list_cols} have lengths {lens[:, bad].tolist()}")
        df = df.explode(list_cols, ignore_index=True)
    for f in INTEGER_FIELDS:
        if f in df.columns:
            df[f] = _integer_values(df, f, cols[f], where)
    if "position" not in df.columns:
        df["position"] = df.groupby(["step", "sample_id"], sort=False).cumcount()
    if "mask" in df.columns:
        df = df[_mask_values(df, cols["mask"], where)]
    for step, g in df.groupby("step", sort=True):
        ints = lambda c: torch.from_numpy(g[c].to_numpy(dtype=np.int64, copy=True))  # noqa: E731
        floats = lambda c: _float_values(g, c, cols[c], where)  # noqa: E731
        yield int(step), TokenBatch.from_flat(
            floats("learner_logp"), floats("sampler_logp"), floats("advantage"), ints("sample_id"), ints("position"),
            group_id=ints("group_id") if "group_id" in g.columns else None, on_invalid=on_invalid)


# ------------------------------------------------------------------- write
def write_run(steps: Iterable[Tuple[int, TokenBatch]], run_dir, manifest: dict,
              config: Optional[MonitorConfig] = None, *, resume: bool = False, force: bool = False) -> int:
    """Log every ``(step, batch)`` through a MismatchMonitor into ``run_dir``; returns the number of steps.

    An import is no training job: it waits for the disk (no bound on the close) and fails when any row could
    not be written, the run then marked ``failed`` in run.json.

    Raises:
        triage_monitor.records.OutputError: ``run_dir`` cannot be written or holds another run (``resume`` /
            ``force``: :class:`~triage_monitor.monitor.MismatchMonitor`), before the first step is logged.
        UnwritableOutputError: rows were dropped (a full disk, a file size limit, a read-only remount): the
            message names the run, the rows lost and the writer's last error.
    """
    from ..errors import UnwritableOutputError

    n = 0
    mon = MismatchMonitor(run_dir, config or MonitorConfig(), manifest=manifest, resume=resume, force=force)
    try:
        for step, batch in steps:
            mon.log_step(step, batch)
            n += 1
        mon.flush(timeout=None)
    except BaseException as exc:          # Ctrl-C says interrupted, as MismatchMonitor's own ``with`` block does
        mon.close("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed", timeout=None)
        raise
    sink = mon.sink
    status = "failed" if sink.dropped_rows else "finished"
    mon.close(status, timeout=None)
    if sink.dropped_rows:
        raise UnwritableOutputError(f"{mon.run_dir}: {sink.dropped_rows} of {sink.dropped_rows + sink.written_rows} "
                                    f"record row(s) could not be written ({sink.last_error}); the imported run is "
                                    "incomplete (run.json says failed): free the space and import again with --force",
                                    mon.run_dir)
    return n
