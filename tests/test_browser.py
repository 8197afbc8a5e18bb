"""Real headless-browser checks: the Streamlit dashboard and the HTML report rendered by Debian's Chromium.

Streamlit draws the page over a websocket after load, so a plain
``chromium --screenshot`` captures a blank page: the browser is driven over
the DevTools protocol (``websocket-client``), waits for the plotly charts to
render, and saves screenshots under ``artifacts/browser/`` (or
``$TRIAGE_MONITOR_ARTIFACTS``).  Needs ``apt-get install chromium``; skipped
with the reason when no Chromium binary exists.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from triage_monitor.dashboards.launch import build_command

pytestmark = pytest.mark.browser

ARTIFACTS = Path(os.environ.get("TRIAGE_MONITOR_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts"))


def chromium_binary():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Chromium:
    """A headless Chromium driven over the DevTools protocol (one page)."""

    def __init__(self, width: int = 1500, height: int = 1000, offline: bool = False):
        import websocket  # websocket-client

        self.profile = tempfile.mkdtemp(prefix="tm-chromium-")
        args = [chromium_binary(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--hide-scrollbars", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("Chromium did not start (no DevToolsActivePort)")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(p for p in pages if p.get("type") == "page")
        # a hang guard only: on a loaded machine a busy page answers a DevTools call late, never wrongly
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=900, suppress_origin=True)
        self._id = 0
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        if offline:
            self.send("Network.enable")
            self.send("Network.emulateNetworkConditions", offline=True, latency=0, downloadThroughput=-1,
                      uploadThroughput=-1)

    def send(self, method: str, **params):
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expr: str):
        r = self.send("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JS error in {expr!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def wait_for(self, expr: str, timeout: float = 60.0, poll: float = 0.1):
        """Poll the JS expression until it is truthy; returns its value (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.eval(expr)
            if v:
                return v
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {expr}")
            time.sleep(poll)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """Save a PNG; ``full_page`` grows the viewport to the tallest scroll container first
        (Streamlit scrolls inside its main container, not the document)."""
        if full_page:
            w, h = self.eval("[window.innerWidth, Math.max(window.innerHeight, ...Array.from(document.querySelectorAll("
                             "'[data-testid=stMain], [data-testid=stMainBlockContainer], body')).map(e => e.scrollHeight))]")
            self.send("Emulation.setDeviceMetricsOverride", width=w, height=min(int(h) + 40, 16000),
                      deviceScaleFactor=1, mobile=False)
            time.sleep(1.5)                       # let plotly re-lay out at the new size
        data = self.send("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for _ in range(10):                       # child processes may still be flushing the profile
            shutil.rmtree(self.profile, ignore_errors=True)
            if not os.path.exists(self.profile):
                break
            time.sleep(0.3)


def start_dashboard(run_dirs, port: int, log_path: Path) -> subprocess.Popen:
    """Start the app exactly as ``triage-monitor dashboard`` would, and wait for Streamlit's health check."""
    log = open(log_path, "w")
    proc = subprocess.Popen(build_command([str(r) for r in run_dirs], "127.0.0.1", port), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok":
                return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"streamlit did not come up; log:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


CHARTS_JS = "Array.from(document.querySelectorAll('.js-plotly-plot')).filter(e => e.querySelector('.main-svg')).length"
RUNNING_JS = "!!document.querySelector('[data-testid=stStatusWidget]')"
TABLES_JS = "document.querySelectorAll('[data-testid=stDataFrame]').length"
EXCEPTION_JS = "document.querySelectorAll('[data-testid=stException]').length"

needs_chromium = pytest.mark.skipif(chromium_binary() is None,
                                    reason="Chromium is not installed (apt-get install -y chromium); "
                                           "the Makefile's set-up installs it")


@pytest.fixture
def browser():
    pytest.importorskip("websocket", reason="websocket-client is not installed")
    b = Chromium()
    yield b
    b.close()


@needs_chromium
def test_dashboard_renders_in_chromium(browser, demo_run_dir, demo_run_dir_none, tmp_path):
    port = free_port()
    proc = start_dashboard([demo_run_dir, demo_run_dir_none], port, tmp_path / "streamlit.log")
    try:
        browser.navigate(f"http://127.0.0.1:{port}/")
        # conditions, each with a hang guard only (a loaded 2-core machine renders this page in minutes)
        browser.wait_for(f"{CHARTS_JS} >= 8", timeout=900)
        # let the script finish (the status widget disappears: the stage table with its 499-draw null is
        # the last thing computed, over a minute on a loaded 2-core machine), then the last charts draw
        browser.wait_for(f"!{RUNNING_JS}", timeout=900)
        browser.wait_for(f"{CHARTS_JS} >= 13", timeout=900)
        try:
            browser.wait_for(f"{TABLES_JS} >= 1", timeout=300)
        except TimeoutError:
            text = browser.eval("document.body.innerText")
            pytest.fail("no stage table; the page's Stages section reads:\n" + text[text.rfind("Stages"):][:2000])
        time.sleep(1.0)
        shot = browser.screenshot(ARTIFACTS / "browser" / "dashboard.png")
        info = browser.eval("""({
            charts: document.querySelectorAll('.js-plotly-plot').length,
            traces: document.querySelectorAll('.js-plotly-plot .scatterlayer .trace, .js-plotly-plot .barlayer .trace,'
                                              + ' .js-plotly-plot .heatmaplayer .hm').length,
            title: document.querySelector('h1') && document.querySelector('h1').innerText,
            text: document.body.innerText,
            tables: document.querySelectorAll('[data-testid=stDataFrame]').length})""")
        assert info["charts"] >= 13, info["charts"]      # + the step time by phase, and of the two runs compared
        assert info["traces"] >= 20
        assert "post-mortem" in info["title"]
        assert "Stages" in info["text"] and "Response drill-down" in info["text"]
        assert "Step time and the full cycle" in info["text"] and "CPU figures" in info["text"]
        assert "Generation share g" in info["text"] and "Projected speedup at k = 2.3" in info["text"]
        assert info["tables"] >= 3                                 # the stage table, the two runs' phases, mismatch
        assert browser.eval(EXCEPTION_JS) == 0, "the page shows an exception"
        assert shot.stat().st_size > 50_000                        # a real rendering, not a blank page
    finally:
        stop(proc)


@needs_chromium
def test_dashboard_bad_path_message_in_browser(browser, tmp_path):
    (tmp_path / "not_a_run").mkdir()
    port = free_port()
    # bypass the launcher's validation (it refuses bad paths up front) to see the page's own message
    cmd = build_command([str(tmp_path / "not_a_run")], "127.0.0.1", port)
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "log.txt").read_text()
                time.sleep(0.2)
        browser.navigate(f"http://127.0.0.1:{port}/")
        text = browser.wait_for("document.querySelector('[data-testid=stAlert]') && document.body.innerText",
                                timeout=60)
        assert "not a triage-monitor run directory" in text
        assert browser.eval(EXCEPTION_JS) == 0
        browser.screenshot(ARTIFACTS / "browser" / "dashboard_not_a_run.png", full_page=False)
    finally:
        stop(proc)


@needs_chromium
def test_report_renders_offline(demo_run_dir, tmp_path):
    pytest.importorskip("websocket", reason="websocket-client is not installed")
    from triage_monitor.offline.report import write_report

    out = write_report([demo_run_dir], tmp_path / "report.html", draws=49)
    b = Chromium(offline=True)                   # no network at all: everything must be inline
    try:
        b.navigate(out.resolve().as_uri())
        b.wait_for("document.readyState == 'complete'", timeout=60)
        assert b.wait_for(f"({CHARTS_JS} >= 9) && {CHARTS_JS}", timeout=30) == 9    # + the step time by phase
        assert b.eval("document.querySelectorAll('table.stage-table tbody tr').length") == 4
        # the whole stage table fits a 1,500 px window: no column is cut off behind a scroll bar
        fit = b.eval("(() => { const t = document.querySelector('table.stage-table');"
                     " return [t.scrollWidth, t.parentElement.clientWidth]; })()")
        assert fit[0] <= fit[1], fit
        b.screenshot(ARTIFACTS / "browser" / "report.png")
    finally:
        b.close()


WRITER = """
import os, sys, time, torch
from triage_monitor.batch import TokenBatch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig
g = torch.Generator().manual_seed(0)
stop = sys.argv[2]                 # steps go on until this file exists
with MismatchMonitor(sys.argv[1], MonitorConfig(window=4, calibration_steps=3)) as mon:
    step = -1
    while not os.path.exists(stop):
        step += 1
        s = -torch.rand(8, 48, generator=g) * 3 - 0.01
        lp = (s + torch.randn(8, 48, generator=g) * 0.1).clamp(max=0)
        mon.log_step(step, TokenBatch.from_padded(lp, s, torch.linspace(-1, 1, 8), torch.ones(8, 48, dtype=torch.bool)))
        mon.writer.flush() if hasattr(mon.writer, "flush") else None
        print(step, flush=True)
        time.sleep(float(sys.argv[3]))
"""

PLOT_STEPS_JS = """(() => {
  const out = {};
  for (const el of document.querySelectorAll('.js-plotly-plot')) {
    const title = (el.layout && el.layout.title && (el.layout.title.text || el.layout.title)) || '';
    const xs = (el.data || []).filter(t => t.meta && t.meta.column && 'run' in t.meta && Array.isArray(t.x))
                              .flatMap(t => t.x).filter(x => typeof x === 'number');
    if (xs.length) out[String(title)] = Math.max(...xs);
  }
  return out;
})()"""


@needs_chromium
def test_dashboard_of_a_run_being_written_is_one_snapshot(browser, tmp_path):
    """A run written while the page loads: the overview, the time series and the localisation chart (read
    later in the page, from the token files) end at the same step -- the page's one listing of the run.  The
    writer goes on until the page is done (it stops when told, not after a number of steps), so the run always
    changes while the page reads it."""
    import sys
    import threading

    run = tmp_path / "live-run"
    stop_file = tmp_path / "stop-writing"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(run), str(stop_file), "0.15"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    written = []                                             # the steps the writer has finished, in order

    def follow():
        for line in writer.stdout:
            if line.strip().isdigit():
                written.append(int(line))

    threading.Thread(target=follow, daemon=True).start()
    try:
        while len(written) < 6:                              # a few steps on disk before the page opens
            assert writer.poll() is None, "the writer stopped before the page opened"
            time.sleep(0.05)
        port = free_port()
        proc = start_dashboard([run], port, tmp_path / "streamlit.log")
        try:
            browser.navigate(f"http://127.0.0.1:{port}/")
            browser.wait_for(f"{CHARTS_JS} >= 6", timeout=900)
            browser.wait_for(f"!{RUNNING_JS}", timeout=900)  # the page's script has finished
            browser.wait_for(f"{CHARTS_JS} >= 6", timeout=300)
            assert writer.poll() is None, "the writer stopped while the page loaded"
            last = browser.eval(PLOT_STEPS_JS)
            steps_metric = browser.eval("""Array.from(document.querySelectorAll('[data-testid=stMetric]'))
                .map(e => e.innerText).find(t => t.startsWith('Steps'))""")
            assert browser.eval(EXCEPTION_JS) == 0, "the page shows an exception"
        finally:
            stop(proc)
        n_steps = int(steps_metric.split()[-1].replace(",", ""))
        while written[-1] < n_steps:                         # the run did grow past the page's listing
            assert writer.poll() is None, "the writer stopped"
            time.sleep(0.05)
    finally:
        stop_file.touch()
        try:
            writer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
    loc = [v for k, v in last.items() if k.startswith("Localisation")]
    direction = [v for k, v in last.items() if k.startswith("Direction")]
    assert loc and direction, last
    # steps 0 .. n-1 in the overview; every chart ends at n-1, although the writer kept adding steps
    assert set(last.values()) == {n_steps - 1}, (n_steps, last)


POSTMORTEM_JS = """(() => {
  const banner = document.querySelector('#triage-verdict');
  const note = document.querySelector('#triage-step-note');
  const charts = {};
  for (const el of document.querySelectorAll('.js-plotly-plot')) {
    const title = String((el.layout && el.layout.title && (el.layout.title.text || el.layout.title)) || '');
    const data = el.data || [];
    charts[title] = {
      marker: data.filter(t => t.meta && t.meta.marker === 'destabilised').map(t => t.meta.step),
      guides: data.filter(t => t.meta && t.meta.guide).map(t => [t.meta.guide, t.meta.value === undefined ? null : t.meta.value]),
      heatmap: data.filter(t => t.type === 'heatmap').map(t => t.meta && t.meta.step),
      runs: data.filter(t => t.meta && t.meta.run && t.meta.column && t.line).map(t => [t.meta.run, t.meta.role, t.line.color]),
    };
  }
  return {banner: banner && banner.innerText, level: banner && banner.dataset.level, note: note && note.innerText,
          top: banner && Math.round(banner.getBoundingClientRect().top), charts};
})()"""


@needs_chromium
def test_dashboard_opens_on_the_verdict_the_destabilisation_and_the_informative_step(browser, tmp_path):
    """A failing run shaped like the demo's (a reward that falls from step 30, destabilised at step 35 by the stated
    definition; a sampler drifting from step 10) with a reference run of the same job: on the page, read from the
    DOM, the verdict banner stands on top of the first screen with the run verdict's text; every time series marks
    step 35; the ρ_asym chart draws the reference's band beside the published one, the inspected run in red and the
    reference in grey; the token views (δ histogram, heatmap) open at the verdict's most informative step, with the
    selector and the reason beside them.  The first screen is saved as dashboard_first_screen.png."""
    import torch

    from test_verdict import _batch, _failing_run
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig
    from triage_monitor.offline.verdict import reference_of_run, verdict_of_steps
    from triage_monitor.offline.analysis import open_run
    from triage_monitor.offline.views import INSPECTED_COLOR, REFERENCE_COLOR

    failing = _failing_run(tmp_path / "failing")
    g = torch.Generator().manual_seed(5)
    with MismatchMonitor(tmp_path / "reference", MonitorConfig(window=5, calibration_steps=3)) as mon:
        for step in range(60):
            mon.log_step(step, _batch(g, drift=0.0), extra={"reward": 0.6})
    band = reference_of_run(open_run(tmp_path / "reference"))
    want = verdict_of_steps(failing.steps(), reference=band)
    assert want.outcome["step"] == 35 and want.focus_step is not None
    port = free_port()
    log = tmp_path / "streamlit.log"
    cmd = build_command([str(tmp_path / "failing")], "127.0.0.1", port, reference=str(tmp_path / "reference"))
    at = cmd.index("--reference")                  # the launcher's own options (--allow-root=...) may follow it
    assert cmd[at:at + 2] == ["--reference", str(tmp_path / "reference")]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        browser.navigate(f"http://127.0.0.1:{port}/")
        browser.wait_for("!!document.querySelector('#triage-verdict')", timeout=900)
        browser.wait_for(f"!{RUNNING_JS}", timeout=900)              # the page's script has finished
        browser.wait_for(f"{CHARTS_JS} >= 10", timeout=300)
        time.sleep(1.0)
        browser.screenshot(ARTIFACTS / "browser" / "dashboard_first_screen.png", full_page=False)
        page = browser.eval(POSTMORTEM_JS)
        assert browser.eval(EXCEPTION_JS) == 0, "the page shows an exception"
    finally:
        stop(proc)
    # the banner: the verdict's lines, first on the page (under the title)
    assert page["banner"].splitlines() == [line.strip() for line in want.lines]
    assert page["level"] == "CRITICAL" and page["banner"].startswith("verdict: CRITICAL — destabilised at step 35")
    assert 0 < page["top"] < 300
    # the destabilisation step on every time series
    series = {t: c for t, c in page["charts"].items()
              if t.split(" · ")[0] in ("Direction: ρ_asym = mass(A⁻) / mass(A⁺)", "Small-gap share |δ| < 0.05",
                                       "q0.05 of δ", "k3 KL estimator", "Reward and accuracy",
                                       "Quadrant masses (share of |A| mass)", "Localisation")}
    assert len(series) == 7, list(page["charts"])
    assert all(c["marker"] == [35] for c in series.values()), {t: c["marker"] for t, c in series.items()}
    # the reference's band beside the published one; the inspected run red, the reference grey
    direction = next(c for t, c in series.items() if t.startswith("Direction"))
    guides = dict((k, v) for k, v in direction["guides"])
    assert guides["healthy"] == [1.023, 1.337] and guides["reference"] == pytest.approx([band.lo, band.hi])
    colours = {(run, role): colour for run, role, colour in direction["runs"]}
    assert colours[("failing", "inspected")] == INSPECTED_COLOR and colours[("reference", "reference")] == REFERENCE_COLOR
    # the token views at the most informative step, the selector and the reason beside them
    focus = want.focus_step
    hist = [t for t in page["charts"] if t.startswith("δ distribution")]
    assert hist == [f"δ distribution (log count) · step {focus}"], hist
    heat = [c["heatmap"] for t, c in page["charts"].items() if t.startswith("Segment tail fraction")]
    assert heat == [[focus]], heat
    assert page["note"].startswith(f"Opened at step {focus}: {want.focus_why}")
