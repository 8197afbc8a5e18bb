"""What the background writer costs per token: its Parquet encoding against the alternatives, and its whole work.

1. Encoding of a token table as the monitor writes it (B × 4,096 tokens, per-response advantage) at 64k, 640k and
   4M tokens, the variants written in turns (interleaved rounds, medians): pyarrow's default; the encoding before
   this change (a dictionary for all but the two log-prob columns, statistics of every column, Snappy); ours
   (``triage_monitor.blocks.parquet_options``: the same dictionaries, statistics of step / rank / attempt only, no
   compression).  Write time and file size, and the ratios ours ÷ default and ours ÷ before; each file reads back
   equal.
2. The writer's whole work for a step of each size, as the user's process pays it on the writer thread: the token
   columns built from the batch, the step's pending file (Arrow IPC, LZ4), its Parquet row group, the block sealed
   every ``roll_steps`` steps (``RunWriter.record_step`` → ``ParquetSink.flush``), in ns per token.  The issue's goal:
   ≤ 200 ns a token.

    python benchmarks/bench_writer_encoding.py [--rounds 5] [--steps 6]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from triage_monitor.blocks import dictionary_columns, parquet_options
from triage_monitor.records import TOKEN_SCHEMA

SIZES = (65536, 655360, 4194304)


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


def encodings(rounds: int) -> None:
    rng = np.random.default_rng(0)
    print(f"{'tokens':>9} | {'default ms':>10} {'before ms':>9} {'ours ms':>8} | {'÷ default':>9} {'÷ before':>8} | "
          f"{'default MB':>10} {'before MB':>9} {'ours MB':>8} | {'ours ns/token':>13}")
    for n in SIZES:
        t = token_table(n, rng)
        variants = {"default": {}, "before": {"use_dictionary": dictionary_columns(t.schema)},
                    "ours": parquet_options(t.schema)}
        times: dict = {k: [] for k in variants}
        sizes = {}
        for _ in range(rounds):
            for name, kw in variants.items():
                buf = io.BytesIO()
                t0 = time.perf_counter()
                pq.write_table(t, buf, **kw)
                times[name].append(time.perf_counter() - t0)
                sizes[name] = buf.tell()
                buf.seek(0)
                assert pq.read_table(buf).equals(t), name
        m = {k: statistics.median(v) for k, v in times.items()}
        print(f"{n:>9} | {m['default'] * 1e3:>10.1f} {m['before'] * 1e3:>9.1f} {m['ours'] * 1e3:>8.1f} | "
              f"{m['ours'] / m['default']:>9.2f} {m['ours'] / m['before']:>8.2f} | {sizes['default'] / 1e6:>10.2f} "
              f"{sizes['before'] / 1e6:>9.2f} {sizes['ours'] / 1e6:>8.2f} | {m['ours'] / n * 1e9:>13.1f}", flush=True)


def whole_writer(steps: int) -> None:
    import torch

    from triage_monitor.batch import TokenBatch
    from triage_monitor.config import MonitorConfig
    from triage_monitor.records import RunWriter

    torch.set_num_threads(1)
    print(f"\nthe writer's whole work per step (columns, pending file, Parquet, sealing; median of {steps} steps)")
    print(f"{'tokens':>9} | {'ms/step':>8} {'ns/token':>9}")
    for n in SIZES:
        b = n // 4096
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(1024, 4097, (b,), generator=g)
        mask = torch.arange(4096)[None] < lengths[:, None]
        sampler = -torch.rand(b, 4096, generator=g) * 3
        learner = (sampler + torch.randn(b, 4096, generator=g) * 0.1).clamp(max=0)
        batch = TokenBatch.from_padded(learner, sampler, torch.randn(b, generator=g), mask)
        with tempfile.TemporaryDirectory() as d:
            w = RunWriter(os.path.join(d, "run"), 1, 1, 1, MonitorConfig(tau_tail=-1.0, roll_steps=3).to_dict(), {},
                          {"tool_version": "bench"})
            w.record_step(0, batch, {"a": 1.0}, {}, None, steps_row=False)
            w.sink.flush()
            spent = []
            for s in range(1, steps + 1):
                t0 = time.perf_counter()
                w.record_step(s, batch, {"a": 1.0}, {}, None, steps_row=False)
                w.sink.flush()
                spent.append(time.perf_counter() - t0)
            w.close("finished", steps + 1)
        med = statistics.median(spent)
        print(f"{batch.num_tokens:>9} | {med * 1e3:>8.1f} {med / batch.num_tokens * 1e9:>9.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps of the whole-writer measure (roll_steps 3: seals "
                    "included)")
    args = ap.parse_args()
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    encodings(args.rounds)
    whole_writer(args.steps)


if __name__ == "__main__":
    main()
