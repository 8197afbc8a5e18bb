"""Cost of the flat table layout's int64 ``step`` / ``rank`` columns in a token file (they make every table
read with plain pandas / pyarrow / DuckDB / Polars; constant columns compress to a few hundred bytes).

    python benchmarks/bench_table_layout.py [--tokens 65536]

Prints the Parquet size of one step's token file without and with the two columns, measured in one run.
"""

from __future__ import annotations

import argparse
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536, help="tokens in the step (multiple of 1,024)")
    n = ap.parse_args().tokens
    rng = np.random.default_rng(0)
    responses = n // 1024
    base = {"sample_id": np.repeat(np.arange(responses), 1024), "group_id": np.repeat(np.arange(responses) // 4, 1024),
            "position": np.tile(np.arange(1024, dtype=np.int32), responses),
            "learner_logp": -rng.random(n, dtype=np.float32), "sampler_logp": -rng.random(n, dtype=np.float32),
            "advantage": np.repeat(rng.standard_normal(responses).astype(np.float32), 1024),
            "attempt": np.full(n, 1796125869260482519)}

    def size(cols) -> int:
        buf = io.BytesIO()
        pq.write_table(pa.table(cols), buf)
        return buf.tell()

    without = size(base)
    with_cols = size({"step": np.full(n, 123456, np.int64), "rank": np.full(n, 3, np.int64), **base})
    print(f"token file of {n:,} tokens: {without:,} B without step/rank columns, {with_cols:,} B with them "
          f"(+{with_cols - without:,} B, ratio {with_cols / without:.4f})")


if __name__ == "__main__":
    main()
