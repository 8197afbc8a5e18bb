"""The run's manifest (triage_monitor.manifest): standard JSON, unknown keys kept, read errors naming the file,
how a new writer's configuration differs from the run's."""

import json
import math

import numpy as np
import pytest

from triage_monitor.manifest import RunManifest, config_differences, read_manifest, write_json_atomic
from triage_monitor.monitor import MismatchMonitor, MonitorConfig


def test_manifest_json_is_standard_json_with_nan_as_null(tmp_path):
    obj = {"a": math.nan, "b": [1.5, math.inf, (2.0, -math.inf)], "c": {"d": math.nan, "e": "x"},
           "f": np.int64(3), "g": np.float64(0.25), "h": tmp_path, "i": np.float32(0.5), "j": {3}}
    write_json_atomic(obj, tmp_path / "m.json")
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
