"""Dashboard responsiveness on a large run (issue: first chart within 3 s on >= 50M tokens).

    .venv/bin/python benchmarks/bench_dashboard.py [--run /tmp/tm-bench-run] [--steps 200] [--tokens-per-step 256000]

1. Builds (or reuses) a synthetic run of ``steps × tokens-per-step`` tokens
   through the real :class:`~triage_monitor.monitor.MismatchMonitor` with
   token records on (256 responses per step, lengths 1..2·mean, a slowly
   drifting δ with late local tails).  Not part of the test suite.
2. In-process: time to the first chart's data and figure (open_run ->
   Run.steps() -> timeseries_figure) in a fresh Python process, i.e.
   including imports, and the lazy one-step token load used by the step
   section.
3. The app script itself (AppTest): time to the first time-series figure
   with a cold and a warm ``st.cache_data``; the stage table's compute time
   (on a run this large the page computes it on request).
4. In Chromium (DevTools protocol, the helper of tests/test_browser.py):
   starts the app with the ``triage-monitor dashboard`` command line and
   measures navigation -> first rendered plotly chart: cold (server just
   started, fresh browser profile), reload (browser cache warm) and a new
   browser profile (Streamlit's JS bundle fetched again), and the time until
   the page finished.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_run(path: Path, steps: int, tokens_per_step: int, responses: int = 256) -> None:
    import torch

    from triage_monitor.batch import TokenBatch
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    g = torch.Generator().manual_seed(0)
    mean_len = tokens_per_step // responses
    t0 = time.perf_counter()
    with MismatchMonitor(path, MonitorConfig(window=25, calibration_steps=25),
                         manifest={"model": "synthetic-bench", "correction": "none"}) as mon:
        for s in range(steps):
            lens = torch.randint(1, 2 * mean_len, (responses,), generator=g)
            lens = (lens * (tokens_per_step / lens.sum())).long().clamp(min=1)
            n = int(lens.sum())
            sample = torch.repeat_interleave(torch.arange(responses), lens)
            pos = torch.arange(n) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
            sampler = -torch.rand(n, generator=g) * 3
            drift = 0.02 + 0.3 * (s / steps) ** 3
            delta = torch.randn(n, generator=g) * drift
            local = ((pos // 64) % 17 == 3) & (torch.rand(n, generator=g) < (s / steps) ** 2)
            delta = torch.where(local, delta - 1.0, delta)
            learner = (sampler + delta).clamp(max=0)
            adv = torch.randn(responses, generator=g)[sample]
            batch = TokenBatch.from_flat(learner, sampler, adv, sample, pos, group_id=sample // 16)
            mon.log_step(s, batch, extra={"reward": 0.5 + 0.1 * float(torch.randn(1, generator=g))})
            if s % 20 == 0:
                print(f"  step {s}/{steps} ({time.perf_counter() - t0:.0f}s)", flush=True)
    print(f"built {path} in {time.perf_counter() - t0:.0f}s")


FIRST_CHART = r"""
import sys, time
t0 = time.perf_counter()
from triage_monitor.analysis import open_run
from triage_monitor import views
t_import = time.perf_counter() - t0
run = open_run(sys.argv[1]); steps = run.steps()
t_steps = time.perf_counter() - t0
fig = views.timeseries_figure({"run": steps}, "direction", True, 25)
fig.to_json()
t_fig = time.perf_counter() - t0
toks = run.tokens(int(steps["step"].iloc[-1]), ["sample_id", "position", "learner_logp", "sampler_logp", "advantage"])
t_tok = time.perf_counter() - t_fig - t0
print(f'{{"import_s": {t_import:.3f}, "steps_read_s": {t_steps - t_import:.3f}, "first_figure_s": {t_fig:.3f},'
      f' "one_step_tokens_s": {t_tok:.3f}, "rows": {len(toks)}, "steps": {len(steps)}}}')
"""


def _visit(b, url: str, out: dict, name: str, shot: Path = None) -> None:
    from test_browser import CHARTS_JS, RUNNING_JS

    t0 = time.perf_counter()
    b.navigate(url)
    b.wait_for(f"{CHARTS_JS} >= 1", timeout=300, poll=0.02)
    out[f"{name}_first_chart_s"] = round(time.perf_counter() - t0, 2)
    b.wait_for(f"{CHARTS_JS} >= 8", timeout=300, poll=0.02)
    out[f"{name}_step_level_charts_s"] = round(time.perf_counter() - t0, 2)
    time.sleep(0.3)
    deadline = time.monotonic() + 600
    while b.eval(RUNNING_JS) and time.monotonic() < deadline:
        time.sleep(0.05)
    out[f"{name}_page_complete_s"] = round(time.perf_counter() - t0, 2)
    out[f"{name}_charts"] = b.eval(CHARTS_JS)
    if shot is not None:
        b.screenshot(shot)


def measure_browser(run: Path) -> dict:
    """Navigation -> first rendered chart: cold (server just started, fresh browser profile), reload
    (same browser: its HTTP cache holds Streamlit's JS; data cached server-side) and a new browser
    profile (JS bundle fetched again, data cached)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_browser import Chromium, free_port, start_dashboard, stop

    port = free_port()
    out = {}
    proc = start_dashboard([run], port, Path("/tmp/tm-bench-streamlit.log"))
    try:
        b = Chromium()
        try:
            _visit(b, f"http://127.0.0.1:{port}/", out, "cold")
            _visit(b, f"http://127.0.0.1:{port}/?reload=1", out, "reload",
                   ROOT / "artifacts" / "bench" / "dashboard_large_run.png")
        finally:
            b.close()
        b = Chromium()
        try:
            _visit(b, f"http://127.0.0.1:{port}/", out, "new_browser")
        finally:
            b.close()
    finally:
        stop(proc)
    return out


FLOOR_APP = """
import plotly.graph_objects as go
import streamlit as st
st.title("floor")
st.plotly_chart(go.Figure(go.Scatter(x=[0, 1, 2], y=[1, 3, 2])))
"""


#: The floor with as many charts as the dashboard's page (ten of 3 traces × 80 points): the browser draws a page's
#: charts together, so each chart on the page delays the first one.
FLOOR_APP_TEN = """
import numpy as np
import plotly.graph_objects as go
import streamlit as st
st.title("floor")
rng = np.random.default_rng(0)
for i in range(10):
    f = go.Figure()
    for t in range(3):
        f.add_trace(go.Scatter(x=list(range(80)), y=rng.normal(size=80).tolist(), name=f"t{t}"))
    st.plotly_chart(f, key=f"c{i}")
"""


def measure_floor(app_text: str = FLOOR_APP) -> dict:
    """Navigation -> first rendered chart for a one-chart Streamlit app (or ``app_text``), in a new browser profile
    and reloaded in the same browser: what no Streamlit dashboard can beat here."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from test_browser import CHARTS_JS, Chromium, free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        app = Path(tmp) / "floor_app.py"
        app.write_text(app_text)
        proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(app), "--server.headless", "true",
                                 "--server.port", str(port), "--server.address", "127.0.0.1",
                                 "--browser.gatherUsageStats", "false"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(4)
            b = Chromium()
            out = {}
            try:
                for name, url in (("new_browser", "/"), ("reload", "/?reload=1")):   # as measure_browser's visits
                    t0 = time.perf_counter()
                    b.navigate(f"http://127.0.0.1:{port}{url}")
                    b.wait_for(f"{CHARTS_JS} >= 1", timeout=120, poll=0.02)
                    out[f"{name}_first_chart_s"] = round(time.perf_counter() - t0, 2)
                return out
            finally:
                b.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)


SCRIPT_SIDE = r"""
import os, sys, time
from streamlit.testing.v1 import AppTest
from triage_monitor import views
os.environ["TRIAGE_MONITOR_RUNS"] = sys.argv[1]
marks = []
orig = views.timeseries_figure
def timed(*a, **k):
    marks.append(time.perf_counter()); return orig(*a, **k)
views.timeseries_figure = timed
res = {}
for name in ("cold_cache", "warm_cache"):
    marks.clear(); t0 = time.perf_counter()
    at = AppTest.from_file(sys.argv[2], default_timeout=900).run()
    res[name + "_first_figure_s"] = round(marks[0] - t0, 3)
    res[name + "_script_s"] = round(time.perf_counter() - t0, 3)
    assert not at.exception, at.exception
print(res)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="/tmp/tm-bench-run", help="where the large run lives (reused if complete)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokens-per-step", type=int, default=256_000)
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--no-browser", action="store_true")
    args = ap.parse_args()
    run = Path(args.run)
    done = run / "run.json"
    if args.rebuild or not done.exists() or json.loads(done.read_text()).get("status") != "finished":
        if run.exists():
            import shutil
            shutil.rmtree(run)
        build_run(run, args.steps, args.tokens_per_step)
    r = subprocess.run([sys.executable, "-c", FIRST_CHART, str(run)], capture_output=True, text=True, check=True)
    inproc = json.loads(r.stdout.strip().splitlines()[-1])
    du = subprocess.run(["du", "-sh", str(run)], capture_output=True, text=True).stdout.split()[0]
    from triage_monitor.offline.analysis import open_run
    steps = open_run(run).steps()
    print(f"run: {run} ({du}), {len(steps)} steps, {int(steps['n_tokens'].sum()):,} tokens")
    print("in-process (fresh interpreter):", json.dumps(inproc))
    r = subprocess.run([sys.executable, "-c", SCRIPT_SIDE, str(run), str(ROOT / "dashboards" / "app.py")],
                       capture_output=True, text=True, check=True)
    print("app script (AppTest, modules imported; time to the first time-series figure / whole script, "
          "stage table on request):", r.stdout.strip().splitlines()[-1])
    from triage_monitor.offline.stages import stage_table
    t0 = time.perf_counter()
    stage_table(open_run(run))
    print(f"stage table (4 anchors x 25-step windows, 499 null draws): {time.perf_counter() - t0:.1f}s")
    if not args.no_browser:
        print("Chromium:", json.dumps(measure_browser(run)))
        print("Chromium, floor of Streamlit + plotly (a one-chart app; new browser profile, then reloaded):",
              json.dumps(measure_floor()))
        print("Chromium, the same with ten charts of 3 traces × 80 points (the page's count):",
              json.dumps(measure_floor(FLOOR_APP_TEN)))


if __name__ == "__main__":
    main()
