"""What a post-mortem costs end to end: `triage-monitor analyze` and `report` on a ~20M-token run, as a user runs them.

Each figure is one command in a fresh process (``python -m triage_monitor …``: the interpreter's start-up, every
import, reading the run, computing, writing), wall time, the compared variants alternated round by round so that
they see the same load; medians of ``--rounds``:

  1. ``analyze RUN`` cold (the run's ``analysis/`` cache removed: the per-step states computed from the token
     records) and warm (cached states);
  2. ``analyze RUN --workers 2`` ÷ ``analyze RUN`` (cold; with less than its size threshold of token records the
     command maps them in its own process and says so);
  3. ``report RUN`` cold (nothing cached: states, stage table, the C_tok shuffle null of its four windows) and
     after ``analyze`` (the states cached, the null not yet drawn), and again (everything cached);
  4. with ``--old CHECKOUT`` (e.g. ``git worktree add /tmp/old <commit>``), every command also run from that
     checkout's package, alternated with this one's, and the ratios new ÷ old.

The goals (docs/metrics.md#performance): analyze ≤ 3 s and report ≤ 5 s on 20M tokens on a quiet machine;
``--workers N`` never slower than one process.  The run is built once by the real monitor (80 steps × 256k tokens,
256 responses a step, ``bench_dashboard.build_run``) and reused.

    python benchmarks/bench_postmortem.py [--run /tmp/tm-bench-20m] [--rounds 3] [--old /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(checkout: Path, *argv: str) -> float:
    """Wall seconds of ``python -m triage_monitor argv`` run with ``checkout``'s package (its directory first on
    the path); raises when the command fails."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "triage_monitor", *argv], cwd=checkout, env=env,
                       capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{checkout}: triage-monitor {' '.join(argv)} failed: {r.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="/tmp/tm-bench-20m", help="where the ~20M-token run lives (reused if complete)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--tokens-per-step", type=int, default=256_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old", type=Path, help="another checkout to compare with (its triage_monitor package)")
    args = ap.parse_args()
    run = Path(args.run)
    done = run / "run.json"
    if not done.exists() or json.loads(done.read_text()).get("status") != "finished":
        from bench_dashboard import build_run

        shutil.rmtree(run, ignore_errors=True)
        build_run(run, args.steps, args.tokens_per_step)
    from triage_monitor.offline.analysis import open_run

    tokens = int(open_run(run).steps()["n_tokens"].sum())
    cache = run / "analysis"
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "tm-bench-postmortem"
    out.mkdir(parents=True, exist_ok=True)
    checkouts = {"new": ROOT, **({"old": args.old.resolve()} if args.old else {})}
    figures = ("analyze cold", "analyze warm", "analyze --workers 2 cold", "report cold", "report after analyze",
               "report again")
    times: dict = {(c, f): [] for c in checkouts for f in figures}
    load = []
    for r in range(args.rounds):
        load.append(os.getloadavg()[0])
        for name, co in checkouts.items():
            def clear():
                shutil.rmtree(cache, ignore_errors=True)
            clear()
            times[name, "analyze cold"].append(timed(co, "analyze", str(run), "--out", str(out / "m.csv")))
            times[name, "analyze warm"].append(timed(co, "analyze", str(run), "--out", str(out / "m.csv")))
            clear()
            times[name, "analyze --workers 2 cold"].append(timed(co, "analyze", str(run), "--workers", "2",
                                                                 "--out", str(out / "m.csv")))
            clear()
            times[name, "report cold"].append(timed(co, "report", str(run), "--out", str(out / "r.html")))
            clear()
            timed(co, "analyze", str(run), "--out", str(out / "m.csv"))
            times[name, "report after analyze"].append(timed(co, "report", str(run), "--out", str(out / "r.html")))
            times[name, "report again"].append(timed(co, "report", str(run), "--out", str(out / "r.html")))
        print(f"  round {r + 1}/{args.rounds} done (load {load[-1]:.1f})", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nrun: {run}, {tokens:,} tokens; {sys.executable}; {os.cpu_count()} CPUs; load average during the "
          f"rounds {min(load):.1f}-{max(load):.1f}; medians of {args.rounds} alternated rounds, wall seconds of a "
          "fresh process")
    head = f"{'command':<28}" + "".join(f"{c:>9}" for c in checkouts) + ("   new ÷ old" if "old" in checkouts else "")
    print(head)
    for f in figures:
        line = f"{f:<28}" + "".join(f"{med[c, f]:>8.2f}s" for c in checkouts)
        if "old" in checkouts:
            line += f"   {med['new', f] / med['old', f]:>9.2f}"
        print(line)
    for c in checkouts:
        print(f"{c}: analyze --workers 2 ÷ one process (cold) {med[c, 'analyze --workers 2 cold'] / med[c, 'analyze cold']:.2f}"
              f" (goal ≤ 1); analyze cold {med[c, 'analyze cold']:.2f} s (goal ≤ 3 s); report cold "
              f"{med[c, 'report cold']:.2f} s, after analyze {med[c, 'report after analyze']:.2f} s (goal ≤ 5 s)")


if __name__ == "__main__":
    main()
