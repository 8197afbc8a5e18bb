"""Files per run, the cost of opening it, and the writer's cost per step, at cluster sizes; S3 ÷ local disk.

A synchronised job of R ranks × S steps is simulated with the writer the monitor uses (``RunWriter.record_step``,
the call ``MismatchMonitor.log_step`` makes after computing the metrics, with the metrics of one real step): every
rank writes its token rows (2 responses × 16 tokens a step), rank 0 the step's one steps row, as a job under
``torch.distributed`` does.  The ranks are written by ``--jobs`` processes side by side.  For each size it prints:

* files: the files of the run's tables after the job (blocks; and, with ``--old``, the one-file-per-step layout of
  the checkout given, e.g. ``git worktree add /tmp/old c50a46b``);
* open: ``open_run(run).steps()``, then the dashboard's first chart (``views.timeseries_figure`` of the first panel,
  with the run's alerts) in a fresh process, imports excluded (median of 3 processes); with ``--old`` the same with
  the old checkout's reader;
* write: the writer's cost per (rank, step), all of it: the call and the writer thread to its last file (the
  writer processes' wall times summed ÷ rank-steps) of that one job; and, with ``--old``, the same measured
  interleaved (``--rounds`` jobs of ``--cost-ranks`` × ``--cost-steps`` each, new and old alternately, medians)
  and their ratio.

``--s3``: the same job of ``--s3-ranks`` ranks with bigger steps written to a local S3-compatible server (moto's
server mode, started here on 127.0.0.1) and to the local disk, then read back whole: MB/s of each and the ratio.

    python benchmarks/bench_storage.py [--ranks 8,64,512] [--steps 2000] [--jobs 2] [--old /tmp/old] [--s3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ the simulated job
def _batch(step: int, rank: int, responses: int = 2, tokens: int = 16):
    import torch

    from triage_monitor.batch import TokenBatch

    g = torch.Generator().manual_seed(step * 1009 + rank)
    s = -torch.rand(responses, tokens, generator=g) * 3 - 0.01
    lp = (s + torch.randn(responses, tokens, generator=g) * 0.1).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(responses, generator=g), torch.ones(responses, tokens),
                                  sample_ids=torch.arange(responses) + responses * (step * 100_000 + rank))


def write_ranks(code: str, run: str, ranks: list, world: int, steps: int, attempt: int, responses: int,
                tokens: int) -> float:
    """Write ``ranks`` of the job with the ``RunWriter`` of the checkout ``code``; returns the wall seconds."""
    sys.path.insert(0, code)
    from triage_monitor.config import MonitorConfig
    from triage_monitor.monitor import MismatchMonitor, steps_schema
    from triage_monitor.rundir.records import RunWriter

    cfg = MonitorConfig(tau_tail=-1.0, alignment_check_steps=0)
    with tempfile.TemporaryDirectory() as tmp:           # the metrics and extras of one real step
        with MismatchMonitor(Path(tmp) / "m", cfg, alerts=False) as mon:
            metrics = mon.log_step(0, _batch(0, 0, responses, tokens))
    t0 = time.perf_counter()
    for rank in ranks:
        w = RunWriter(run, attempt, rank, world, cfg.to_dict(), {"framework": "bench"}, {"tool_version": "bench"})
        w.declare_steps(steps_schema([]))
        for step in range(steps):
            w.record_step(step, _batch(step, rank, responses, tokens), {**metrics, "step": step}, {}, None,
                          steps_row=rank == 0)
        w.close("finished", steps)
    return time.perf_counter() - t0


def run_job(code: str, run: str, world: int, steps: int, jobs: int, responses: int = 2, tokens: int = 16) -> dict:
    """The R-rank job written by ``jobs`` processes of the checkout ``code``; ``{"wall_s", "cpu_s"}``."""
    attempt = time.time_ns()
    shares = [list(range(world))[j::jobs] for j in range(jobs)]
    shares = [s for s in shares if s]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "write", code, run, json.dumps(share), str(world),
                               str(steps), str(attempt), str(responses), str(tokens)], env=_env(code),
                              stdout=subprocess.PIPE, text=True) for share in shares]
    spent = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a writer process failed (exit {p.returncode})")
        spent.append(float(out.strip().splitlines()[-1]))
    return {"wall_s": time.perf_counter() - t0, "cpu_s": sum(spent)}


def _env(code: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": code}


def count_files(run: Path) -> dict:
    out = {}
    for table in ("tokens", "steps", "quarantine", "alerts"):
        d = run / table
        out[table] = sum(1 for _ in os.scandir(d)) if d.is_dir() else 0
    return out


OPEN = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from triage_monitor.analysis import open_run
from triage_monitor import views
t0 = time.perf_counter()
run = open_run(sys.argv[2])
steps = run.steps()
t1 = time.perf_counter()
fig = views.timeseries_figure({"run": steps}, next(iter(views.PANELS)), alerts={"run": run.alerts()})
t2 = time.perf_counter()
print(json.dumps({"rows": len(steps), "steps_s": t1 - t0, "chart_s": t2 - t1}))
"""


def open_time(code: str, run: Path, repeats: int = 3) -> dict:
    """``open_run(run).steps()`` and the first chart in fresh processes of ``code`` (imports excluded): medians."""
    got = []
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", OPEN, code, str(run)], env=_env(code), capture_output=True,
                           text=True, check=True)
        got.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(g[k] for g in got) for k in ("steps_s", "chart_s")} | {"rows": got[0]["rows"]}


# ------------------------------------------------------------------------------------------------ S3 ÷ disk
def s3_vs_disk(world: int, steps: int, jobs: int, root: Path) -> None:
    from moto.server import ThreadedMotoServer
    import boto3

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_EC2_METADATA_DISABLED="true")
    boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket="bench")
    try:
        rows = []
        for name, where in (("local disk", str(root / "s3-vs-disk")), ("S3 (moto, 127.0.0.1)", "s3://bench/run")):
            w = run_job(str(ROOT), where, world, steps, jobs, responses=64, tokens=1024)
            sys.path.insert(0, str(ROOT))
            from triage_monitor.offline.analysis import open_run

            run = open_run(where)
            t0 = time.perf_counter()
            n = sum(len(run.tokens(s, ["learner_logp"])) for s in run.step_numbers())
            read_s = time.perf_counter() - t0
            store = run.store
            nbytes = sum(e.size for t in ("tokens", "steps") for e in store.listdir(t))
            rows.append((name, nbytes, w["wall_s"], read_s, n))
        print(f"\nS3-compatible server ÷ local disk: {world} ranks × {steps} steps of 64 × 1024 tokens "
              f"({rows[0][4]:,} token rows, {rows[0][1] / 2**20:.1f} MiB of files)")
        print(f"{'where':<22} {'write s':>8} {'write MB/s':>10} {'read s':>7} {'read MB/s':>9}")
        for name, nbytes, ws, rs, _ in rows:
            print(f"{name:<22} {ws:>8.2f} {nbytes / ws / 1e6:>10.1f} {rs:>7.2f} {nbytes / rs / 1e6:>9.1f}")
        print(f"{'S3 ÷ disk throughput':<22} {'':>8} {rows[0][2] / rows[1][2]:>10.2f} {'':>7} "
              f"{rows[0][3] / rows[1][3]:>9.2f}")
    finally:
        server.stop()


def write_cost(args, root: Path) -> None:
    """The writer's cost per rank-step, this checkout's and the old one's jobs alternated: medians and ratio."""
    spent: dict = {"blocks": [], "old": []}
    for r in range(args.rounds):
        for name, code in (("blocks", str(ROOT)), ("old", args.old)) if r % 2 == 0 else (("old", args.old),
                                                                                       ("blocks", str(ROOT))):
            run = root / f"cost-{name}-{r}" / "run"
            w = run_job(code, str(run), args.cost_ranks, args.cost_steps, args.jobs)
            spent[name].append(w["cpu_s"] / (args.cost_ranks * args.cost_steps) * 1e6)
            shutil.rmtree(run.parent, ignore_errors=True)
    b, o = statistics.median(spent["blocks"]), statistics.median(spent["old"])
    print(f"\nwrite cost, {args.cost_ranks} ranks × {args.cost_steps} steps, {args.rounds} rounds alternated: blocks "
          f"{b:.0f} µs / rank-step, old {o:.0f}, ratio {b / o:.3f}  (rounds: blocks "
          f"{', '.join(f'{x:.0f}' for x in spent['blocks'])}; old {', '.join(f'{x:.0f}' for x in spent['old'])})",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64,512", help="rank counts (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=2000, help="steps per job (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=2, help="writer processes side by side (default: %(default)s)")
    ap.add_argument("--old", help="a checkout of the one-file-per-step layout (e.g. git worktree add /tmp/old c50a46b)")
    ap.add_argument("--old-max-ranks", type=int, default=64, help="largest job written with --old (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved write-cost rounds with --old")
    ap.add_argument("--cost-ranks", type=int, default=8)
    ap.add_argument("--cost-steps", type=int, default=400)
    ap.add_argument("--s3", action="store_true", help="also S3 (a local moto server) ÷ local disk")
    ap.add_argument("--s3-ranks", type=int, default=4)
    ap.add_argument("--s3-steps", type=int, default=20)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.steps} steps a job, "
          f"{args.jobs} writer processes", flush=True)
    print(f"{'ranks':>5} {'layout':>6} | {'files':>9} {'tokens':>8} {'steps':>6} | {'steps()':>8} {'chart':>6} | "
          f"{'write µs/rank-step':>18}", flush=True)
    try:
        for world in (int(r) for r in args.ranks.split(",")):
            res = {}
            for name, code in (("blocks", str(ROOT)), ("old", args.old)):
                if code is None or (name == "old" and world > args.old_max_ranks):
                    continue
                run = root / f"{name}-{world}" / "run"
                w = run_job(code, str(run), world, args.steps, args.jobs)
                files = count_files(run)
                o = open_time(code, run)
                assert o["rows"] == args.steps, o
                res[name] = (files, o, w)
                per = w["cpu_s"] / (world * args.steps) * 1e6
                print(f"{world:>5} {name:>6} | {sum(files.values()):>9,} {files['tokens']:>8,} {files['steps']:>6,} | "
                      f"{o['steps_s']:>7.3f}s {o['chart_s']:>5.3f}s | {per:>18.0f}", flush=True)
                shutil.rmtree(run.parent, ignore_errors=True)
            if len(res) == 2:
                (fb, ob, wb), (fo, oo, wo) = res["blocks"], res["old"]
                print(f"{world:>5} {'ratio':>6} | {sum(fb.values()) / sum(fo.values()):>9.4f} "
                      f"{fb['tokens'] / fo['tokens']:>8.4f} {fb['steps'] / fo['steps']:>6.3f} | "
                      f"{ob['steps_s'] / oo['steps_s']:>8.3f} {'':>6} | {wb['cpu_s'] / wo['cpu_s']:>18.3f}",
                      flush=True)
        if args.old and args.rounds:
            write_cost(args, root)
        if args.s3:
            s3_vs_disk(args.s3_ranks, args.s3_steps, args.jobs, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["write"]:
        code, run, share, world, steps, attempt, responses, tokens = sys.argv[2:10]
        print(write_ranks(code, run, json.loads(share), int(world), int(steps), int(attempt), int(responses),
                          int(tokens)))
    else:
        main()
