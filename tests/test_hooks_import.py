"""``triage-monitor import``: slime debug train-data dumps and generic Parquet/JSONL tables become run
directories identical to what a live MismatchMonitor writes for the same tokens."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import torch

from triage_monitor.batch import TokenBatch
from triage_monitor.cli import main
from triage_monitor.monitor import MismatchMonitor, MonitorConfig

METRIC_COLS = ("n_tokens", "delta_mean", "delta_q05", "k3_kl", "mass_amp_neg", "mass_amp_pos", "rho_asym",
               "small_gap_share")


def responses(seed, S=6):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(S):
        L = int(torch.randint(5, 90, (), generator=g))
        sampler = -torch.rand(L, generator=g) * 2 - 1e-3
        learner = (sampler + torch.randn(L, generator=g) * 0.2 - 0.05).clamp(max=-1e-4)
        mask = torch.ones(L, dtype=torch.int32)
        if L > 20:
            mask[10:14] = 0                                   # tool output
        out.append(dict(learner=learner, sampler=sampler, adv=float(torch.randn((), generator=g)), mask=mask))
    return out


def live_run(tmp_path, steps):
    """The reference: the same tokens logged live through MismatchMonitor."""
    with MismatchMonitor(tmp_path / "live", MonitorConfig(calibration_steps=1)) as mon:
        for step, rs in steps.items():
            mon.log_step(step, TokenBatch.from_list([r["learner"] for r in rs], [r["sampler"] for r in rs],
                                                    torch.tensor([r["adv"] for r in rs]),
                                                    [r["mask"].bool() for r in rs]))
    return pd.read_parquet(tmp_path / "live" / "steps"), pd.read_parquet(tmp_path / "live" / "tokens")


def assert_same_run(tmp_path, out_dir, steps, id_offset=0):
    ref_steps, ref_tokens = live_run(tmp_path, steps)
    got_steps, got_tokens = pd.read_parquet(out_dir / "steps"), pd.read_parquet(out_dir / "tokens")
    got_tokens["sample_id"] = got_tokens["sample_id"].astype(int) - id_offset
    key = ["step", "sample_id", "position"]
    cols = ["learner_logp", "sampler_logp", "advantage"]
    a = ref_tokens.sort_values(key).reset_index(drop=True)
    b = got_tokens.sort_values(key).reset_index(drop=True)
    assert len(b) == sum(int(r["mask"].sum()) for rs in steps.values() for r in rs)
    assert (a[key].astype(int).to_numpy() == b[key].astype(int).to_numpy()).all()
    np.testing.assert_array_equal(a[cols].to_numpy(), b[cols].to_numpy())
    ra = ref_steps.sort_values("step").reset_index(drop=True)
    rb = got_steps.sort_values("step").reset_index(drop=True)
    for c in METRIC_COLS:
        np.testing.assert_allclose(ra[c].to_numpy(float), rb[c].to_numpy(float), rtol=0, atol=0, err_msg=c)


def test_import_slime_train_dumps_merges_ranks(tmp_path):
    steps = {0: responses(0), 1: responses(1)}
    dump = tmp_path / "dump"
    dump.mkdir()
    for step, rs in steps.items():
        for rank, part in enumerate((rs[:3], rs[3:])):                     # two data-parallel ranks
            rollout_data = {"log_probs": [r["learner"] for r in part], "rollout_log_probs": [r["sampler"] for r in part],
                            "advantages": [torch.full((len(r["learner"]),), r["adv"]) for r in part],
                            "loss_masks": [r["mask"] for r in part],
                            "response_lengths": [len(r["learner"]) for r in part]}
            torch.save(dict(rollout_id=step, rank=rank, rollout_data=rollout_data), dump / f"train_{step}_{rank}.pt")
    out = tmp_path / "imported"
    assert main(["import", "slime", str(dump / "train_*_*.pt"), "--out", str(out), "--calibration-steps", "1"]) == 0
    assert_same_run(tmp_path, out, steps)
    info = json.loads((out / "run.json").read_text())["info"]
    assert info["framework"] == "slime" and len(info["imported_from"]) == 4


def test_import_slime_rollout_dump_is_refused(tmp_path, capsys):
    p = tmp_path / "rollout_0.pt"
    torch.save(dict(rollout_id=0, samples=[{"rollout_log_probs": [-0.1], "loss_mask": [1]}]), p)
    assert main(["import", "slime", str(p), "--out", str(tmp_path / "o")]) == 2
    assert "no learner log-probs" in capsys.readouterr().err


def long_table(steps, with_mask_rows=True):
    rows = []
    for step, rs in steps.items():
        for i, r in enumerate(rs):
            for t in range(len(r["learner"])):
                if not with_mask_rows and not r["mask"][t]:
                    continue
                rows.append({"it": step, "resp": 100 + i, "pos": t, "lp_train": float(r["learner"][t]),
                             "lp_vllm": float(r["sampler"][t]), "A": r["adv"], "m": int(r["mask"][t])})
    return pd.DataFrame(rows)


def test_import_long_parquet_with_column_mapping(tmp_path):
    steps = {3: responses(2), 4: responses(3)}
    df = long_table(steps).drop(columns=["pos"]).sample(frac=1.0, random_state=0)    # shuffled, no positions
    df = df.sort_values(["it", "resp"], kind="stable")        # row order within a response defines position
    df = pd.concat([g.sort_index() for _, g in df.groupby(["it", "resp"], sort=False)])
    src = tmp_path / "tok.parquet"
    df.to_parquet(src)
    out = tmp_path / "imported"
    rc = main(["import", "table", str(src), "--out", str(out), "--calibration-steps", "1",
               "--map", "step=it", "--map", "sample_id=resp", "--map", "learner_logp=lp_train",
               "--map", "sampler_logp=lp_vllm", "--map", "advantage=A", "--map", "mask=m"])
    assert rc == 0
    got = pd.read_parquet(out / "tokens")
    assert set(got["sample_id"].astype(int)) == {100 + i for i in range(6)}     # the table's own ids are kept
    # masked rows dropped after positions were assigned: tool span 10..13 absent, 14 present
    long_resp = next(i for i, r in enumerate(steps[3]) if len(r["learner"]) > 20)
    pos = set(got[(got["step"] == 3) & (got["sample_id"] == 100 + long_resp)]["position"].astype(int))
    assert not pos & {10, 11, 12, 13} and 14 in pos
    assert_same_run(tmp_path, out, steps, id_offset=100)


def test_import_wide_jsonl_equals_live_run(tmp_path):
    """Agreement test: ``import`` vs a live monitor on the same rows, both use ``MismatchMonitor``;
    independent check: tests/test_monitor.py test_live_metrics_equal_an_independent_computation_from_the_records."""
    steps = {0: responses(4), 1: responses(5)}
    rows = [{"step": s, "sample_id": i, "learner_logp": r["learner"].tolist(), "sampler_logp": r["sampler"].tolist(),
             "advantage": [r["adv"]] * len(r["learner"]), "mask": r["mask"].tolist()}
            for s, rs in steps.items() for i, r in enumerate(rs)]
    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "imported"
    assert main(["import", "table", str(src), "--out", str(out), "--calibration-steps", "1", "--map", "mask=mask"]) == 0
    assert_same_run(tmp_path, out, steps)


def test_import_table_missing_column_is_named(tmp_path, capsys):
    src = tmp_path / "t.parquet"
    pd.DataFrame({"step": [0], "sample_id": [0], "learner_logp": [-0.1], "advantage": [1.0]}).to_parquet(src)
    assert main(["import", "table", str(src), "--out", str(tmp_path / "o")]) == 2
    assert "sampler_logp (column 'sampler_logp')" in capsys.readouterr().err
    assert main(["import", "table", str(tmp_path / "nope.parquet"), "--out", str(tmp_path / "o")]) == 2
    assert "nope.parquet: no such file or directory" in capsys.readouterr().err


def test_import_table_csv_format_help_and_monitor_options(tmp_path, capsys):
    """A CSV gets a message about the formats read (not pyarrow's "magic bytes"); a file that is not
    Parquet is named; --segment-width and --tau-tail reach the run's monitor config."""
    import argparse

    from triage_monitor.offline.analysis import open_run
    from triage_monitor.cli import build_parser

    df = pd.DataFrame({"step": [0] * 4 + [1] * 4, "sample_id": [0, 0, 1, 1] * 2,
                       "learner_logp": [-0.1, -0.3, -0.2, -0.5] * 2, "sampler_logp": [-0.1, -0.2, -0.2, -0.4] * 2,
                       "advantage": [1.0, 1.0, -1.0, -1.0] * 2})
    df.to_csv(tmp_path / "x.csv", index=False)
    assert main(["import", "table", str(tmp_path / "x.csv"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "triage-monitor import: error: " in err and "x.csv" in err and "Parquet" in err
    assert "magic bytes" not in err and not (tmp_path / "o" / "run.json").exists()
    (tmp_path / "fake.parquet").write_text("step,sample_id\n0,0\n")
    assert main(["import", "table", str(tmp_path / "fake.parquet"), "--out", str(tmp_path / "o")]) == 2
    assert "fake.parquet: not readable as parquet" in capsys.readouterr().err
    df.to_parquet(tmp_path / "t.parquet")
    assert main(["import", "table", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "w"),
                 "--segment-width", "8", "--tau-tail", "-0.05"]) == 0
    cfg = open_run(tmp_path / "w").config
    assert cfg.metrics.segment_width == 8 and cfg.tau_tail == -0.05
    # every option of import table has a help text
    table = next(a for a in build_parser("import")._subparsers._group_actions[0].choices["import"]._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["table"]
    assert all(a.help for a in table._actions if a.option_strings and a.dest != "help")


def test_import_table_reads_optional_columns_by_their_own_name(tmp_path, capsys):
    # a column named `mask` is applied without --map (it was silently ignored: masked rows imported)
    src = tmp_path / "t.parquet"
    pd.DataFrame({"step": [0] * 4, "sample_id": [7] * 4, "learner_logp": [-0.1, -0.2, -0.3, -0.4],
                  "sampler_logp": [-0.1] * 4, "advantage": [1.0] * 4, "mask": [0, 1, 1, 0],
                  "group_id": [3] * 4}).to_parquet(src)
    assert main(["import", "table", str(src), "--out", str(tmp_path / "o")]) == 0
    got = pd.read_parquet(tmp_path / "o" / "tokens")
    assert got["position"].tolist() == [1, 2] and got["group_id"].tolist() == [3, 3]
    # an explicitly mapped column that does not exist is an error, not ignored
    assert main(["import", "table", str(src), "--out", str(tmp_path / "o2"), "--map", "group_id=prompt"]) == 2
    assert "group_id (column 'prompt')" in capsys.readouterr().err


def test_import_quarantines_invalid_tokens(tmp_path):
    steps = {0: responses(6)}
    steps[0][0]["learner"][2] = float("nan")
    rows = [{"step": 0, "sample_id": i, "learner_logp": r["learner"].tolist(), "sampler_logp": r["sampler"].tolist(),
             "advantage": [r["adv"]] * len(r["learner"])} for i, r in enumerate(steps[0])]
    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join(json.dumps(r).replace("NaN", "null") for r in rows))
    out = tmp_path / "imported"
    assert main(["import", "table", str(src), "--out", str(out)]) == 0
    st = pd.read_parquet(out / "steps")
    assert int(st["nonfinite_count"].iloc[0]) == 1


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _tokens(steps, **fields):
    """Three token rows per step (one response), with ``fields`` overriding every row's columns."""
    return [{"step": s, "sample_id": 0, "learner_logp": -0.5 - 0.1 * t, "sampler_logp": -0.6, "advantage": 1.0,
             **fields} for s in steps for t in range(3)]


def _cli(*argv, cwd):
    """``python -m triage_monitor ARGV`` in its own process: exit status and stderr's lines."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "triage_monitor", *argv], capture_output=True, text=True, cwd=cwd,
                         timeout=300)
    return out.returncode, [line for line in out.stderr.splitlines() if not line.endswith(" …")]


INTEGERS = "not an integer (steps, sample ids, positions and group ids are integers)"


def test_import_table_refuses_steps_that_are_not_integers(tmp_path, capsys):
    """Steps 0.5, 1.7, 1.2 used to import as "3 step(s)" with exit 0 while the run held 2 (1.7 and 1.2 both
    truncated to 1); true / false were steps 1 and 0.  Now the first row whose step is not an integer is named
    (rows counted from 0: the three rows of step 2.0 come first, so 0.5 is row 3), exit 2, nothing written.  An
    integral float (2.0) is an integer."""
    src = _jsonl(tmp_path / "frac.jsonl", _tokens([2.0, 0.5, 1.7, 1.2]))
    out = tmp_path / "o"
    assert _cli("import", "table", str(src), "--out", str(out), cwd=tmp_path) == (
        2, [f"triage-monitor import: error: {src}: row 3: step (column 'step') = 0.5: {INTEGERS}"])
    assert not out.exists()                  # the refused import wrote nothing, not even the empty --out it probed
    cases = [
        (_tokens([True, False]), "row 0: step (column 'step') = True: a boolean, not an integer"),
        (_tokens([0, 1e30]), "row 3: step (column 'step') = 1e+30: outside int64"),
        (_tokens([0, 1]) + [dict(_tokens([1])[0], step="two")], f"row 6: step (column 'step') = 'two': {INTEGERS}"),
        (_tokens([0]) + [dict(_tokens([1])[0], sample_id=0.5)], f"row 3: sample_id (column 'sample_id') = 0.5: "
                                                                f"{INTEGERS}"),
        (_tokens([0], position=-1), "row 0: position (column 'position') = -1: a position is >= 0 (index inside "
                                    "the response)"),
        (_tokens([0], group_id=False), "row 0: group_id (column 'group_id') = False: a boolean, not an integer"),
        # one boolean or numeric string among integers (JSON parsing would have made them 1 in an int64 column)
        (_tokens([0]) + [dict(_tokens([1])[0], step=True)], "row 3: step (column 'step') = True: a boolean, not "
                                                             "an integer"),
        (_tokens([0]) + [dict(_tokens([1])[0], step="1")], f"row 3: step (column 'step') = '1': {INTEGERS}"),
        (_tokens([0]) + [dict(_tokens([1])[0], sample_id=True)], "row 3: sample_id (column 'sample_id') = True: a "
                                                                  "boolean, not an integer"),
    ]
    for i, (rows, message) in enumerate(cases):
        src = _jsonl(tmp_path / f"c{i}.jsonl", rows)
        assert main(["import", "table", str(src), "--out", str(tmp_path / f"o{i}")]) == 2, message
        assert capsys.readouterr().err.splitlines()[-1] == f"triage-monitor import: error: {src}: {message}"
    # the same in Parquet (float64 steps), and the integral floats import as the steps they are
    pq_src = tmp_path / "frac.parquet"
    pd.DataFrame(_tokens([0.5, 1.7, 1.2])).to_parquet(pq_src)
    assert main(["import", "table", str(pq_src), "--out", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"triage-monitor import: error: {pq_src}: row 0: step "
                                                         f"(column 'step') = 0.5: {INTEGERS}")
    ok = _jsonl(tmp_path / "ok.jsonl", _tokens([2.0, 0.0, 1.0]))
    assert main(["import", "table", str(ok), "--out", str(tmp_path / "ok")]) == 0
    assert "imported 3 step(s)" in capsys.readouterr().out
    assert sorted(set(pd.read_parquet(tmp_path / "ok" / "steps")["step"])) == [0, 1, 2]


def test_import_table_masks_must_be_zero_one_or_boolean(tmp_path, capsys):
    """Masks −1 and 0.0001 used to count as valid tokens and "no" gave "could not convert string to float: 'no'"
    naming no field or file: each is refused naming the file, the row, the field, its column and the value.  A
    null sample_id is named as such (it was reported as a bad position).  0 / 1 and booleans drop and keep rows as
    before."""
    mapped = ("--map", "mask=loss_mask", "--map", "sample_id=resp")
    rows = [{"step": 0, "resp": 4, "learner_logp": -0.1 * (t + 1), "sampler_logp": -0.2, "advantage": 1.0,
             "loss_mask": 1} for t in range(4)]
    src = _jsonl(tmp_path / "no.jsonl", rows[:2] + [dict(rows[2], loss_mask="no"), rows[3]])
    assert _cli("import", "table", str(src), "--out", str(tmp_path / "o"), *mapped, cwd=tmp_path) == (
        2, [f"triage-monitor import: error: {src}: row 2: mask (column 'loss_mask') = 'no': a mask is 0 / 1 or a "
            "boolean"])
    for i, (bad, shown) in enumerate(((-1, "-1"), (0.0001, "0.0001"), (None, None), (2, "2"))):
        src = _jsonl(tmp_path / f"m{i}.jsonl", rows[:3] + [dict(rows[3], loss_mask=bad)])
        assert main(["import", "table", str(src), "--out", str(tmp_path / f"m{i}"), *mapped]) == 2
        what = "is null" if shown is None else f"= {shown}"
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"triage-monitor import: error: {src}: row 3: mask (column 'loss_mask') {what}: a mask is 0 / 1 or a "
            "boolean")
    src = _jsonl(tmp_path / "sid.jsonl", rows[:2] + [dict(rows[2], resp=None), rows[3]])
    assert main(["import", "table", str(src), "--out", str(tmp_path / "s"), *mapped]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"triage-monitor import: error: {src}: row 2: sample_id (column 'resp') is null: {INTEGERS}")
    for i, keep in enumerate(([True, False, True, True], [1.0, 0.0, 1.0, 1.0])):
        src = _jsonl(tmp_path / f"k{i}.jsonl", [dict(r, loss_mask=k) for r, k in zip(rows, keep)])
        assert main(["import", "table", str(src), "--out", str(tmp_path / f"k{i}"), *mapped]) == 0
        got = pd.read_parquet(tmp_path / f"k{i}" / "tokens")
        assert got["position"].tolist() == [0, 2, 3]              # position 1 masked out after positions were given
    capsys.readouterr()


def test_import_wide_table_names_the_row_of_a_bad_list_value(tmp_path, capsys):
    """In a wide table (one row per response, list-valued columns) the row named is the table's own row; a string
    among the log-probs is named too (it used to be "could not convert string to float")."""
    rows = [{"step": 0, "sample_id": i, "learner_logp": [-0.1, -0.2], "sampler_logp": [-0.1, -0.3],
             "advantage": [1.0, 1.0], "position": [0, 1], "mask": [1, 1]} for i in range(3)]
    src = _jsonl(tmp_path / "w.jsonl", rows[:2] + [dict(rows[2], mask=[1, 0.5])])
    assert main(["import", "table", str(src), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"triage-monitor import: error: {src}: row 2: mask (column 'mask') = 0.5: a mask is 0 / 1 or a boolean")
    src = _jsonl(tmp_path / "p.jsonl", [dict(rows[0], position=[0, 1.5])] + rows[1:])
    assert main(["import", "table", str(src), "--out", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"triage-monitor import: error: {src}: row 0: position (column 'position') = 1.5: {INTEGERS}")
    src = _jsonl(tmp_path / "s.jsonl", rows[:1] + [dict(rows[1], learner_logp=[-0.1, "x"])] + rows[2:])
    assert main(["import", "table", str(src), "--out", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"triage-monitor import: error: {src}: row 1: learner_logp (column 'learner_logp') = 'x': not a number")
