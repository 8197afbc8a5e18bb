"""What the commands print (docs/cli.md#printed-commands): every command the tool prints runs as printed from where
the user stands after the README's set-up; a second ``make demo`` starts afresh or says it continues; INFO chatter and
library noise only with ``-v``; log lines above a progress bar, never inside it."""

from __future__ import annotations

import html
import io
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from triage_monitor import exits
from triage_monitor.cli import main

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent          # the environment the README's set-up makes (.venv/bin)
#: the study's job, tiny (tests/test_study.py's TINY): a few seconds a run
TINY = ["--task", "walk", "--response-len", "16", "--alphabet", "4", "--sft-steps", "0", "--prompts-per-step", "2",
        "--group-size", "4", "--eval-size", "4", "--gate-width", "8", "--repair-width", "16", "--segment-width", "8",
        "--window", "3", "--calibration-steps", "2", "--nvfp4-backend", "native", "--follow-every", "2",
        "--eval-every", "2"]


def readme_state(tmp_path: Path) -> dict:
    """The shell the README's set-up leaves: the repository's ``.venv`` (here a link to this environment) in the
    working directory, not activated (``make`` never activates it): ``PATH`` without its ``bin``."""
    (tmp_path / ".venv").symlink_to(VENV_BIN.parent, target_is_directory=True)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).resolve() != VENV_BIN.resolve())
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(PATH=path, COLUMNS="400")
    return env


def bash(cmd: str, cwd: Path, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, **kw)


def runs_until(cmd: str, cwd: Path, env: dict, started: str, timeout: float = 120.0) -> str:
    """Start ``cmd`` in bash as typed, read its stderr until a line holds ``started`` (then stop it, and what it
    started) or it ends; returns what it wrote."""
    proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if started in line:
                break
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    return "".join(seen)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_printed_dashboard_command_runs_as_printed(tmp_path):
    """The study run as ``make demo`` runs it (``.venv/bin/triage-monitor study``, from the repository, .venv not
    activated): the dashboard command it prints — and the same command in its report — starts with the program as
    typed there and runs as printed (bash, the same directory and PATH: the dashboard's launcher checks both runs
    and starts its server), where a bare ``triage-monitor`` is "command not found"."""
    env = readme_state(tmp_path)
    assert bash("triage-monitor --version", tmp_path, env).returncode == 127          # not on PATH here
    proc = bash(shlex.join([".venv/bin/triage-monitor", "study", "--out", "study", "--arms", "none,fp32", "--seeds",
                            "0", "--steps", "4", "--jobs", "1", "--sampler-lag", "2", *TINY]), tmp_path, env,
                timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [m.group(1) for m in re.finditer(r"(\S*triage-monitor dashboard .*)$", proc.stdout, re.M)]
    assert len(printed) == 1, proc.stdout[-3000:]
    cmd = printed[0].strip()
    assert cmd == ".venv/bin/triage-monitor dashboard study/runs/none-s0 study/runs/fp32-s0"
    page = (tmp_path / "study" / "study.html").read_text()
    if "Side by side" in page:                         # the report names the pair when one run destabilised
        assert html.escape(cmd) in page and html.escape(str(tmp_path)) in page
    out = runs_until(cmd, tmp_path, env, "http://")
    assert "triage-monitor dashboard: http://127.0.0.1:" in out and "2 run(s)" in out, out
    assert "command not found" not in out and "error" not in out


def test_the_program_is_what_runs_from_here(tmp_path, monkeypatch):
    """exits.program(): the script's path as typed from the working directory when ``triage-monitor`` on PATH is not
    this installation's (the README's state after ``make demo``); plain ``triage-monitor`` once the environment is
    activated; a path with a space quoted; ``python -m triage_monitor`` without the script."""
    venv = tmp_path / "my venv"
    (venv / "bin").mkdir(parents=True)
    script = venv / "bin" / "triage-monitor"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["my venv/bin/triage-monitor", "study"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert exits.program() == "'my venv/bin/triage-monitor'"
    assert exits.command_line("dashboard", Path("runs/a b"), "runs/c") == \
        "'my venv/bin/triage-monitor' dashboard 'runs/a b' runs/c"
    monkeypatch.setenv("PATH", f"{venv / 'bin'}:/usr/bin:/bin")             # . "my venv/bin/activate"
    assert exits.program() == "triage-monitor"
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)                                               # outside: the absolute path
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(sys, "argv", [str(script), "study"])
    assert exits.program() == shlex.quote(str(script))
    monkeypatch.setattr(sys, "argv", ["/x/triage_monitor/__main__.py"])       # python -m triage_monitor
    monkeypatch.setattr(sys, "executable", str(tmp_path / "py" / "bin" / "python"))
    assert exits.program() == f"{shlex.quote(str(tmp_path / 'py' / 'bin' / 'python'))} -m triage_monitor"


def test_the_readme_writes_the_form_the_tool_prints_after_make_demo():
    """The README's commands after ``make demo`` use the form the tool prints there (``.venv/bin/triage-monitor``), and
    ``make demo`` starts afresh (``--force``)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash", 2)[2].split("```", 1)[0]
    lines = [x for x in block.splitlines() if x.strip()]
    assert lines and all(x.startswith(".venv/bin/triage-monitor ") for x in lines)
    assert ".venv/bin/triage-monitor dashboard runs/demo/runs/none-s0 runs/demo/runs/fp32-s0" in block
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "$(BIN)/triage-monitor study" in recipe and "--out runs/demo --force" in recipe


@pytest.mark.slow
def test_a_second_study_into_the_same_folder_says_it_continues_or_starts_afresh(tmp_path, capsys, caplog):
    """``study`` into a folder whose runs exist: without options it says that each run continues as a new attempt;
    with ``--force`` (what ``make demo`` passes) the old runs are moved aside, one line each saying where, and the
    new runs start afresh (one attempt)."""
    from triage_monitor.offline.analysis import open_run

    out = tmp_path / "study"
    argv = ["study", "--out", str(out), "--arms", "none", "--seeds", "0", "--steps", "3", "--sampler-lag", "1",
            "--jobs", "1", *TINY]
    assert main(argv) == 0
    assert "already hold" not in capsys.readouterr().out
    assert main(argv) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert (f"1 run directory of this study already holds a run ({out / 'runs' / 'none-s0'}): a run of this "
            "configuration continues there as a new attempt") in said and "--force starts afresh" in said
    assert len(open_run(out / "runs" / "none-s0").manifest.attempts) == 2
    with caplog.at_level(logging.WARNING, logger="triage_monitor.records"):
        assert main(argv + ["--force"]) == 0
    moved = list((out / "runs").glob("none-s0.replaced-*"))
    lines = [r.getMessage() for r in caplog.records if "--force" in r.getMessage()]
    assert len(moved) == 1 and len(lines) == 1 and str(moved[0]) in lines[0] and "a new run starts" in lines[0]
    assert "already hold" not in capsys.readouterr().out
    assert len(open_run(out / "runs" / "none-s0").manifest.attempts) == 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_info_chatter_and_library_noise_only_with_v(tmp_path):
    """Real commands in their own processes: a replay whose alert clears (the default rules on a stale-sampler run)
    writes INFO lines only with -v; the demo with the torchao NVFP4 backend writes none of torchao's failed loads of
    its CUDA extensions, nor torch's pytree notes, nor any INFO line."""
    env = {**os.environ, "COLUMNS": "400"}
    script = str(VENV_BIN / "triage-monitor")
    run = tmp_path / "run"
    demo = subprocess.run([script, "demo", "--out", str(run), "--steps", "20", "--sampler-lag", "8", "--correction",
                           "none", *[a for a in TINY if a not in ("--nvfp4-backend", "native")],
                           "--nvfp4-backend", "torchao"], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr[-3000:]
    for text in (demo.stdout, demo.stderr):
        assert "Failed to load" not in text and "_C_mxfp8" not in text and "_pytree" not in text
        assert not re.search(r"^(INFO|DEBUG) ", text, re.M)
    # the analyze command the demo prints runs as printed, from where it ran
    printed = re.search(r"\(try: (.*analyze .*)\)\s*$", demo.stdout, re.M)
    assert printed, demo.stdout[-2000:]
    again = bash(printed.group(1), tmp_path, env, timeout=600)
    assert again.returncode in (0, 1) and "recomputed" in again.stderr, again.stderr[-2000:]
    quiet = subprocess.run([script, "alerts", str(run)], capture_output=True, text=True, env=env, timeout=300)
    loud = subprocess.run([script, "-v", "alerts", str(run)], capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == loud.returncode == 1                   # the replay raised an alert: a finding
    assert re.search(r"^INFO triage_monitor\.alerts: .*cleared", loud.stderr, re.M), loud.stderr[-2000:]
    assert not re.search(r"^(INFO|DEBUG) ", quiet.stderr, re.M), quiet.stderr[-2000:]
    assert quiet.stdout == loud.stdout                                # the result itself is the same


def on_screen(text: str) -> list:
    """The lines a terminal shows for ``text``: a carriage return goes back to the line's start, what follows
    overwrites."""
    shown = []
    for line in text.split("\n"):
        cells: list = []
        for part in line.split("\r"):
            cells[:len(part)] = part
        shown.append("".join(cells).rstrip())
    return shown


def test_the_commands_log_lines_go_above_a_tqdm_bar(capsys):
    """The commands' handler writes a WARNING line through tqdm while a tqdm bar is drawn: on screen the line holds
    the message alone, the bar is redrawn below it.  A plain stream handler puts it on the bar's line."""
    tqdm = pytest.importorskip("tqdm").tqdm
    log = logging.getLogger("triage_monitor.test_console_output")
    log.propagate = False
    try:
        for handler, inside in ((exits.progress_safe_handler(), False), (logging.StreamHandler(sys.stderr), True)):
            log.handlers = [handler]
            bar = tqdm(total=3, file=sys.stderr, ascii=True, mininterval=0)
            bar.update(1)
            log.warning("an alert line")
            bar.update(1)
            bar.close()
            shown = [x for x in on_screen(capsys.readouterr().err) if "an alert line" in x]
            assert len(shown) == 1
            assert ("it/s]" in shown[0] or "%|" in shown[0]) is inside, shown
    finally:
        log.handlers, log.propagate = [], True


def test_the_commands_log_lines_go_above_a_rich_bar():
    """Under a rich progress bar (which redirects stderr to print above itself) the commands' handler writes to the
    redirected stderr: the line reaches rich's console above the bar, not the stream the bar is drawn on."""
    from rich.console import Console
    from rich.progress import Progress

    screen = io.StringIO()
    log = logging.getLogger("triage_monitor.test_console_output.rich")
    log.propagate = False
    log.handlers = [exits.progress_safe_handler()]
    real_stderr = sys.stderr
    try:
        sys.stderr = io.StringIO()                      # the terminal's stderr, as the handler found it
        beneath = sys.stderr
        with Progress(console=Console(file=screen, force_terminal=True, width=100), redirect_stderr=True) as p:
            task = p.add_task("steps", total=2)
            log.warning("an alert line")
            p.update(task, advance=2)
        assert "an alert line" in screen.getvalue() and "an alert line" not in beneath.getvalue()
    finally:
        sys.stderr = real_stderr
        log.handlers, log.propagate = [], True
