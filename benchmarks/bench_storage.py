"""Files per run and the cost of opening its steps table, for synchronised multi-rank jobs, measured in one run.

A job of W real processes (gloo, one machine) logs S steps of a small batch each through the public API
(``MismatchMonitor`` under ``torch.distributed``), twice: with every rank writing its steps row
(``MonitorConfig(per_rank_steps=True)``, what every job did before) and with the default (the step's one row,
rank 0's).  For each world size it prints the files of each table and the time ``open_run(run).steps()`` takes
(median of 5, a fresh ``open_run`` each time), and their ratios.

    python benchmarks/bench_storage.py [--worlds 2,4,8] [--steps 200]

The token files still grow as ranks × steps (one per rank and step); see docs/reliability.md#many-ranks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(rank: int, world: int, out: str, steps: int, per_rank: int) -> None:
    import torch
    import torch.distributed as dist

    from triage_monitor.batch import TokenBatch
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    cfg = MonitorConfig(tau_tail=-1.0, per_rank_steps=bool(per_rank), alignment_check_steps=0)
    with MismatchMonitor(Path(out) / "run", cfg, alerts=False) as mon:
        for step in range(steps):
            s = -torch.rand(4, 32, generator=g) * 3 - 0.01
            lp = (s + torch.randn(4, 32, generator=g) * 0.1).clamp(max=0)
            mon.log_step(step, TokenBatch.from_padded(lp, s, torch.randn(4, generator=g), torch.ones(4, 32)))
    dist.destroy_process_group()


def one_job(world: int, steps: int, per_rank: bool, root: Path) -> dict:
    out = root / f"w{world}-{'per-rank' if per_rank else 'one-row'}"
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(r), str(world), str(out), str(steps),
                               str(int(per_rank))], env=env) for r in range(world)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a worker of the {world}-rank job failed (exit {p.returncode})")
    from triage_monitor.analysis import open_run

    run = out / "run"
    files = {t: sum(1 for _ in (run / t).glob("*.parquet")) for t in ("tokens", "steps")}
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        n = len(open_run(run).steps())
        times.append(time.perf_counter() - t0)
    assert n == steps, (n, steps)
    return {**files, "open_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4,8", help="world sizes (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=200, help="steps per job (default: %(default)s)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    print(f"{'ranks':>5} {'steps':>5} | {'steps files':>11} {'(every rank)':>12} {'ratio':>6} | {'token files':>11} | "
          f"{'open+steps() s':>14} {'(every rank)':>12} {'ratio':>6}")
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            before = one_job(world, args.steps, True, root)
            after = one_job(world, args.steps, False, root)
            print(f"{world:>5} {args.steps:>5} | {after['steps']:>11} {before['steps']:>12} "
                  f"{after['steps'] / before['steps']:>6.3f} | {after['tokens']:>11} | {after['open_s']:>14.3f} "
                  f"{before['open_s']:>12.3f} {after['open_s'] / before['open_s']:>6.3f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(*map(int, sys.argv[2:4]), sys.argv[4], *map(int, sys.argv[5:7]))
    else:
        main()
