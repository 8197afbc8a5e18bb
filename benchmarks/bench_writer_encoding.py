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

3. The writer ÷ the Parquet floor (goal ≤ 1.5x) at 36k, 400k and 2.6M valid tokens a rank-step
   (B × 4,096 padded tokens, lengths uniform in [1,024, 4,096]): the process's CPU time for a whole block of
   ``--block`` steps — ``RunWriter.record_step`` and ``flush`` each step (the columns built from the batch, each
   step's pending file, its row group, the block sealed at its last step) — against ``pyarrow.parquet.write_table``
   of the identical table (the block read back) with the same options (``blocks.parquet_options``) to a file beside
   it, the two alternated round by round in one process; medians of the rounds, ns a token, and the block's bytes a
   token.  With ``--old CHECKOUT`` (e.g. ``git worktree add /tmp/old <commit>``) the same figure runs in processes
   of that checkout's package alternated with this one's (the tables each writes are compared: equal).

4. The writer's shared row-group size (``blocks.ROW_GROUP_BYTES``: 4 MiB against 16 MiB) at ~31k-token steps, blocks of
   16 steps, the two alternated round by round in this process: ns a token against the floor, bytes a token.

    python benchmarks/bench_writer_encoding.py [--rounds 5] [--steps 6] [--figures 1,2,3,4] [--old /tmp/old]
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

from triage_monitor.rundir.blocks import dictionary_columns, parquet_options
from triage_monitor.rundir.records import TOKEN_SCHEMA

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
    from triage_monitor.rundir.records import RunWriter

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


#: Figure 3's sizes: responses of B × 4,096 padded tokens giving ~36k, ~400k and ~2.6M valid tokens a rank-step.
FLOOR_RESPONSES = (14, 156, 1016)


def _floor_batch(b: int):
    import torch

    from triage_monitor.batch import TokenBatch

    g = torch.Generator().manual_seed(b)
    lengths = torch.randint(1024, 4097, (b,), generator=g)
    mask = torch.arange(4096)[None] < lengths[:, None]
    sampler = -torch.rand(b, 4096, generator=g) * 3
    learner = (sampler + torch.randn(b, 4096, generator=g) * 0.1).clamp(max=0)
    return TokenBatch.from_padded(learner, sampler, torch.randn(b, generator=g), mask,
                                  group_ids=torch.arange(b) // 8)


def floor_rounds(b: int, rounds: int, block: int, out_dir: str) -> dict:
    """Figure 3 at ``b`` responses in this process: ``{"tokens", "writer", "floor" (CPU s a block, per round),
    "bytes" (the last block's file), "table" (its path)}``; the writer's blocks and the floor's files are kept in
    ``out_dir``."""
    import glob

    import pyarrow.parquet as pq_
    import torch

    from triage_monitor.config import MonitorConfig
    from triage_monitor.rundir.records import RunWriter

    torch.set_num_threads(1)
    batch = _floor_batch(b)
    run = os.path.join(out_dir, "run")
    w = RunWriter(run, 1, 0, 1, MonitorConfig(tau_tail=-1.0, roll_steps=block).to_dict(), {}, {"tool_version": "bench"})
    for s in range(block):                   # a first block and its floor: imports, first allocations, untimed
        w.record_step(s, batch, {"a": 1.0}, {}, None, steps_row=False)
        w.sink.flush()
    (first,) = glob.glob(os.path.join(run, "tokens", "steps-00000000-*.parquet"))
    first = pq_.read_table(first)
    pq_.write_table(first, os.path.join(out_dir, "floor-0.parquet"), **parquet_options(first.schema))
    got: dict = {"tokens": batch.num_tokens, "writer": [], "floor": []}
    for r in range(1, rounds + 1):
        t0 = time.process_time()
        for s in range(r * block, (r + 1) * block):
            w.record_step(s, batch, {"a": 1.0}, {}, None, steps_row=False)
            w.sink.flush()
        got["writer"].append(time.process_time() - t0)
        (path,) = glob.glob(os.path.join(run, "tokens", f"steps-{r * block:08d}-*.parquet"))
        table = pq_.read_table(path)
        floor = os.path.join(out_dir, f"floor-{r}.parquet")
        t0 = time.process_time()
        pq_.write_table(table, floor, **parquet_options(table.schema))
        got["floor"].append(time.process_time() - t0)
        assert pq_.read_table(floor).equals(table)
        got["bytes"], got["table"] = os.path.getsize(path), path
        os.unlink(floor)
    w.close("finished", (rounds + 1) * block)
    return got


def writer_floor(rounds: int, block: int, old: str = "") -> None:
    import json
    import subprocess
    import sys

    print(f"\nthe writer ÷ the Parquet floor (process CPU a block of {block} steps, pending files and sealing included, "
          f"against pq.write_table of the block's table; alternated, medians of {rounds} rounds)")
    print(f"{'tokens':>9} | {'writer ns/tok':>13} {'floor ns/tok':>12} {'ratio':>6} | {'bytes/tok':>9}"
          + (f" | {'old writer':>10} {'old ratio':>9} {'new ÷ old':>9}" if old else ""))
    here = str(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for b in FLOOR_RESPONSES:
        res: dict = {"new": [], "old": []}
        with tempfile.TemporaryDirectory() as d:
            for r in range(rounds if old else 1):        # with --old: one round a process, alternated
                for name, code in (("new", here), ("old", old)) if old else (("new", here),):
                    out = os.path.join(d, f"{name}-{r}")
                    os.makedirs(out)
                    cmd = [sys.executable, __file__, "--one", str(b), "--rounds", "1" if old else str(rounds),
                           "--block", str(block), "--out", out]
                    env = {**os.environ, "PYTHONPATH": code + os.pathsep + os.environ.get("PYTHONPATH", "")}
                    line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                    res[name].append(json.loads(line.strip().splitlines()[-1]))
            if old:
                a, o = pq.read_table(res["new"][0]["table"]), pq.read_table(res["old"][0]["table"])
                assert a.equals(o), "the new and the old writer's blocks differ"
        n = res["new"][0]["tokens"] * block
        wr = statistics.median(x for g in res["new"] for x in g["writer"])
        fl = statistics.median(x for g in res["new"] for x in g["floor"])
        line = (f"{res['new'][0]['tokens']:>9} | {wr / n * 1e9:>13.1f} {fl / n * 1e9:>12.1f} {wr / fl:>6.2f} | "
                f"{res['new'][0]['bytes'] / n:>9.2f}")
        if old:
            ow = statistics.median(x for g in res["old"] for x in g["writer"])
            of = statistics.median(x for g in res["old"] for x in g["floor"])
            line += f" | {ow / n * 1e9:>10.1f} {ow / of:>9.2f} {wr / ow:>9.2f}"
        print(line, flush=True)


def row_group_sizes(rounds: int, block: int, sizes=(4, 16), responses: int = 12) -> None:
    """Figure 4: the writer's shared row-group size (``blocks.ROW_GROUP_BYTES``, MiB) at small rank-steps (``responses``
    responses: ~31k tokens, the many-rank shape), the sizes alternated round by round in this process, each a block
    of ``block`` steps against the Parquet floor (:func:`floor_rounds`); medians, ns a token and bytes a token."""
    from triage_monitor.rundir import blocks

    print(f"\nthe shared row-group size (blocks.ROW_GROUP_BYTES) at small steps: blocks of {block} steps, sizes "
          f"alternated, medians of {rounds} rounds")
    print(f"{'MiB':>5} {'tokens':>9} | {'writer ns/tok':>13} {'floor ns/tok':>12} {'ratio':>6} | {'bytes/tok':>9}")
    keep = blocks.ROW_GROUP_BYTES
    res: dict = {m: [] for m in sizes}
    try:
        for r in range(rounds):
            for mib in (sizes if r % 2 == 0 else tuple(reversed(sizes))):
                blocks.ROW_GROUP_BYTES = mib << 20
                with tempfile.TemporaryDirectory() as d:
                    got = floor_rounds(responses, 1, block, d)
                n = got["tokens"] * block
                res[mib].append((got["writer"][0] / n * 1e9, got["floor"][0] / n * 1e9, got["bytes"] / n, got["tokens"]))
    finally:
        blocks.ROW_GROUP_BYTES = keep
    for mib, v in res.items():
        w, f = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
        print(f"{mib:>5} {v[0][3]:>9} | {w:>13.1f} {f:>12.1f} {w / f:>6.2f} | {statistics.median(x[2] for x in v):>9.2f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps of the whole-writer measure (roll_steps 3: seals "
                    "included)")
    ap.add_argument("--figures", default="1,2,3")
    ap.add_argument("--block", type=int, default=4, help="figure 3: steps a block (roll_steps)")
    ap.add_argument("--old", default="", help="figure 3: a checkout to compare with, alternated by process")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)        # figure 3 in this process (B responses)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        import json

        got = floor_rounds(args.one, args.rounds, args.block, args.out)
        print(json.dumps(got))
        return
    figures = {int(f) for f in args.figures.split(",")}
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    if 1 in figures:
        encodings(args.rounds)
    if 2 in figures:
        whole_writer(args.steps)
    if 3 in figures:
        writer_floor(args.rounds, args.block, args.old)
    if 4 in figures:
        row_group_sizes(args.rounds, 16)
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
