"""The writer's Parquet encoding of a token file: pyarrow's default (a dictionary for every column) against the
run writer's (``triage_monitor.sink.dictionary_columns``: no dictionary for the two log-prob columns), on token
tables as the monitor writes them (B × 4,096 tokens, per-response advantage), at 64k, 640k and 4M tokens.  Prints
per size the median write time of each (5 writes), their ratio, the file sizes and their ratio, and checks that the
file reads back equal.

    python benchmarks/bench_writer_encoding.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from triage_monitor.records import TOKEN_SCHEMA
from triage_monitor.sink import dictionary_columns


def token_table(n: int, rng) -> pa.Table:
    b = n // 4096
    cols = {"step": np.full(n, 7, np.int64), "rank": np.full(n, 3, np.int64),
            "sample_id": np.repeat(np.arange(b), 4096).astype(np.int64),
            "group_id": np.repeat(np.arange(b) // 8, 4096).astype(np.int64),
            "position": np.tile(np.arange(4096), b).astype(np.int32),
            "learner_logp": (-rng.random(n) * 3).astype(np.float32),
            "sampler_logp": (-rng.random(n) * 3).astype(np.float32),
            "advantage": np.repeat(rng.standard_normal(b), 4096).astype(np.float32),
            "attempt": np.full(n, 1764700000000000000, np.int64)}
    return pa.table({f.name: cols[f.name] for f in TOKEN_SCHEMA}, schema=TOKEN_SCHEMA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    path = os.path.join(tempfile.mkdtemp(prefix="bench-enc-"), "t.parquet")
    print(f"{'tokens':>9} | {'default ms':>10} {'ours ms':>8} {'ratio':>6} | {'default MB':>10} {'ours MB':>8} "
          f"{'ratio':>6} | {'ours µs/token':>13}")
    for n in (65536, 655360, 4194304):
        t = token_table(n, rng)
        res = {}
        for name, kw in (("default", {}), ("ours", {"use_dictionary": dictionary_columns(t.schema)})):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                pq.write_table(t, path, **kw)
                times.append(time.perf_counter() - t0)
            assert pq.read_table(path).equals(t)
            res[name] = (statistics.median(times), os.path.getsize(path))
        (dt, ds), (ot, os_) = res["default"], res["ours"]
        print(f"{n:>9} | {dt * 1e3:>10.1f} {ot * 1e3:>8.1f} {ot / dt:>6.2f} | {ds / 1e6:>10.2f} {os_ / 1e6:>8.2f} "
              f"{os_ / ds:>6.3f} | {ot / n * 1e6:>13.3f}", flush=True)
    os.remove(path)


if __name__ == "__main__":
    main()
