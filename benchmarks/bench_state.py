"""Fixed-size metric state: the ratios of docs/metrics.md#performance, measured in one run.

On steps of B × T tokens (default 256 × 4,096 with lengths uniform in [T/4, T], ~655k valid tokens):

  1. log_step cost at window 100 ÷ window 1 at every size of ``--sizes`` (16k, 64k, 640k and 4M padded tokens:
     4 … 1,024 rows of 4,096; record_tokens off, τ_tail given; the windows full; the two monitors' calls
     interleaved; CPU time of the calling thread, wall time beside);
  2. peak RSS growth of a monitor over 50 steps (window 25, record_tokens on, each step flushed: a training step
     lasts longer than its records' write) at every size of ``--sizes``, in fresh processes; at the largest size
     also with record_tokens off (the metric state alone, without the writer's buffers);
  3. log_step synchronous cost (record_tokens on; time inside log_step, the background Parquet writer idle at
     the call) ÷ the metric update alone (MismatchStats.update);
  4. analyze (one process) tokens/s ÷ a bare pyarrow decode (rows/s) of the same columns of the same run;
  5. analyze on a local Ray cluster with 2 workers ÷ one process, on the same run (>= 20M tokens by default);
  6. bytes handed to the collectives per rank per step by the multi-rank sync at 64k and 1M tokens per rank;
  7. the stage table of a ~50M-token run from its cached per-step states, and the ratio to the former path
     (re-reading the windows' token records for the C_tok shuffle null) at equal draws.

    python benchmarks/bench_state.py [--batch 256] [--seq 4096] [--run-steps 32] [--rss-steps 50] [--no-ray]
                                       [--stage-steps 80] [--old-draws 49] [--sizes 16k,64k,640k,4M]
                                       [--figures 1,2]

Every line prints a ratio measured here, now, on this machine; timings are medians.
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

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import make_inputs  # noqa: E402

from triage_monitor.offline.analysis import TOKEN_COLUMNS, open_run, recompute_states  # noqa: E402
from triage_monitor.batch import TokenBatch  # noqa: E402
from triage_monitor.metrics.stats import MetricConfig, MismatchStats  # noqa: E402
from triage_monitor.monitor import MismatchMonitor, MonitorConfig  # noqa: E402

TAU = -0.25


def batch_of(B, T, seed=0) -> TokenBatch:
    lp, s, a, m = make_inputs(B, T, "cpu", seed)
    return TokenBatch.from_padded(lp, s, a, m)


#: figure 1 and 2 sizes: rows of 4,096 columns (~16k, 64k, 640k and 4M padded tokens)
SIZES = {"16k": 4, "64k": 16, "640k": 160, "4M": 1024}


def log_step_costs(batch, windows: tuple, repeats: int, tmp: Path) -> tuple:
    """Median seconds of log_step with a full trailing window of each of ``windows`` steps: one monitor per
    window, their calls interleaved (one call each, in alternating order) so that every window sees the same
    load.  Returns ``(CPU seconds of the calling thread per window, wall seconds per window)``."""
    import contextlib

    with contextlib.ExitStack() as stack:
        mons = []
        for window in windows:
            cfg = MonitorConfig(window=window, tau_tail=TAU, record_tokens=False, alignment_check_steps=0)
            mon = stack.enter_context(MismatchMonitor(tmp / f"w{window}", cfg))
            st = MismatchStats(mon.tracker.config).update(batch, TAU)
            for s in range(window):                               # fill the window with real step states
                mon.tracker.push(s, st)
            mon.log_step(window, batch)                           # first call (warm-up), not timed
            mons.append(mon)
        cpu: list = [[] for _ in windows]
        wall: list = [[] for _ in windows]
        order = list(range(len(windows)))
        for k in range(repeats):
            for i in (order if k % 2 == 0 else order[::-1]):           # A B, B A, ...: no order bias
                for mon in mons:                                          # no writer thread busy meanwhile
                    mon.flush()
                c, t = time.thread_time(), time.perf_counter()
                mons[i].log_step(windows[i] + 1 + k, batch)
                cpu[i].append(time.thread_time() - c)
                wall[i].append(time.perf_counter() - t)
        return [statistics.median(ts) for ts in cpu], [statistics.median(ts) for ts in wall]


def _status_mb(key: str) -> float:
    """A field of /proc/self/status in MB (VmRSS: resident now; VmHWM: the peak since start or the last reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    raise KeyError(key)


def rss_growth(batch, steps: int, record: bool = True) -> float:
    """Peak RSS growth (MB) of a monitor (window 25, τ_tail calibrated live, records written when ``record``, each
    step flushed) over ``steps`` steps after its first: the peak resident size during those steps (the kernel's
    high-water mark, reset after the first step through /proc/self/clear_refs, so that imports and compilation
    do not hide it) minus the resident size after the first step."""
    cfg = MonitorConfig(window=25, tau_tail=None, record_tokens=record, alignment_check_steps=0)
    with tempfile.TemporaryDirectory() as d, MismatchMonitor(Path(d) / "rss", cfg, alerts=False) as mon:
        mon.log_step(0, batch)
        mon.flush()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                             # reset the peak (VmHWM) to the current size
        before = _status_mb("VmRSS")
        for s in range(1, steps + 1):
            mon.log_step(s, batch)
            mon.flush()
        return _status_mb("VmHWM") - before


def rss_children(args, rows: int, record: bool, envs: tuple) -> list:
    """:func:`rss_growth` in one fresh process per entry of ``envs`` (extra environment variables)."""
    grown = []
    for env in envs:
        out = subprocess.run([sys.executable, __file__, "--rss-child", str(args.rss_steps), "--batch", str(rows),
                              "--seq", str(args.seq), *([] if record else ["--rss-no-record"])],
                             capture_output=True, text=True, check=True, env={**os.environ, **env})
        grown.append(float(out.stdout.split()[-1]))
    return grown


def sync_bytes(tokens_per_rank: int) -> tuple:
    """Bytes handed to torch.distributed collectives by one step of MetricTracker.step on a 1-rank gloo group
    (calibrating step, then a frozen step)."""
    import torch.distributed as dist

    from triage_monitor.metrics.stats import MetricTracker

    sent = []
    real = dist.all_reduce

    def counting(t, *a, **kw):
        sent.append(t.numel() * t.element_size())
        return real(t, *a, **kw)

    T = 4096
    b = batch_of(max(tokens_per_rank // (T * 5 // 8), 1), T, seed=5)
    tr = MetricTracker(calibration_steps=1)
    dist.all_reduce = counting
    try:
        out = []
        for step in range(3):                  # steps 0-1 calibrate (sketch first), step 2 is frozen
            sent.clear()
            tr.step(step, b, group=dist.group.WORLD)
            out.append(sum(sent))
    finally:
        dist.all_reduce = real
    return b.num_tokens, out[0], out[2]


def write_run(path: Path, B: int, T: int, steps: int) -> int:
    n = 0
    with MismatchMonitor(path, MonitorConfig(alignment_check_steps=0)) as mon:
        for s in range(steps):
            b = batch_of(B, T, seed=s)
            mon.log_step(s, b)
            n += b.num_tokens
    return n


def bare_decode(run) -> tuple:
    """Seconds and rows of decoding the analysed columns (TOKEN_COLUMNS) of every token file of the run to
    numpy: the same files (``Run.token_files``, each read once, whole), the same columns and the same pyarrow call
    and threading
    (``read_table`` with pyarrow's default thread pool, ``to_numpy`` of each column) as ``analyze`` pays,
    and nothing else."""
    # each file once: a block file holds many steps (``Run.token_files`` names it for each of them)
    files = list(dict.fromkeys(f for s in run.step_numbers() for f in run.token_files(s)))
    t = time.perf_counter()
    rows = 0
    for f in files:
        tab = pq.read_table(f, columns=list(TOKEN_COLUMNS))
        cols = [tab.column(c).to_numpy() for c in TOKEN_COLUMNS]
        rows += cols[0].size
    return time.perf_counter() - t, rows


def stage_table_cost(tmp: Path, B: int, T: int, steps: int, old_draws: int) -> None:
    """7. Stage table of a run of ``steps`` steps (default ~50M tokens) from its cached per-step states, and
    the former path (the windows' token records re-read, the token-shuffle null) at ``old_draws`` draws."""
    from triage_monitor.offline.analysis import StepStates
    from triage_monitor.offline.stages import stage_table

    path = tmp / "stages"
    t = time.perf_counter()
    n = write_run(path, B, T, steps)
    print(f"   wrote a {steps}-step run of {n:,} tokens in {time.perf_counter() - t:.0f} s")
    run = open_run(path)
    t = time.perf_counter()
    states = recompute_states(run, cache=True)
    t_states = time.perf_counter() - t
    stage_table(run, draws=2, states=states)                            # compile / load the null kernel once
    t = time.perf_counter()
    stage_table(run)                                                    # states from the cache, 499 draws
    t_new = time.perf_counter() - t
    t = time.perf_counter()
    stage_table(run, draws=old_draws, states=states)
    t_new_few = time.perf_counter() - t
    bare = StepStates(states.steps, states.states, states.taus, states.config, states.window, states.tau_mode)
    t = time.perf_counter()
    stage_table(run, draws=old_draws, states=bare)                      # no null inputs: the former path
    t_old_few = time.perf_counter() - t
    print(f"7. stage table of {n / 1e6:.0f} M tokens: {t_new:.1f} s (499 draws, states cached; computing them "
          f"took {t_states:.1f} s once); at {old_draws} draws {t_new_few:.1f} s vs {t_old_few:.1f} s re-reading "
          f"the windows' tokens: ratio {t_old_few / t_new_few:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rss-steps", type=int, default=50)
    ap.add_argument("--run-steps", type=int, default=32, help="steps of the analysed run (32 x 655k = 21M tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved decode / analyze rounds (figure 4)")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--stage-steps", type=int, default=80, help="steps of the stage-table run (80 x 620k = 50M "
                    "tokens); 0 skips figure 7")
    ap.add_argument("--old-draws", type=int, default=49, help="null draws when timing the former path")
    ap.add_argument("--sizes", default=",".join(SIZES), help="figures 1 and 2: of %(default)s")
    ap.add_argument("--figures", default="1,2,3,4,5,6,7", help="figures 1 and 2 each on their own; any of 3-7 "
                    "measures all of 3-7 (default: all)")
    ap.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rss-no-record", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    B, T = args.batch, args.seq
    if args.rss_child:
        print(rss_growth(batch_of(B, T), args.rss_child, record=not args.rss_no_record))
        return
    figures = {int(f) for f in args.figures.split(",") if f}
    sizes = [x for x in args.sizes.split(",") if x]
    for x in sizes:
        if x not in SIZES:
            ap.error(f"--sizes: {x!r} is not one of {', '.join(SIZES)}")
    batch = batch_of(B, T)
    print(f"steps of {B} x {T}: {batch.num_tokens:,} valid tokens; torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # 1. window independence, at every size: a fixed per-step cost must not grow with the window (one torch
        # thread, so that the calling thread's CPU time is the whole of log_step's)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        for x in sizes if 1 in figures else []:
            sized = batch_of(SIZES[x], T)
            (c1, c100), (w1, w100) = log_step_costs(sized, (1, 100), 3 * args.repeats, tmp)
            print(f"1. log_step window 100 / window 1 at {x:>4} ({sized.num_tokens:>9,} tokens): {c100 / c1:6.3f} CPU "
                  f"({c100 * 1e3:.2f} ms vs {c1 * 1e3:.2f} ms), {w100 / w1:6.3f} wall ({w100 * 1e3:.2f} vs "
                  f"{w1 * 1e3:.2f} ms); medians of {3 * args.repeats} interleaved calls; goal <= 1.1", flush=True)
        torch.set_num_threads(threads)
        # 2. memory over 50 steps, in fresh processes: the peak of this one already holds figure 1's monitors.
        # Three processes a size: with glibc's dynamic mmap threshold the heap sometimes keeps freed per-step buffers
        # (tens of MB, more at 4M tokens); the median says what a run usually sees, the max what it may see, and a
        # fixed threshold (MALLOC_MMAP_THRESHOLD_) what the monitor itself keeps
        for x in sizes if 2 in figures else []:
            grown = rss_children(args, SIZES[x], True, ({}, {}, {}, {"MALLOC_MMAP_THRESHOLD_": "131072"}))
            print(f"2. peak RSS growth over {args.rss_steps} steps at {x:>4}, records on: "
                  f"{statistics.median(grown[:3]):6.1f} MB (goal <= 64 MB; 3 fresh processes: "
                  f"{', '.join(f'{g:.1f}' for g in grown[:3])} MB; {grown[3]:.1f} MB with a fixed mmap threshold)",
                  flush=True)
        if 2 in figures and sizes:
            grown = rss_children(args, SIZES[sizes[-1]], False, ({}, {}, {}))
            print(f"2. ... at {sizes[-1]} with records off (the metric state alone): {statistics.median(grown):.1f} MB "
                  f"({', '.join(f'{g:.1f}' for g in grown)} MB)", flush=True)
        if not figures & {3, 4, 5, 6, 7}:
            return
        # 3. synchronous log_step cost vs the metric update alone
        with MismatchMonitor(tmp / "rec", MonitorConfig(tau_tail=TAU, alignment_check_steps=0)) as mon:
            mon.log_step(0, batch)                                        # warm-up, not timed
            MismatchStats(MetricConfig()).update(batch, TAU)
            times, upd = [], []
            for k in range(3 * args.repeats):                             # interleaved: the same load on both
                mon.flush()                   # the background writer's previous file is not timed
                t = time.perf_counter()
                mon.log_step(k + 1, batch)
                times.append(time.perf_counter() - t)
                mon.flush()
                t = time.perf_counter()
                MismatchStats(MetricConfig()).update(batch, TAU)
                upd.append(time.perf_counter() - t)
            t_log, t_upd = statistics.median(times), statistics.median(upd)
        print(f"3. log_step (record_tokens) / update     {t_log / t_upd:6.3f}   ({t_log * 1e3:.1f} ms vs "
              f"{t_upd * 1e3:.1f} ms, medians of {3 * args.repeats} interleaved calls; goal <= 1.5)")
        # 6. fixed-size sync
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{tmp / 'rdv'}", rank=0, world_size=1)
        try:
            small, large = sync_bytes(64_000), sync_bytes(1_000_000)
        finally:
            dist.destroy_process_group()
        print(f"6. sync bytes per rank per step: {small[0]:,} tokens -> {small[2]:,} B (calibrating "
              f"{small[1]:,} B); {large[0]:,} tokens -> {large[2]:,} B (calibrating {large[1]:,} B); "
              f"ratio {large[2] / small[2]:.3f} (goal 1)")
        # 4. analyze vs bare decode
        run_path = tmp / "run"
        t = time.perf_counter()
        n = write_run(run_path, B, T, args.run_steps)
        print(f"   wrote a {args.run_steps}-step run of {n:,} tokens in {time.perf_counter() - t:.0f} s")
        run = open_run(run_path)
        recompute_states(run, steps=run.step_numbers()[:1])          # compile / load the kernel once
        t_decs, t_ans = [], []
        for _ in range(args.rounds):                                  # interleaved: same load on both
            t_dec, rows = bare_decode(run)
            t = time.perf_counter()
            local = recompute_states(run)
            t_ans.append(time.perf_counter() - t)
            t_decs.append(t_dec)
        t_dec, t_an = min(t_decs), min(t_ans)
        print("   rounds: decode", [round(x, 3) for x in t_decs], "analyze", [round(x, 3) for x in t_ans])
        print(f"4. analyze / bare pyarrow decode          {(n / t_an) / (rows / t_dec):6.3f}   "
              f"({n / t_an / 1e6:.2f} M tokens/s vs {rows / t_dec / 1e6:.2f} M rows/s, best of {args.rounds} "
              f"interleaved rounds; median ratio {statistics.median(n * d / (rows * a) for d, a in zip(t_decs, t_ans)):.3f}; "
              f"goal >= 0.67)")
        # 5. Ray, 2 workers
        if not args.no_ray:
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                t = time.perf_counter()
                recompute_states(run, engine="ray", steps=run.step_numbers()[:2])     # workers start, import
                t_warm = time.perf_counter() - t
                t = time.perf_counter()
                on_ray = recompute_states(run, engine="ray")
                t_ray = time.perf_counter() - t
            finally:
                ray.shutdown()
            same = np.array_equal(on_ray.states, local.states) and on_ray.taus == local.taus
            print(f"5. analyze Ray 2 workers / one process    {t_an / t_ray:6.3f}   ({t_ray:.1f} s vs {t_an:.1f} s on "
                  f"{n / 1e6:.1f} M tokens, workers started beforehand ({t_warm:.1f} s); bit-identical: {same})")
        if args.stage_steps:
            shutil.rmtree(run_path, ignore_errors=True)                   # room on the disk for the next run
            stage_table_cost(tmp, B, T, args.stage_steps, args.old_draws)


if __name__ == "__main__":
    main()
