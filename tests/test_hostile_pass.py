"""A fresh hostile pass over the reliability promises (docs/reliability.md): each break it found, fixed, with a
test on real processes and real files.  The commands run as processes of their own (``python -m triage_monitor``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_hostile_trial import _cli, _run

ROOT = Path(__file__).resolve().parents[1]


def _writer_paused_after(d, roll_steps: int, first: int, last: int, finish: str) -> subprocess.Popen:
    """A writer process on run directory ``d``: steps 0 .. first-1 logged and flushed, then (once the test has done
    its damage and written a line to its stdin) steps first .. last-1 and the code ``finish`` (the monitor is ``m``);
    returned once the first steps are on disk."""
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from test_hostile_trial import _batch; "
            "from triage_monitor.monitor import MismatchMonitor, MonitorConfig; "
            f"m = MismatchMonitor(sys.argv[1], MonitorConfig(window=2, calibration_steps=2, roll_steps={roll_steps})); "
            f"[m.log_step(s, _batch(s)) for s in range({first})]; assert m.flush(timeout=120); print('go', flush=True); "
            f"sys.stdin.readline(); [m.log_step(s, _batch(s)) for s in range({first}, {last})]; {finish}")
    p = subprocess.Popen([sys.executable, "-c", code, str(d), str(ROOT / "tests")], cwd=ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "go"
    return p


def test_a_removed_token_block_is_named_as_missing_token_records(tmp_path):
    """A finished run one of whose token blocks was removed (steps 4-7: their steps rows count tokens, no token
    records remain): ``analyze``, ``alerts`` and ``report`` name the four steps on an ``incomplete records:`` line and
    exit 1 (before: ``analyze`` blamed 24 metrics without saying why and ``report`` exited 0).  A run written with
    ``record_tokens=False`` is not named."""
    d = tmp_path / "run"
    _run(d, steps=12)
    (block,) = [f for f in (d / "tokens").iterdir() if f.name.startswith("steps-00000004-00000007-")]
    block.unlink()
    want = "4 step(s) have a steps row counting tokens but no token records (a token file removed or never written): " \
           "4, 5, 6, 7"
    for cmd in (["analyze"], ["alerts"], ["report", "-o", tmp_path / "r.html", "--draws", "9"]):
        code, out = _cli(cmd[0], d, *cmd[1:])
        assert code == 1 and want in out and "the records are complete" not in out, (cmd, out)
    steps_only = tmp_path / "steps-only"
    _run(steps_only, steps=4, record_tokens=False)
    code, out = _cli("alerts", steps_only)
    assert "no token records" not in out, out


def test_the_page_started_without_allow_root_serves_only_the_runs_given(tmp_path, monkeypatch):
    """``streamlit run app.py -- RUN`` (no ``--allow-root``) and ``$TRIAGE_MONITOR_RUNS``, the two ways the docs
    give to start the page without the launcher: a sibling run typed in the sidebar, the same through ``..`` and a
    symbolic link planted inside the given run pointing out of it are refused as outside the run roots (before: all
    three opened: any run directory on the server's disk); the given run is shown."""
    import pytest

    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from triage_monitor.dashboards.launch import app_path

    given, other = tmp_path / "given", tmp_path / "other"
    _run(given, steps=3)
    _run(other, steps=3)
    (given / "link").symlink_to(other, target_is_directory=True)
    for how in ("argv", "env"):
        if how == "argv":
            monkeypatch.setattr(sys, "argv", [str(app_path()), str(given)])
            monkeypatch.delenv("TRIAGE_MONITOR_RUNS", raising=False)
        else:
            monkeypatch.setattr(sys, "argv", ["pytest"])
            monkeypatch.setenv("TRIAGE_MONITOR_RUNS", str(given))
        for typed in (other, given / ".." / "other", given / "link"):
            at = AppTest.from_file(str(app_path()), default_timeout=180).run()
            at.text_area(key="runs_text").input(f"{given}\n{typed}").run()
            assert not at.exception
            errors = [e.value for e in at.error]
            assert len(errors) == 1 and errors[0].startswith(f"{typed}: outside the run roots"), (how, typed, errors)
            assert at.sidebar.selectbox[0].options == ["given"]


def test_docs_hooks_name_the_alert_lines_level_as_the_process_prints_it(tmp_path):
    """A real process whose sampler fires the ERROR rule ``rho_asym_critical`` prints it at ERROR on stderr;
    docs/hooks.md says so wherever it describes the alert line (five framework sections had said "a WARNING
    line")."""
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from test_hostile_trial import _batch; "
            "from triage_monitor.monitor import MismatchMonitor, MonitorConfig; "
            "m = MismatchMonitor(sys.argv[1], MonitorConfig(window=2, calibration_steps=2)); "
            "[m.log_step(s, _batch(s)) for s in range(10)]; m.close()")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), str(ROOT / "tests")], cwd=ROOT, text=True,
                       capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    assert "triage ERROR (mismatch): rho_asym_critical" in p.stderr
    text = (ROOT / "docs" / "hooks.md").read_text()
    assert "a WARNING line" not in text
    assert text.count("a WARNING or ERROR line (the rule's level)") >= 5


def test_a_bare_tensorboard_tracker_of_an_object_store_run_names_where_it_writes(tmp_path):
    """A run on S3 (a local S3 server in a child process) with ``loggers=["tensorboard"]``, in a process whose
    working directory is an empty folder: the event files go under that folder's ``runs/`` (SummaryWriter's
    default; the store takes no event files) and one WARNING names the folder (before: nothing said so)."""
    import pytest

    pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    pytest.importorskip("tensorboard")
    import boto3
    from test_store_identity import SERVER

    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="tb-run")
        work = tmp_path / "cwd"
        work.mkdir()
        code = ("import sys; sys.path.insert(0, sys.argv[2]); from test_hostile_trial import _batch; "
                "from triage_monitor.monitor import MismatchMonitor, MonitorConfig; "
                "m = MismatchMonitor(sys.argv[1], MonitorConfig(window=2), loggers=['tensorboard']); "
                "[m.log_step(s, _batch(s)) for s in range(3)]; m.close()")
        uri = f"s3://tb-run/run?endpoint_override=127.0.0.1:{port}&scheme=http"
        p = subprocess.run([sys.executable, "-c", code, uri, str(ROOT / "tests")], cwd=work, text=True,
                           capture_output=True, timeout=300, env=env)
    finally:
        server.kill()
        server.wait(timeout=30)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("a bare 'tensorboard' tracker writes its event files on this machine, under "
                          f"{work}/runs/<date>_<host>") == 1, p.stderr
    assert any(f.name.startswith("events.out.tfevents") for f in (work / "runs").rglob("*"))


def test_analyze_of_a_run_it_may_not_write_still_prints_the_check_and_the_verdict(tmp_path):
    """``analyze RUN`` (no ``--out``) where the run's ``analysis/`` cannot be made (a file of that name here; a
    read-only mount or another user's run in the trial): one line says the table could not be saved and how to save
    it elsewhere, then the comparison and the verdict are printed, exit 0 (before: exit 3 after the whole
    recomputation, nothing printed).  With ``--out`` to such a place it stays exit 3."""
    d = tmp_path / "run"
    _run(d, steps=8)
    (d / "analysis").write_text("not a folder")
    code, out = _cli("analyze", d)
    assert code == 0, out
    assert f"the table could not be saved to {d / 'analysis' / 'metrics.csv'}" in out
    assert "give --out FILE to save the table elsewhere" in out
    assert "the records are complete" in out and "verdict:" in out and "Traceback" not in out
    code, out = _cli("analyze", d, "--out", d / "analysis" / "m.csv")
    assert code == 3 and "cannot save the table" in out


def test_a_run_being_written_is_not_said_to_lack_the_steps_rows_past_its_last_one(tmp_path):
    """Readers of a live job list the steps table before the token table (or leave later steps out of their
    snapshot): token records past the last steps row read were named as "N step(s) have token records but no steps
    row" (45 steps named by ``analyze`` while a job wrote).  Here the last steps block (steps 8-11) is removed: with
    run.json ``running`` only the status line is printed; once ``finished`` the four steps are named."""
    import json

    d = tmp_path / "run"
    _run(d, steps=12)
    (block,) = [f for f in (d / "steps").iterdir() if f.name.startswith("steps-00000008-00000011-")]
    block.unlink()
    man = json.loads((d / "run.json").read_text())
    man["status"] = "running"
    (d / "run.json").write_text(json.dumps(man))
    code, out = _cli("alerts", d)
    assert code == 1 and "run.json says the run is 'running'" in out and "no steps row" not in out, out
    man["status"] = "finished"
    (d / "run.json").write_text(json.dumps(man))
    code, out = _cli("alerts", d)
    assert code == 1 and "4 step(s) have token records but no steps row: 8, 9, 10, 11" in out, out


def test_a_step_logged_after_a_later_one_is_warned_once(tmp_path):
    """Steps 0, 1, 2, 5, 3, 4, 2 logged by a real process (a counter reset, an evaluation step logged with the
    training monitor): one WARNING at the first step that goes back, naming both steps and what readers will show
    (before: nothing said, and ``analyze`` later blamed 25 window metrics without a reason); the steps table holds
    each step once."""
    from triage_monitor.offline.analysis import open_run

    code = ("import sys; sys.path.insert(0, sys.argv[2]); from test_hostile_trial import _batch; "
            "from triage_monitor.monitor import MismatchMonitor, MonitorConfig; "
            "m = MismatchMonitor(sys.argv[1], MonitorConfig(window=2, calibration_steps=2)); "
            "[m.log_step(s, _batch(s)) for s in (0, 1, 2, 5, 3, 4, 2)]; m.close()")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), str(ROOT / "tests")], cwd=ROOT, text=True,
                       capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("logged after step") == 1
    assert "step 3 logged after step 5 by this process: steps should increase" in p.stderr
    assert open_run(tmp_path / "run").steps()["step"].tolist() == [0, 1, 2, 3, 4, 5]


def test_a_run_directory_removed_under_a_live_monitor_is_not_called_finished(tmp_path):
    """``rm -rf`` of the run directory after step 4 of a real writer process, 20 more steps: training goes on and
    close() ends at once (the writer makes the directory again for the later records); one ERROR line says the
    directory was removed and the earlier records are gone, run.json says ``failed`` and ``analyze`` names it
    (before: run.json ``finished``, ``analyze`` blamed 33 metrics without a reason)."""
    import json
    import shutil

    d = tmp_path / "run"
    p = _writer_paused_after(d, 4, 5, 25, "print(m.close(timeout=60))")
    shutil.rmtree(d)
    out, err = p.communicate("\n", timeout=300)
    assert p.returncode == 0, err
    assert err.count(f"the run directory {d} was removed or replaced while this monitor wrote it") == 1
    assert json.loads((d / "run.json").read_text())["status"] == "failed"
    code, text = _cli("analyze", d)
    assert code == 1 and "run.json says the run is 'failed'" in text and "the records are complete" not in text


def test_close_returns_false_when_rows_were_dropped_or_run_json_was_not_written(tmp_path):
    """A real writer process whose ``tokens/`` becomes a file and whose run.json becomes a directory after step 2
    (a bucket deleted under the job in the trial: every later write fails): training goes on, the rows are counted
    dropped, and ``close()`` returns False, as its docstring promises (before: True with 972 rows dropped and
    run.json not written)."""
    import shutil

    d = tmp_path / "run"
    p = _writer_paused_after(d, 2, 3, 6, "ok = m.close(timeout=60); print(ok, m.sink.dropped_rows)")
    shutil.rmtree(d / "tokens")
    (d / "tokens").write_text("in the way")
    (d / "run.json").unlink()
    (d / "run.json").mkdir()
    out, err = p.communicate("\n", timeout=300)
    assert p.returncode == 0, err
    ok, dropped = out.split()
    assert ok == "False" and int(dropped) > 0, (out, err)
    assert "record row(s) of this run were not written" in err and "could not write" in err


def test_a_token_block_damaged_where_it_still_decodes_fails_analyze_and_report(tmp_path):
    """64 bytes flipped in the middle of a token block after a cached ``analyze`` (uncompressed pages: the file
    still decodes, into other log-probs): ``analyze`` and ``report`` both recompute (the cache key holds size and
    mtime), find metrics that differ from the live values beyond what a resume explains, and exit 1 (before:
    ``report`` exited 0 on it)."""
    d = tmp_path / "run"
    _run(d, steps=8)
    assert _cli("analyze", d)[0] == 0
    block = sorted((d / "tokens").glob("*part-0.parquet"))[0]
    data = bytearray(block.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    block.write_bytes(bytes(data))
    code, out = _cli("analyze", d)
    assert code == 1 and "differ from the live values" in out and "the records are complete" not in out, out
    code, out = _cli("report", d, "-o", tmp_path / "r.html", "--draws", "9")
    assert code == 1 and "differ from the live values beyond what a resume explains" in out, out
