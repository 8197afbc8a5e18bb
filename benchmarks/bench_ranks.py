"""The post-mortem at the shape of real jobs: the same tokens written by 1, 8, 32, 128 ranks.

A data-parallel job is simulated with the project's own writer (``RunWriter.record_step``, one writer a rank, all in
this process): every step is one set of responses of 1k-8k tokens (lengths uniform), split over the ranks in
contiguous shares, so the runs of every rank count hold exactly the same tokens.  For each rank count it prints,
interleaved round by round (the variants see the same load; the load average is printed with each round):

  1. the state pass (``recompute_states``, nothing cached: decode + metric kernel), CPU ns a token of this process
     and wall, and its ratio to the 1-rank run (goal <= 1.2);
  2. the whole ``triage-monitor analyze RUN`` command in a fresh process, the run's ``analysis/`` cache removed,
     CPU (the child's user + system) and wall ns a token, ratio to the 1-rank run (goal <= 1.3);
  3. a bare pyarrow decode of the same columns (``pq.read_table`` of every token file whole, ``to_numpy``), a
     DuckDB SQL and a Polars lazy scan computing the basic direction quantities (per step: tokens, small-gap
     count, the four quadrant masses of δ × advantage) over the same files; the ratios analyze ÷ decode
     (throughput, goal >= 0.8) and analyze ÷ DuckDB (time, goal <= 1.5);
  4. with ``--workers N``: ``analyze --workers N`` ÷ one process (wall, cold), and ``--ray``: the Ray engine's;
  5. with ``--big RANKS,STEPS,TOKENS`` (e.g. 64,300,3400000: 1 G tokens, ~10 GB): that run built, then ``analyze``
     on it cold (its ``analysis/`` removed) once: wall, CPU, the child's peak resident memory, the progress bar
     shown on a terminal (``script`` gives it one); the run deleted afterwards unless ``--keep``.

    python benchmarks/bench_ranks.py [--ranks 1,8,32,128] [--steps 16] [--tokens-per-step 1500000] [--rounds 3]
                                     [--root /tmp/tm-bench-ranks] [--keep] [--figures 1,2,3]

Runs are built once under ``--root`` and reused (``--keep``), else deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: the small-gap threshold of the DuckDB / Polars queries (MetricConfig's default)
SMALL_GAP = None


def step_tokens(step: int, tokens: int, seed: int = 0) -> dict:
    """One step's responses, 1k-8k tokens each (uniform lengths), ``tokens`` in all (the last one cut): flat
    numpy columns in (sample_id, position) order."""
    rng = np.random.default_rng(seed * 1_000_003 + step)
    lens = []
    total = 0
    while total < tokens:
        n = int(min(rng.integers(1024, 8193), tokens - total))
        lens.append(n)
        total += n
    lens = np.asarray(lens, np.int64)
    n = int(lens.sum())
    sample = np.repeat(np.arange(len(lens), dtype=np.int64) + step * 100_000, lens)
    pos = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    sampler = (-rng.random(n, dtype=np.float32) * 3).astype(np.float32)
    delta = (rng.standard_normal(n, dtype=np.float32) * np.float32(0.05)).astype(np.float32)
    tail = rng.random(n, dtype=np.float32) < 0.01
    delta[tail] -= np.float32(1.0)
    learner = np.minimum(sampler + delta, np.float32(0)).astype(np.float32)
    adv = rng.standard_normal(len(lens)).astype(np.float32)[np.repeat(np.arange(len(lens)), lens)]
    return {"lens": lens, "sample": sample, "pos": pos, "learner": learner, "sampler": sampler, "adv": adv}


def build_run(path: Path, ranks: int, steps: int, tokens: int, tau: float = -0.5) -> int:
    """Write the ``ranks``-rank run of ``steps`` steps of ``tokens`` tokens with the project's writer; returns the
    tokens written.  The responses of a step go to the ranks in contiguous shares (rank r: responses
    ``[r * n // ranks, (r + 1) * n // ranks)``)."""
    import torch

    from triage_monitor.batch import TokenBatch
    from triage_monitor.config import MonitorConfig
    from triage_monitor.monitor import MismatchMonitor, steps_schema
    from triage_monitor.rundir.records import RunWriter

    cfg = MonitorConfig(tau_tail=tau, alignment_check_steps=0)
    probe = step_tokens(0, 20_000)
    tmp = path.parent / (path.name + ".probe")
    with MismatchMonitor(tmp, cfg, alerts=False) as mon:          # the metrics and extras of one real step
        metrics = mon.log_step(0, TokenBatch.from_flat(*(torch.from_numpy(probe[k]) for k in (
            "learner", "sampler", "adv", "sample", "pos"))))
    shutil.rmtree(tmp, ignore_errors=True)
    attempt = time.time_ns()
    writers = []
    for r in range(ranks):
        w = RunWriter(str(path), attempt, r, ranks, cfg.to_dict(), {"framework": "bench"}, {"tool_version": "bench"},
                      max_queue_bytes=32 << 20)
        w.declare_steps(steps_schema([]))
        writers.append(w)
    n_all = 0
    for s in range(steps):
        d = step_tokens(s, tokens)
        ends = np.concatenate([[0], np.cumsum(d["lens"])])
        nresp = len(d["lens"])
        for r, w in enumerate(writers):
            a, b = ends[r * nresp // ranks], ends[(r + 1) * nresp // ranks]
            if b == a:
                continue
            t = {k: torch.from_numpy(np.ascontiguousarray(d[k][a:b])) for k in ("learner", "sampler", "adv",
                                                                                 "sample", "pos")}
            batch = TokenBatch.from_flat(t["learner"], t["sampler"], t["adv"], t["sample"], t["pos"],
                                         group_id=t["sample"] // 16)
            w.record_step(s, batch, {**metrics, "step": s}, {}, None, steps_row=r == 0)
            n_all += b - a
    for w in writers:
        w.close("finished", steps)
    return n_all


def ensure_run(root: Path, ranks: int, steps: int, tokens: int) -> Path:
    path = root / f"r{ranks}-s{steps}-t{tokens}"
    done = path / "run.json"
    if done.exists() and json.loads(done.read_text()).get("status") == "finished":
        return path
    shutil.rmtree(path, ignore_errors=True)
    t = time.perf_counter()
    n = build_run(path, ranks, steps, tokens)
    print(f"   built {path.name}: {n:,} tokens, {ranks} ranks in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def token_files(run_path: Path) -> list:
    from triage_monitor.offline.analysis import open_run

    run = open_run(run_path)
    return list(dict.fromkeys(f for s in run.step_numbers() for f in run.token_files(s)))


def state_pass(run_path: Path) -> tuple:
    """(CPU s of this process, wall s) of ``recompute_states`` of the run, nothing cached."""
    from triage_monitor.offline.analysis import open_run, recompute_states

    run = open_run(run_path)
    c, t = time.process_time(), time.perf_counter()
    recompute_states(run)
    return time.process_time() - c, time.perf_counter() - t


def analyze_command(run_path: Path, *extra: str) -> tuple:
    """(CPU s of the child, wall s) of ``python -m triage_monitor analyze RUN`` with the cache removed."""
    shutil.rmtree(run_path / "analysis", ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "triage_monitor", "analyze", str(run_path), *extra], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode not in (0, 1, 3):
        raise RuntimeError(f"analyze failed ({r.returncode}): {r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def bare_decode(files: list) -> tuple:
    """(CPU s, wall s) of decoding the analysed columns of every token file whole to numpy (pyarrow's threads)."""
    import pyarrow.parquet as pq

    from triage_monitor.offline.analysis import TOKEN_COLUMNS

    c, t = time.process_time(), time.perf_counter()
    for f in files:
        tab = pq.read_table(f, columns=list(TOKEN_COLUMNS))
        [tab.column(k).to_numpy() for k in TOKEN_COLUMNS]
    return time.process_time() - c, time.perf_counter() - t


def _small_gap() -> float:
    from triage_monitor.metrics.stats import MetricConfig

    return float(MetricConfig().small_gap_threshold)


def duckdb_query(run_path: Path, con) -> tuple:
    """(CPU s, wall s) of the basic direction quantities per step in DuckDB SQL over the run's token files."""
    glob = str(run_path / "tokens" / "*.parquet")
    sql = f"""
        SELECT step, count(*) AS n,
               sum(CASE WHEN abs(learner_logp - sampler_logp) < {_small_gap()} THEN 1 ELSE 0 END) AS small,
               sum(CASE WHEN learner_logp - sampler_logp > 0 AND advantage > 0 THEN learner_logp - sampler_logp ELSE 0 END) AS pp,
               sum(CASE WHEN learner_logp - sampler_logp > 0 AND advantage <= 0 THEN learner_logp - sampler_logp ELSE 0 END) AS pn,
               sum(CASE WHEN learner_logp - sampler_logp <= 0 AND advantage > 0 THEN sampler_logp - learner_logp ELSE 0 END) AS np_,
               sum(CASE WHEN learner_logp - sampler_logp <= 0 AND advantage <= 0 THEN sampler_logp - learner_logp ELSE 0 END) AS nn
        FROM read_parquet('{glob}') GROUP BY step ORDER BY step"""
    c, t = time.process_time(), time.perf_counter()
    con.execute(sql).fetchall()
    return time.process_time() - c, time.perf_counter() - t


def polars_query(run_path: Path) -> tuple:
    """(CPU s, wall s) of the same quantities as a Polars lazy scan."""
    import polars as pl

    d = pl.col("learner_logp") - pl.col("sampler_logp")
    pos, adv = d > 0, pl.col("advantage") > 0
    c, t = time.process_time(), time.perf_counter()
    (pl.scan_parquet(str(run_path / "tokens" / "*.parquet"))
     .group_by("step").agg(pl.len().alias("n"), (d.abs() < _small_gap()).sum().alias("small"),
                           pl.when(pos & adv).then(d).otherwise(0).sum().alias("pp"),
                           pl.when(pos & ~adv).then(d).otherwise(0).sum().alias("pn"),
                           pl.when(~pos & adv).then(-d).otherwise(0).sum().alias("np"),
                           pl.when(~pos & ~adv).then(-d).otherwise(0).sum().alias("nn"))
     .sort("step").collect())
    return time.process_time() - c, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,8,32,128")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tokens-per-step", type=int, default=1_500_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", type=Path, default=Path("/tmp/tm-bench-ranks"))
    ap.add_argument("--keep", action="store_true", help="keep the runs for the next invocation")
    ap.add_argument("--figures", default="1,2,3", help="of 1 (state pass), 2 (analyze command), 3 (decode, "
                    "DuckDB, Polars)")
    ap.add_argument("--workers", type=int, default=0, help="figure 4: analyze --workers N ÷ one process")
    ap.add_argument("--ray", action="store_true", help="figure 4: analyze --engine ray ÷ one process")
    ap.add_argument("--big", default="", help="figure 5: RANKS,STEPS,TOKENS_PER_STEP of a run analysed cold once")
    args = ap.parse_args()
    if args.big:
        big(args)
        return
    figures = {int(f) for f in args.figures.split(",") if f}
    ranks = [int(r) for r in args.ranks.split(",")]
    args.root.mkdir(parents=True, exist_ok=True)
    runs = {r: ensure_run(args.root, r, args.steps, args.tokens_per_step) for r in ranks}
    from triage_monitor.offline.analysis import open_run, recompute_states

    import pyarrow.parquet as pq

    files = {r: token_files(p) for r, p in runs.items()}
    n = {r: sum(pq.read_metadata(f).num_rows for f in fs) for r, fs in files.items()}
    recompute_states(open_run(runs[ranks[0]]), steps=[0])               # compile / load the kernel once
    import duckdb

    con = duckdb.connect()
    kinds = []
    if 1 in figures:
        kinds.append("state")
    if 2 in figures:
        kinds.append("analyze")
    if 3 in figures:
        kinds += ["decode", "duckdb", "polars"]
    if args.workers:
        kinds.append(f"workers{args.workers}")
    if args.ray:
        kinds.append("ray")
    res: dict = {(k, r): [] for k in kinds for r in ranks}
    for rd in range(args.rounds):
        print(f"round {rd + 1}/{args.rounds}: load average {os.getloadavg()[0]:.2f}", flush=True)
        order = ranks if rd % 2 == 0 else ranks[::-1]
        for r in order:
            for k in kinds:
                if k == "state":
                    res[k, r].append(state_pass(runs[r]))
                elif k == "analyze":
                    res[k, r].append(analyze_command(runs[r]))
                elif k == "decode":
                    res[k, r].append(bare_decode(files[r]))
                elif k == "duckdb":
                    res[k, r].append(duckdb_query(runs[r], con))
                elif k == "polars":
                    res[k, r].append(polars_query(runs[r]))
                elif k.startswith("workers"):
                    res[k, r].append(analyze_command(runs[r], "--workers", str(args.workers)))
                elif k == "ray":
                    res[k, r].append(analyze_command(runs[r], "--engine", "ray"))
    print(f"load average at the end {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; medians of {args.rounds} rounds")

    def ns(k, r, i):                 # median ns a token: i = 0 CPU, 1 wall
        return statistics.median(x[i] for x in res[k, r]) / n[r] * 1e9

    base = ranks[0]
    print(f"{'ranks':>5} {'tokens':>12} | " + " | ".join(f"{k:>15}" for k in kinds) + "   (ns a token CPU/wall)")
    for r in ranks:
        print(f"{r:>5} {n[r]:>12,} | " + " | ".join(f"{ns(k, r, 0):6.1f}/{ns(k, r, 1):6.1f}" + " " * 2
                                                    for k in kinds))
    for r in ranks:
        line = []
        for k in ("state", "analyze"):
            if k in kinds:
                line.append(f"{k} ÷ {base}-rank {ns(k, r, 0) / ns(k, base, 0):.2f} CPU, "
                            f"{ns(k, r, 1) / ns(k, base, 1):.2f} wall")
        if "analyze" in kinds and "decode" in kinds:
            line.append(f"analyze ÷ bare decode (throughput, wall) {ns('decode', r, 1) / ns('analyze', r, 1):.2f}")
            line.append(f"analyze ÷ DuckDB (time, wall) {ns('analyze', r, 1) / ns('duckdb', r, 1):.2f}")
            line.append(f"analyze ÷ Polars (time, wall) {ns('analyze', r, 1) / ns('polars', r, 1):.2f}")
        if "state" in kinds and "decode" in kinds:
            line.append(f"state pass ÷ bare decode (throughput, wall) {ns('decode', r, 1) / ns('state', r, 1):.2f}")
            line.append(f"state pass ÷ DuckDB (time, wall) {ns('state', r, 1) / ns('duckdb', r, 1):.2f}")
        for k in kinds:
            if k.startswith("workers") or k == "ray":
                line.append(f"analyze {k} ÷ one process (speed-up, wall) "
                            f"{ns('analyze', r, 1) / ns(k, r, 1):.2f}" if "analyze" in kinds else k)
        print(f"{r:>5} ranks: " + "; ".join(line))
    if not args.keep:
        for p in runs.values():
            shutil.rmtree(p, ignore_errors=True)


def big(args) -> None:
    """Figure 5: one big run built, then analysed cold once (wall, CPU, peak RSS of the child, progress shown)."""
    ranks, steps, tokens = (int(x) for x in args.big.split(","))
    args.root.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    path = ensure_run(args.root, ranks, steps, tokens)
    print(f"   the run: {sum(f.stat().st_size for f in path.rglob('*')) / 1e9:.1f} GB "
          f"({time.perf_counter() - t:.0f} s to build or find)", flush=True)
    shutil.rmtree(path / "analysis", ignore_errors=True)
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    # on a terminal (script(1)), as a user runs it: the progress bar is drawn on stderr
    cmd = f"{sys.executable} -m triage_monitor analyze {path}"
    r = subprocess.run(["script", "-qec", cmd, "/dev/null"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    shown = "recomputing metrics" in r.stdout
    import re

    tail = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in r.stdout.splitlines() if "recomputed" in ln][-1:]
    print(f"5. analyze cold on {ranks} ranks x {steps} steps x {tokens:,} tokens: {wall:.1f} s wall (goal <= 180), "
          f"{cpu:.1f} s CPU, peak RSS {after.ru_maxrss / 1024:.0f} MB (goal <= 2048; the largest child so far), "
          f"progress shown: {shown}; load {load:.1f} -> {os.getloadavg()[0]:.1f}; exit {r.returncode}; {tail}")
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
