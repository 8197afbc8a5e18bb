"""The commands' shared contract (docs/cli.md): exit statuses, error lines, resumed runs in analyze, Ctrl-C."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.cli import build_parser, main
from triage_monitor.monitor import MismatchMonitor, MonitorConfig


def _batch(step: int, seed: int = 0, B: int = 6, T: int = 40) -> TokenBatch:
    g = torch.Generator().manual_seed(1000 * seed + step)
    s = -torch.rand(B, T, generator=g) * 3 - 0.01
    lp = (s + torch.randn(B, T, generator=g) * 0.1 - (torch.rand(B, T, generator=g) < 0.05) * 2).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.linspace(-1, 1, B), torch.ones(B, T, dtype=torch.bool))


def _write(run_dir: Path, steps, seed: int = 0, roll_steps: int = 50) -> None:
    cfg = MonitorConfig(window=3, calibration_steps=2, roll_steps=roll_steps)
    with MismatchMonitor(run_dir, cfg) as mon:
        for s in steps:
            mon.log_step(s, _batch(s, seed))


def test_top_level_help_documents_exit_statuses_in_plain_text():
    text = build_parser().format_help()
    for code in ("0 ", "1 ", "2 ", "3 ", "130"):
        assert f"\n  {code}" in text
    assert "``" not in text and "triage-monitor COMMAND: error: MESSAGE" in text


def test_empty_run_is_an_input_error_for_analyze_report_and_alerts(tmp_path, capsys):
    MismatchMonitor(tmp_path / "empty").close()
    codes = {}
    for cmd, extra in (("analyze", []), ("report", ["-o", str(tmp_path / "r.html")]), ("alerts", [])):
        codes[cmd] = main([cmd, str(tmp_path / "empty"), *extra])
        err = capsys.readouterr().err
        assert f"triage-monitor {cmd}: error: " in err and "no recorded steps" in err and "Traceback" not in err
    assert codes == {"analyze": 2, "report": 2, "alerts": 2}
    assert not (tmp_path / "r.html").exists()
    # a path that is not a run: 2 as well, same prefix
    for cmd in ("analyze", "report", "alerts", "dashboard"):
        assert main([cmd, str(tmp_path / "nope")]) == 2
        assert f"triage-monitor {cmd}: error: " in capsys.readouterr().err


def test_analyze_states_resume_effects_and_exits_1_on_other_differences(tmp_path, capsys):
    # a job resumed from a checkpoint at step 5: steps 5..7 are redone under a new attempt; the live
    # window of steps 5..6 restarted there, the recomputation pools the earlier attempt's steps
    run = tmp_path / "resumed"
    _write(run, range(8))
    _write(run, range(5, 12), seed=1)
    assert main(["analyze", str(run)]) == 0
    out = capsys.readouterr().out
    assert "trailing window restarts at each attempt" in out and "window/" in out
    assert "expected consequence" in out
    # a live value that no resume explains: exit 1, named on stderr
    from runfiles import file_of

    f = file_of(run, "steps", 9)                           # the block of attempt 2 holding step 9
    t = pq.read_table(f)
    i = t.schema.get_field_index("k3_kl")
    k3 = [v * 1.5 if s == 9 else v for s, v in zip(t.column("step").to_pylist(), t.column("k3_kl").to_pylist())]
    pq.write_table(t.set_column(i, "k3_kl", pa.array(k3)), f)
    assert main(["analyze", str(run)]) == 1
    assert "beyond what a resume explains: k3_kl" in capsys.readouterr().err


def test_analyze_explains_tau_tail_calibrated_on_rewritten_steps(tmp_path, capsys):
    # the second attempt rewrites every step, the calibration steps included, and reads run.json's
    # tau_tail (calibrated by the first attempt on data that is no longer visible)
    run = tmp_path / "rerun"
    _write(run, range(6))
    _write(run, range(6), seed=7)
    assert main(["analyze", str(run)]) == 0
    out = capsys.readouterr().out
    assert "later rewrote (0..1)" in out and "tau-dependent metrics" in out
    # the same data written once: every metric equal, nothing to state
    _write(tmp_path / "once", range(6), seed=7)
    assert main(["analyze", str(tmp_path / "once")]) == 0
    assert "equal the live values" in capsys.readouterr().out


def test_dashboard_print_command_quotes_paths(tmp_path, capsys):
    pytest.importorskip("streamlit")
    run = tmp_path / "my runs" / "a run"
    _write(run, range(2))
    assert main(["dashboard", str(run), "--print-command"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[-2:] == [str(run.resolve()), f"--allow-root={run.resolve()}"] and argv[argv.index("--") - 1] == "none"


def test_ctrl_c_stops_with_one_line_and_status_130(tmp_path):
    """A real process and a real SIGINT during training: one line on stderr, no traceback, exit 130."""
    log = tmp_path / "out.txt"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "triage_monitor", "demo", "--out", str(tmp_path / "run"),
                                 "--steps", "400", "--sft-steps", "400", "--threads", "1"],
                                stdout=fh, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + 120
        while time.time() < deadline and "  step  reward" not in log.read_text():   # training (imports done)
            time.sleep(0.2)
        assert proc.poll() is None, "the demo ended before it could be interrupted"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == "triage-monitor demo: interrupted (Ctrl-C); stopped", err
    assert sum("interrupted" in ln for ln in lines) == 1


def test_every_command_names_unreadable_files(tmp_path, capsys):
    """A truncated steps/ Parquet file: analyze, alerts and report say how many files were skipped and
    which; the report shows them in the page too."""
    run = tmp_path / "run"
    from runfiles import file_of

    _write(run, range(8), roll_steps=1)                    # a file per step: one step's file is damaged
    bad = file_of(run, "steps", 3)
    bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])
    for cmd, extra in (("analyze", []), ("alerts", []), ("report", ["-o", str(tmp_path / "r.html"), "--draws", "9"])):
        main([cmd, str(run), *extra])
        err = capsys.readouterr().err
        assert f"triage-monitor {cmd}: warning: 1 unreadable file(s)" in err and str(bad) in err, (cmd, err)
    html = (tmp_path / "r.html").read_text()
    assert "1 unreadable file(s)" in html and bad.name in html


def test_ctrl_c_ends_the_process_even_when_clean_up_hangs(tmp_path):
    """A command whose clean-up never finishes after Ctrl-C (as when the interrupt lands in a lazy import and
    leaves the import lock held): the watchdog ends the process with status 130 and the one line."""
    code = (
        "import sys, time\n"
        "from triage_monitor import cli\n"
        "cli.FORCE_EXIT_AFTER_S = 2.0\n"
        "def stuck(args):\n"
        "    try:\n"
        "        print('ready', flush=True); time.sleep(60)\n"
        "    finally:\n"
        "        time.sleep(60)\n"
        "sys.exit(cli.run_command('demo', stuck, None))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.time() - t0 < 20, err
    assert [ln for ln in err.splitlines() if ln.strip()] == ["triage-monitor demo: interrupted (Ctrl-C); stopped"]


def test_resume_and_force_arguments(tmp_path):
    import argparse

    from triage_monitor.exits import add_existing_run_arguments

    p = argparse.ArgumentParser()
    add_existing_run_arguments(p)
    assert vars(p.parse_args([])) == {"resume": False, "force": False}
    assert vars(p.parse_args(["--resume"])) == {"resume": True, "force": False}
    assert vars(p.parse_args(["--force"])) == {"resume": False, "force": True}
    with pytest.raises(SystemExit):
        p.parse_args(["--resume", "--force"])          # one or the other
    helps = {a.option_strings[0]: a.help for a in p._actions if a.option_strings[0] in ("--resume", "--force")}
    assert ("continue the run already in --out as a new attempt even if its model / task / correction / seed / "
            "source differ (the changes are recorded in run.json); the metric configuration must match"
            == helps["--resume"])
    assert "a run already there is moved to <out>.replaced-<UTC time>" in helps["--force"]
    assert helps["--force"].startswith("start a new run in --out")


def _without_plotly(*argv: str, cwd) -> subprocess.CompletedProcess:
    """``triage-monitor ARGV`` in a fresh interpreter where plotly and streamlit cannot be imported (as in a plain
    ``pip install triage-monitor``, without the dashboard extra)."""
    code = ("import sys; sys.modules['plotly'] = None; sys.modules['streamlit'] = None\n"
            "from triage_monitor.cli import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.multiprocess
def test_report_without_the_dashboard_extra_names_it_and_exits_2(tmp_path):
    """Without plotly, ``report RUN -o x.html`` prints one line naming the extra to install and exits 2, writing
    nothing; ``report --help`` still lists the command's arguments and names the extra."""
    _write(tmp_path / "run", range(3))
    out = _without_plotly("report", str(tmp_path / "run"), "-o", str(tmp_path / "x.html"), cwd=tmp_path)
    assert (out.returncode, out.stderr.splitlines()) == (2, ["triage-monitor report: error: the HTML report needs plotly, which is "
                                           "not installed: pip install 'triage-monitor[dashboard]'"]), out.stderr
    assert not (tmp_path / "x.html").exists()
    helped = _without_plotly("report", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and helped.stderr == "", helped.stderr
    for arg in ("RUN_DIR", "--output", "--anchors", "--window", "--draws", "--seed"):
        assert arg in helped.stdout, arg
    assert "needs plotly, from the 'dashboard' extra: pip install 'triage-monitor[dashboard]'" in helped.stdout


# A long command interrupted at a known point of its work: the function named is replaced by one that says "ready"
# and blocks, so the SIGINT lands mid-command every time (not when a timer hopes it does).
_BLOCK_AT = '''
import sys, time, importlib
module, attr, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
owner = importlib.import_module(module)
for part in attr.split(".")[:-1]:
    owner = getattr(owner, part)
name = attr.split(".")[-1]
real, calls = getattr(owner, name), [0]
def blocked(*a, **k):
    calls[0] += 1
    if calls[0] >= nth:
        print("ready", flush=True)
        time.sleep(600)
    return real(*a, **k)
setattr(owner, name, blocked)
from triage_monitor.cli import main
sys.exit(main(sys.argv[4:]))
'''

_LONG_COMMANDS = {
    # command: (function blocked, at which call, argv after the command name; {run} / {tmp} filled in)
    "analyze": ("triage_monitor.analysis", "recompute", 1, ["{run}"]),
    "alerts": ("triage_monitor.alerts", "replay_engine", 1, ["{run}"]),
    "report": ("triage_monitor.report", "build_report", 1, ["{run}", "-o", "{tmp}/r.html"]),
    "import": ("triage_monitor.monitor", "MismatchMonitor.log_step", 2,
               ["table", "{tmp}/t.jsonl", "--out", "{tmp}/imported"]),
    "demo": ("triage_monitor.monitor", "MismatchMonitor.log_step", 3,
             ["--out", "{tmp}/demo", "--steps", "20", "--sft-steps", "2", "--threads", "1"]),
    "study": ("triage_monitor.monitor", "MismatchMonitor.log_step", 3,
              ["--out", "{tmp}/study", "--arms", "none", "--seeds", "1", "--jobs", "1", "--steps", "20",
               "--sft-steps", "2", "--threads", "1"]),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("command", sorted(_LONG_COMMANDS))
def test_ctrl_c_in_every_long_command_stops_it_with_one_line_and_status_130(tmp_path, command):
    """A real process and a real SIGINT in the middle of each long command's work: exit 130, exactly one
    "interrupted" line on stderr, no traceback, nothing on stdout that reads as success, no output file of a
    command that did not finish (the report)."""
    import json

    _write(tmp_path / "run", range(4))
    rows = [{"step": s, "sample_id": i, "learner_logp": -0.5 - 0.1 * i, "sampler_logp": -0.6, "advantage": 1.0}
            for s in range(4) for i in range(4)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    module, attr, nth, argv = _LONG_COMMANDS[command]
    argv = [a.format(run=tmp_path / "run", tmp=tmp_path) for a in argv]
    proc = subprocess.Popen([sys.executable, "-c", _BLOCK_AT, module, attr, str(nth), command, *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}, cwd=tmp_path)
    seen = []
    for line in proc.stdout:                       # waits on the condition: the command is inside its work
        seen.append(line)
        if line.strip() == "ready":
            break
    assert proc.poll() is None, "".join(seen) + proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("INFO ", "DEBUG "))]
    assert lines[-1] == f"triage-monitor {command}: interrupted (Ctrl-C); stopped", err
    assert sum("interrupted" in ln for ln in err.splitlines()) == 1, err
    for word in ("wrote", "imported", "saved"):
        assert word not in out.lower(), out
    assert not (tmp_path / "r.html").exists()
    # a run the command was writing says it was interrupted (not finished, not failed)
    written = [p for p in tmp_path.rglob("run.json") if p.parent != tmp_path / "run"]
    assert bool(written) == (command in ("import", "demo", "study")), written
    import json as _json
    assert {_json.loads(p.read_text())["status"] for p in written} <= {"interrupted"}, written


def test_ctrl_c_landing_in_a_finalizer_still_stops_the_command(tmp_path):
    """An interrupt that arrives while a ``__del__`` runs cannot be raised there: Python prints "Exception ignored
    ... KeyboardInterrupt" and carries on (the demo then trained until the watchdog, and the line appeared on
    stderr).  The command stops at once with the one line and status 130, and no such message."""
    code = (
        "import gc, sys, time\n"
        "from triage_monitor import cli\n"
        "cli.FORCE_EXIT_AFTER_S = 300.0\n"
        "class Slow:\n"
        "    def __del__(self):\n"
        "        print('in finalizer', flush=True)\n"
        "        while True: pass\n"          # until the interrupt, raised here, ends it
        "def work(args):\n"
        "    s = Slow(); s.me = s; del s\n"
        "    gc.collect()\n"
        "    print('after finalizer', flush=True)\n"
        "    time.sleep(300)\n"
        "sys.exit(cli.run_command('demo', work, None))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "in finalizer"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Exception ignored" not in err and "KeyboardInterrupt" not in err, err
    assert [ln for ln in err.splitlines() if ln.strip()] == ["triage-monitor demo: interrupted (Ctrl-C); stopped"]


def test_analyze_of_a_run_being_written_is_one_snapshot(tmp_path, monkeypatch, capsys):
    """A run still open (status running) gets three more steps while ``analyze`` recomputes (arranged: they are
    written from inside the recomputation, not raced): the table, the live check and the verdict all cover the
    five steps there when it started, and one line says the three later ones were left out.  Exit 0."""
    from triage_monitor.offline import analysis

    d = tmp_path / "run"
    mon = MismatchMonitor(d, MonitorConfig(window=3, calibration_steps=2))
    for s in range(5):
        mon.log_step(s, _batch(s))
    mon.flush()
    real = analysis.recompute

    def recompute_while_written(*a, **k):
        df = real(*a, **k)
        for s in range(5, 8):
            mon.log_step(s, _batch(s))
        mon.flush()
        return df

    monkeypatch.setattr(analysis, "recompute", recompute_while_written)
    try:
        assert main(["analyze", str(d)]) == 1          # a run still running is never called complete
    finally:
        mon.close()
    out, err = capsys.readouterr()
    assert "(5 steps, 1,200 tokens)" in out and re.search(r"all \d+ metrics equal the live values", out)
    assert "incomplete records: run.json says the run is 'running'" in out
    verdict = next(ln for ln in out.splitlines() if ln.startswith("  last step:"))   # the last step's status
    assert "at step 4" in verdict, verdict
    assert ("triage-monitor analyze: 3 step(s) recorded while this ran (after step 4) are not included; run it "
            "again to see them") in err
