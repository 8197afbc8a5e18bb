"""The run's manifest (triage_monitor.manifest): standard JSON, unknown keys kept, read errors naming the file,
how a new writer's configuration differs from the run's."""

import json
import math

import numpy as np
import pytest

from triage_monitor.rundir.manifest import RunManifest, config_differences, json_text, read_manifest
from triage_monitor.monitor import MismatchMonitor, MonitorConfig


def test_manifest_json_is_standard_json_with_nan_as_null(tmp_path):
    obj = {"a": math.nan, "b": [1.5, math.inf, (2.0, -math.inf)], "c": {"d": math.nan, "e": "x"},
           "f": np.int64(3), "g": np.float64(0.25), "h": tmp_path, "i": np.float32(0.5), "j": {3}}
    (tmp_path / "m.json").write_text(json_text(obj))
    text = (tmp_path / "m.json").read_text()
    assert json.loads(text) == {"a": None, "b": [1.5, None, [2.0, None]], "c": {"d": None, "e": "x"}, "f": 3,
                                "g": 0.25, "h": str(tmp_path), "i": 0.5, "j": "{3}"}
    assert "NaN" not in text and "Infinity" not in text
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_unknown_manifest_keys_are_kept_at_the_top_level_and_read_errors_name_the_file(tmp_path):
    """Keys this version does not know go to ``extra`` and back to the top level on rewrite (a key named like the
    field ``extra`` is one more unknown); the calibration is the one home of a calibrated τ_tail, a given one
    wins; a run.json that is no JSON object, or no JSON, is a ValueError naming the file."""
    raw = {"monitor_config": {"window": 4}, "calibration": {"tau_tail": -0.7}, "schema_version": 3,
           "future_key": [1, 2]}
    (tmp_path / "run.json").write_text(json.dumps(raw))
    m = read_manifest(tmp_path)
    assert m.calibration == {"tau_tail": -0.7} and m.tau_tail == -0.7 and m.schema_version == 3
    assert m.extra == {"future_key": [1, 2]}
    assert m.to_dict()["future_key"] == [1, 2]
    assert "extra" not in m.to_dict()             # unknown keys go back at the top level, not under "extra"
    odd = RunManifest.from_dict({**raw, "extra": {"a": 1}})      # a key named like the field is one more unknown
    assert odd.extra == {"future_key": [1, 2], "extra": {"a": 1}} and odd.to_dict()["extra"] == {"a": 1}
    given = RunManifest.from_dict({**raw, "monitor_config": {"tau_tail": -0.2}})
    assert given.tau_tail == -0.2
    pre = RunManifest.from_dict({"tau_tail_calibrated": -0.7, "segment_width": 64})   # keys no release wrote
    assert pre.tau_tail is None and pre.extra == {"tau_tail_calibrated": -0.7, "segment_width": 64}
    (tmp_path / "run.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"run.json: expected a JSON object, got list"):
        read_manifest(tmp_path)
    (tmp_path / "run.json").write_text("{")
    with pytest.raises(ValueError, match=r"run.json: not valid JSON"):
        read_manifest(tmp_path)


def test_numpy_float32_nan_in_the_manifest_is_written_as_null(tmp_path):
    """np.float32 is no Python float: its NaN / inf must become null too, not stop the monitor at start."""
    with MismatchMonitor(tmp_path / "r", MonitorConfig(window=2), manifest={"lr": np.float32("nan"),
                                                                           "clip": [np.float32("inf")]}):
        pass
    info = json.loads((tmp_path / "r" / "run.json").read_text())["info"]
    assert info["lr"] is None and info["clip"] == [None]


def test_config_differences_name_keys_set_on_one_side_only():
    """An existing run's manifest against a new writer's configuration: a metric setting only the new one has, an
    identity key only the old run has (a dict) and one only the new writer has, and a dict key whose inner keys
    differ on both sides are all named, as (old, new) with None for the missing side."""
    old = RunManifest(monitor_config={"window": 10, "metrics": {"segment_width": 64}},
                      info={"demo_config": {"steps": 30}, "column_map": {"lp": "learner_logp", "adv": "advantage"}})
    metric, identity = config_differences(
        old, {"window": 10, "metrics": {"segment_width": 64, "heavy_fraction": 0.1}, "record_tokens": False},
        {"model": "qwen", "column_map": {"lp": "learner_logp", "s": "sampler_logp"}})
    assert metric == {"monitor_config.metrics.heavy_fraction": (None, 0.1)}
    assert identity == {"demo_config": ({"steps": 30}, None), "model": (None, "qwen"),
                        "column_map.adv": ("advantage", None), "column_map.s": (None, "sampler_logp")}
    # numpy scalars compare as the JSON values they are written as
    assert config_differences(RunManifest(monitor_config={"window": 10}, info={"seed": 3}), {"window": np.int64(10)},
                              {"seed": np.int64(3)}) == ({}, {})


# ------------------------------------------------------------------ a crafted run.json: checked once, on read
#: (name, change to a good run.json, the field named, the message after "<file>: ") — the issue's four first
CRAFTED = [
    ("monitor_config-list", lambda d: d.update(monitor_config=[1, 2]), "monitor_config",
     "monitor_config must be an object, got an array ([1, 2])"),
    ("calibration-list", lambda d: d.update(calibration=[-0.5]), "calibration",
     "calibration must be null or an object, got an array ([-0.5])"),
    ("window-1e30", lambda d: d["monitor_config"].update(window=1e30), "monitor_config.window",
     "monitor_config.window must be an integer from 1 to 9223372036854775807, got 1e+30"),
    ("schema_version-string", lambda d: d.update(schema_version="3"), "schema_version",
     "schema_version must be an integer from 1 to 9223372036854775807, got a string ('3')"),
    ("schema_version-newer", lambda d: d.update(schema_version=99), "schema_version",
     "schema_version 99 is newer than this triage-monitor reads (4): the run was written by a newer release; "
     "upgrade triage-monitor to read or continue it"),
    ("window-2**63", lambda d: d["monitor_config"].update(window=2 ** 63), "monitor_config.window",
     "monitor_config.window must be an integer from 1 to 9223372036854775807, got 9223372036854775808"),
    ("window-fraction", lambda d: d["monitor_config"].update(window=2.5), "monitor_config.window",
     "monitor_config.window must be an integer from 1 to 9223372036854775807, got 2.5"),
    ("window-bool", lambda d: d["monitor_config"].update(window=True), "monitor_config.window",
     "monitor_config.window must be an integer from 1 to 9223372036854775807, got a boolean (True)"),
    ("tau_tail-string", lambda d: d["monitor_config"].update(tau_tail="x"), "monitor_config.tau_tail",
     "monitor_config.tau_tail must be null or a finite number, got a string ('x')"),
    ("metrics-list", lambda d: d["monitor_config"].update(metrics=[1]), "monitor_config.metrics",
     "monitor_config.metrics must be an object, got an array ([1])"),
    ("metrics-unknown", lambda d: d["monitor_config"]["metrics"].update(width=3), "monitor_config.metrics.width",
     "monitor_config.metrics.width is no metric setting this version knows (known: small_gap_threshold, "
     "segment_width, tail_quantile, heavy_fraction, top_fraction, dilution_threshold)"),
    ("segment_width-0", lambda d: d["monitor_config"]["metrics"].update(segment_width=0),
     "monitor_config.metrics.segment_width",
     "monitor_config.metrics.segment_width must be an integer from 1 to 9223372036854775807, got 0"),
    ("tail_quantile-1", lambda d: d["monitor_config"]["metrics"].update(tail_quantile=1.0), "monitor_config.metrics",
     "monitor_config.metrics: MetricConfig: tail_quantile must lie in (0, 1) and top_fraction in (0, 1], got 1.0, "
     "0.05"),
    ("calibration-tau-string", lambda d: d.update(calibration={"tau_tail": "-1"}), "calibration.tau_tail",
     "calibration.tau_tail must be null or a finite number, got a string ('-1')"),
    ("attempts-string", lambda d: d.update(attempts="x"), "attempts", "attempts must be an array, got a string ('x')"),
    ("attempt-entry-number", lambda d: d.update(attempts=[3]), "attempts[0]",
     "attempts[0] must be an object, got a number (3)"),
    ("attempt-id-string", lambda d: d["attempts"][0].update(attempt="1"), "attempts[0].attempt",
     "attempts[0].attempt must be null or an integer from 0 to 9223372036854775807, got a string ('1')"),
    ("info-list", lambda d: d.update(info=[1]), "info", "info must be an object, got an array ([1])"),
    ("status-number", lambda d: d.update(status=1), "status", "status must be a string, got a number (1)"),
    ("steps_logged-negative", lambda d: d.update(steps_logged=-1), "steps_logged",
     "steps_logged must be null or an integer from 0 to 9223372036854775807, got -1"),
]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """A closed 3-step run (its run.json is what the monitor writes)."""
    import torch

    from triage_monitor.batch import TokenBatch

    d = tmp_path_factory.mktemp("good") / "run"
    g = torch.Generator().manual_seed(0)
    with MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), alerts=False) as mon:
        for s in range(3):
            sp = -torch.rand(4, 16, generator=g) * 3
            mon.log_step(s, TokenBatch.from_padded(sp + 0.1 * torch.randn(4, 16, generator=g).clamp(max=0), sp,
                                                   torch.randn(4, generator=g), torch.ones(4, 16, dtype=torch.bool)))
    return d


def _crafted(good_run, tmp_path, change):
    """A copy of ``good_run`` whose run.json has ``change`` applied."""
    import shutil

    d = tmp_path / "crafted"
    shutil.copytree(good_run, d)
    raw = json.loads((d / "run.json").read_text())
    change(raw)
    (d / "run.json").write_text(json.dumps(raw))
    return d


@pytest.mark.parametrize("name, change, field, message", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_a_crafted_run_json_is_refused_on_read_naming_the_field(good_run, tmp_path, name, change, field, message):
    """Each field this version uses is checked once, when run.json is read: the wrong type or range is a
    ``ManifestError`` (a ValueError) whose message names the file and the field (typed out here), with ``.field``
    and ``.path``; ``open_run`` turns it into a ``RunDirError`` with the same text."""
    from triage_monitor.offline.analysis import RunDirError, open_run
    from triage_monitor.rundir.manifest import ManifestError

    d = _crafted(good_run, tmp_path, change)
    with pytest.raises(ManifestError) as err:
        read_manifest(d)
    assert str(err.value) == f"{d / 'run.json'}: {message}"
    assert err.value.field == field and err.value.path == d / "run.json" and isinstance(err.value, ValueError)
    with pytest.raises(ManifestError) as err:
        RunManifest.from_dict(json.loads((d / "run.json").read_text()))
    assert str(err.value) == message
    with pytest.raises(RunDirError) as err:
        open_run(d)
    assert str(err.value) == f"{d / 'run.json'}: {message}"


def test_the_manifest_a_monitor_writes_reads_back_and_integral_numbers_are_integers(good_run, tmp_path):
    """What a monitor writes passes the checks; a window written as 4.0 (JSON has one number type) reads as 4,
    a null τ_tail and a null calibration are accepted."""
    from triage_monitor.offline.analysis import open_run

    assert read_manifest(good_run).monitor_config["window"] == 2
    d = _crafted(good_run, tmp_path, lambda d: (d["monitor_config"].update(window=4.0, tau_tail=None),
                                                d.update(calibration=None)))
    assert open_run(d).config.window == 4


@pytest.mark.parametrize("cmd", ["analyze", "report", "alerts"])
@pytest.mark.parametrize("name, change, field, message", CRAFTED[:4], ids=[c[0] for c in CRAFTED[:4]])
def test_readers_refuse_a_crafted_run_json_with_exit_2_and_one_line(good_run, tmp_path, capsys, cmd, name, change,
                                                                    field, message):
    """``analyze``, ``report`` and ``alerts`` on the issue's four crafted manifests (before this change: a
    TypeError / AttributeError traceback and exit 1, "a finding"): exit 2 (an input error), one line on stderr
    naming the file and the field, nothing written."""
    from triage_monitor.cli import main

    d = _crafted(good_run, tmp_path, change)
    extra = ["-o", str(tmp_path / "r.html")] if cmd == "report" else []
    assert main([cmd, str(d), *extra]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"triage-monitor {cmd}: error: {d / 'run.json'}: {message}"
    assert "Traceback" not in err and not (tmp_path / "r.html").exists() and not (d / "analysis").exists()


def _table_input(tmp_path):
    """A 2-step per-token Parquet table for ``import table``."""
    import pandas as pd

    path = tmp_path / "tokens.parquet"
    pd.DataFrame({"step": [0, 0, 1, 1], "sample_id": [0, 0, 1, 1], "learner_logp": [-0.5, -1.0, -0.2, -0.3],
                  "sampler_logp": [-0.6, -1.0, -0.25, -0.3], "advantage": [1.0, 1.0, -1.0, -1.0]}).to_parquet(path)
    return path


@pytest.mark.parametrize("name, change, field, message", CRAFTED[:4], ids=[c[0] for c in CRAFTED[:4]])
def test_writers_into_a_crafted_run_raise_run_conflict_error_naming_the_field(good_run, tmp_path, capsys, name,
                                                                              change, field, message):
    """A new writer of a directory whose run.json is crafted (before this change: TypeError / AttributeError /
    ValueError from ``MismatchMonitor`` and ``import --out``, or a silent continuation): ``RunConflictError``
    (an ``OutputError``) naming the field, before anything is written; ``import --out`` exits 2 with that line.
    The run directory is left as it was."""
    from triage_monitor.cli import main
    from triage_monitor.rundir.records import RunConflictError

    d = _crafted(good_run, tmp_path, change)
    before = sorted(p.relative_to(d) for p in d.rglob("*"))
    text = (d / "run.json").read_text()
    want = (f"{d} holds a run whose run.json has an invalid field ({d / 'run.json'}: {message}): write to a new "
            f"directory, or start over with --force / force=True (the old run is moved to crafted.replaced-<time>)")
    for resume in (False, True):
        with pytest.raises(RunConflictError) as err:
            MismatchMonitor(d, MonitorConfig(window=2, calibration_steps=2), resume=resume)
        assert str(err.value) == want and err.value.path == d
    assert main(["import", "table", str(_table_input(tmp_path)), "--out", str(d)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"triage-monitor import: error: {want}"
    assert sorted(p.relative_to(d) for p in d.rglob("*")) == before and (d / "run.json").read_text() == text


@pytest.mark.multiprocess
def test_the_cli_refuses_a_crafted_run_json_in_a_real_process(good_run, tmp_path):
    """The same, as a user runs it: ``python -m triage_monitor`` in a child process, one crafted manifest per
    command; exit status 2 and exactly one line on stderr."""
    import subprocess
    import sys

    cases = [("analyze", 2, []), ("report", 0, ["-o", str(tmp_path / "r.html")]), ("alerts", 1, []),
             ("import", 3, None)]
    for cmd, i, extra in cases:
        name, change, field, message = CRAFTED[i]
        d = _crafted(good_run, tmp_path / cmd, change)
        if cmd == "import":
            argv = ["import", "table", str(_table_input(tmp_path)), "--out", str(d)]
            line = (f"triage-monitor import: error: {d} holds a run whose run.json has an invalid field "
                    f"({d / 'run.json'}: {message}): write to a new directory, or start over with --force / "
                    "force=True (the old run is moved to crafted.replaced-<time>)")
        else:
            argv, line = [cmd, str(d), *extra], f"triage-monitor {cmd}: error: {d / 'run.json'}: {message}"
        r = subprocess.run([sys.executable, "-m", "triage_monitor", *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, (cmd, r.stderr)
        assert r.stderr.strip().splitlines() == [line] or r.stderr.strip().splitlines()[-1] == line, r.stderr
        assert "Traceback" not in r.stderr


def test_a_monitor_refuses_a_configuration_its_run_json_could_not_be_read_back_with(tmp_path):
    """The writer checks its own configuration the way a reader will (so what it writes reads back): a window of
    2.5 steps or above int64, a ``record_tokens`` that is not a boolean are a ``ManifestError`` at construction naming the
    ``MonitorConfig`` field (typed out here), before anything is written."""
    from triage_monitor.rundir.manifest import ManifestError

    for cfg, message in ((MonitorConfig(window=2.5), "MonitorConfig.window must be an integer from 1 to "
                          "9223372036854775807, got 2.5"),
                         (MonitorConfig(calibration_steps=2 ** 63), "MonitorConfig.calibration_steps must be an "
                          "integer from 1 to 9223372036854775807, got 9223372036854775808"),
                         (MonitorConfig(record_tokens="yes"), "MonitorConfig.record_tokens must be a boolean, got a "
                          "string ('yes')")):
        with pytest.raises(ManifestError) as err:
            MismatchMonitor(tmp_path / "run", cfg)
        assert str(err.value) == message
    assert not (tmp_path / "run").exists()
