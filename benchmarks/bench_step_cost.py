"""What a user pays per step, against another checkout of this package and against verl's own metric function.

Per step of B × 4,096 padded tokens (lengths uniform in [1,024, 4,096]) at 64k, 640k and 4M tokens: the whole
cost the training loop sees plus the writer's — ``TokenBatch.from_padded`` from the framework's padded tensors,
``MismatchMonitor.log_step`` (records on), and the background Parquet writer to its flush — and, on the same
tensors, verl's ``compute_offpolicy_metrics`` (verl.trainer.ppo.rollout_corr_helper, when verl is installed).

    python benchmarks/bench_step_cost.py [--old PATH] [--rounds 3] [--steps 5]

``--old PATH``: a checkout of an earlier commit (``git worktree add /tmp/old <commit>``); each round runs a fresh
process of this checkout, then one of the old, alternately (interleaved, so both see the same load), and the
medians over all rounds are compared.  Prints per size: ms per step of each, new ÷ old, new ÷ verl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"64k": 16, "640k": 160, "4M": 1024}          # rows of 4,096 columns: ~64k, ~640k, ~4M padded tokens


def measure(steps: int) -> dict:
    """In this process (the package on sys.path): ms per step of the whole cost and of verl's function."""
    import shutil
    import tempfile
    import time

    import torch

    from triage_monitor.batch import TokenBatch
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    try:
        from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics
    except ImportError:
        compute_offpolicy_metrics = None
    torch.set_num_threads(1)
    out = {}
    for name, b in SIZES.items():
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(1024, 4097, (b,), generator=g)
        mask = torch.arange(4096)[None] < lengths[:, None]
        sampler = -torch.rand(b, 4096, generator=g) * 3
        learner = (sampler + torch.randn(b, 4096, generator=g) * 0.1).clamp(max=0)
        adv = torch.randn(b, generator=g)
        d = tempfile.mkdtemp(prefix="bench-step-")
        ours, theirs = [], []
        try:
            with MismatchMonitor(Path(d) / "run", MonitorConfig(tau_tail=-1.0), alerts=False) as mon:
                for step in range(steps + 1):                    # the first step warms up (compilation, caches)
                    t0 = time.perf_counter()
                    batch = TokenBatch.from_padded(learner, sampler, adv, mask)
                    mon.log_step(step, batch)
                    mon.flush()
                    t1 = time.perf_counter()
                    if compute_offpolicy_metrics is not None:
                        compute_offpolicy_metrics(learner, sampler, mask.float())
                    t2 = time.perf_counter()
                    if step:
                        ours.append(t1 - t0)
                        theirs.append(t2 - t1)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        out[name] = {"ours": ours, "verl": theirs}
    return out


def run_tree(tree: Path, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    code = (f"import json, sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(ROOT / 'benchmarks')!r}); "
            f"import bench_step_cost as b; print(json.dumps(b.measure({steps})))")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    if res.returncode:
        raise SystemExit(f"{tree}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, default=None, help="a checkout of an earlier commit to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per size and round (default: %(default)s)")
    args = ap.parse_args()
    trees = {"new": ROOT, **({"old": args.old.resolve()} if args.old else {})}
    got = {k: {s: {"ours": [], "verl": []} for s in SIZES} for k in trees}
    for r in range(args.rounds):
        for k, tree in trees.items():
            for s, v in run_tree(tree, args.steps).items():
                got[k][s]["ours"] += v["ours"]
                got[k][s]["verl"] += v["verl"]
            print(f"round {r + 1}/{args.rounds}: {k} done", file=sys.stderr, flush=True)
    med = {k: {s: {w: statistics.median(x) * 1e3 if x else float("nan") for w, x in v.items()}
               for s, v in per.items()} for k, per in got.items()}
    head = f"{'size':>5} | {'new ms':>8}" + (f" {'old ms':>8} {'new/old':>8}" if "old" in med else "") + \
        f" | {'verl ms':>8} {'new/verl':>9}"
    print(head)
    for s in SIZES:
        n = med["new"][s]
        line = f"{s:>5} | {n['ours']:>8.1f}"
        if "old" in med:
            o = med["old"][s]
            line += f" {o['ours']:>8.1f} {n['ours'] / o['ours']:>8.3f}"
        line += f" | {n['verl']:>8.1f} {n['ours'] / n['verl']:>9.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
