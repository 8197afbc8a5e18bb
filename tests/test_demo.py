"""The demo GRPO job: task by hand, sampler/learner path agreement, a short real run read back with plain tools."""

import argparse
import json
import math

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
import torch

pytest.importorskip("torchao")

from triage_monitor.offline.analysis import open_run  # noqa: E402
from triage_monitor.demo import DemoConfig, add_arguments, config_from_args, run_demo  # noqa: E402
from triage_monitor.demo.grpo import generate, group_advantages, teacher_forced_logp  # noqa: E402
from triage_monitor.demo.model import GPTConfig, TinyGPT  # noqa: E402
from triage_monitor.demo.task import EOS, VOCAB_SIZE, AdditionTask  # noqa: E402
from triage_monitor.demo.nvfp4 import get_recipe, use_recipe  # noqa: E402

pytestmark = pytest.mark.slow

# the addition task (4-token answers) keeps these tests fast; the study's walk job has tests of its own
SMALL = dict(task="addition", digits=2, quantize="mlp", sampler_lag=0, gate_width=4, repair_width=8, segment_width=4,
             gate_thresholds="fixed", lr=3e-4, sft_target=0.3, sft_lr=3e-3, steps=4, sft_steps=30, prompts_per_step=4,
             group_size=4, eval_size=16, eval_every=1, log_every=1, calibration_steps=2, window=3)


def test_task_by_hand():
    task = AdditionTask(2)
    ops = torch.tensor([[47, 85], [0, 0], [99, 99], [5, 4]])
    _, prompts = task.sample(1, torch.Generator().manual_seed(0))
    assert prompts.shape == (1, 7)
    answers, length = task.answers(ops)
    assert [task.render(a) for a in answers] == ["231$", "0$$$", "891$", "9$$$"]
    assert length.tolist() == [4, 2, 4, 2]
    responses = torch.tensor([[2, 3, 1, EOS, 7], [0, EOS, 5, 5, 5], [8, 9, 1, 1, EOS], [9, 0, EOS, EOS, EOS]])
    # right; right (junk after EOS ignored); extra digit; extra zero
    assert task.reward(responses, ops).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert task.reward(responses[:, :1], ops).tolist() == [0.0, 0.0, 0.0, 0.0]  # no EOS at all


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4)
    # group 1: mean 0.25, unbiased std 0.5 → (0.75 / 0.5, -0.25 / 0.5); group 2: all equal → 0
    assert torch.allclose(a, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]), atol=1e-5)


def test_kv_cache_sampler_matches_teacher_forced_learner():
    torch.manual_seed(0)
    task = AdditionTask(2)
    model = TinyGPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=task.prompt_len + task.max_answer_len)).eval()
    _, prompts = task.sample(3, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    with use_recipe(model, None):
        resp, s_logp, mask = generate(model, prompts, 4, task.max_answer_len, 1.0, g)
        with torch.no_grad():
            l_logp = teacher_forced_logp(model, prompts.repeat_interleave(4, 0), resp)
    assert model.quantized == ["blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj"]
    assert resp.shape == s_logp.shape == mask.shape == (12, task.max_answer_len)
    # same recipe: incremental decoding and teacher forcing give the same log-probs
    assert torch.allclose(l_logp[mask], s_logp[mask], atol=1e-5)
    # mask runs up to and including the first EOS
    first_eos = torch.where(resp == EOS, torch.arange(resp.shape[1]), resp.shape[1]).min(1).values
    assert torch.equal(mask.sum(1), (first_eos + 1).clamp(max=resp.shape[1]))
    # NVFP4 sampler vs fp32 learner: a real, non-zero gap
    with use_recipe(model, get_recipe("nvfp4")):
        resp, s_logp, mask = generate(model, prompts, 4, task.max_answer_len, 1.0, g)
    with torch.no_grad():
        l_logp = teacher_forced_logp(model, prompts.repeat_interleave(4, 0), resp)
    delta = (l_logp - s_logp)[mask]
    assert delta.abs().max() > 1e-4


def test_arguments_round_trip():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--steps", "7", "--correction", "tis", "--tis-clip", "0", "3", "--learner-recipe",
                         "nvfp4_16x16", "--lr", "1e-4"])
    cfg = config_from_args(args)
    assert (cfg.steps, cfg.correction, cfg.tis_clip, cfg.learner_recipe, cfg.lr) == \
        (7, "tis", (0.0, 3.0), "nvfp4_16x16", 1e-4)
    assert config_from_args(p.parse_args([])) == DemoConfig()
    with pytest.raises(SystemExit):
        p.parse_args(["--correction", "icepop"])
    with pytest.raises(ValueError, match="group_size"):
        DemoConfig(group_size=1)
    with pytest.raises(ValueError, match="unknown numeric recipe"):
        DemoConfig(sampler_recipe="int4")


def _comparable(df: pd.DataFrame) -> pd.DataFrame:
    """The run's values without its wall-clock times (``seconds`` and the phase timings ``time/<phase>``)."""
    return df.drop(columns=[c for c in df.columns if c == "seconds" or c.startswith("time/")])


@pytest.mark.parametrize("correction", ["triage"])
def test_short_run_reads_back_and_is_reproducible(tmp_path, correction):
    cfg = DemoConfig(correction=correction, **SMALL)
    df1 = run_demo(cfg, tmp_path / "a", quiet=True)
    df2 = run_demo(cfg, tmp_path / "b", quiet=True)
    assert len(df1) == cfg.steps and df1["step"].tolist() == list(range(cfg.steps))
    pd.testing.assert_frame_equal(_comparable(df1), _comparable(df2))
    df3 = run_demo(DemoConfig(**{**SMALL, "seed": 1}), tmp_path / "c", quiet=True)
    assert not np.allclose(df1["delta_abs_mean"], df3["delta_abs_mean"])

    run = tmp_path / "a"
    manifest = json.loads((run / "run.json").read_text())
    info = manifest["info"]
    assert (info["sampler_recipe"], info["learner_recipe"], info["correction"]) == ("nvfp4", "fp32", correction)
    assert info["demo_config"]["steps"] == cfg.steps and open_run(run).config.metrics.segment_width == cfg.segment_width

    steps = pd.read_parquet(run / "steps")
    steps = steps.sort_values("step").reset_index(drop=True)
    assert steps["step"].astype(int).tolist() == list(range(cfg.steps))
    # the demo's own phase timings (docs/metrics.md#step-time-and-the-full-cycle): every phase it has is timed on
    # every step, inside the step; the run says where they were measured (CPU figures)
    timed = ["time/generation", "time/quantize", "time/weight_sync", "time/reward", "time/logprob", "time/update",
             "time/other"]
    assert steps[timed + ["time/step"]].notna().all().all() and steps["time/reference"].isna().all()
    assert (steps["time/generation"] > 0).all() and (steps["time/update"] > 0).all()
    assert (steps[timed].sum(axis=1) <= steps["time/step"] * (1 + 1e-9)).all()
    assert steps["time/step"].tolist() == steps["seconds"].tolist()
    assert info["device"] == "cpu"
    for col in ("reward", "rho_asym", "small_gap_share", "gate_weight_mean", "repair_loss"):
        np.testing.assert_allclose(steps[col].to_numpy(float), df1[col].to_numpy(float), equal_nan=True)

    tokens = ds.dataset(run / "tokens", format="parquet", partitioning="hive").to_table().to_pandas()
    B = cfg.prompts_per_step * cfg.group_size
    assert set(tokens["step"].astype(int)) == set(range(cfg.steps))
    assert (tokens["learner_logp"] <= 0).all() and (tokens["sampler_logp"] <= 0).all()
    for step, tok in tokens.groupby("step"):
        assert tok["sample_id"].nunique() == B
        # positions of each response are 0..n-1; one advantage per response; G responses per group
        per = tok.groupby("sample_id")
        assert (per["position"].min() == 0).all() and (per["position"].max() + 1 == per.size()).all()
        assert (per["advantage"].nunique() == 1).all()
        assert (tok.groupby("group_id")["sample_id"].nunique() == cfg.group_size).all()
        # the per-step metric recomputed by hand from the rows
        delta = tok["learner_logp"] - tok["sampler_logp"]
        row = df1[df1["step"] == int(step)].iloc[0]
        assert math.isclose(row["small_gap_share"], float((delta.abs() < 0.05).mean()), rel_tol=1e-5)
        assert (delta.abs() > 0).any()


@pytest.mark.parametrize("correction,learner", [("none", "nvfp4_16x16"), ("tis", "fp32")])
def test_corrections_apply_their_weights(tmp_path, correction, learner):
    cfg = DemoConfig(**{**SMALL, "steps": 2, "sft_steps": 0, "correction": correction, "learner_recipe": learner,
                        "tis_clip": (0.0, 1.001)})
    df = run_demo(cfg, tmp_path, quiet=True)
    assert (df["gate_weight_mean"] == 1.0).all() and (df["repair_loss"] == 0.0).all()
    assert np.isfinite(df["loss"]).all()
    tokens = ds.dataset(tmp_path / "tokens", format="parquet", partitioning="hive").to_table().to_pandas()
    ratio = np.exp(tokens["learner_logp"].to_numpy(np.float64) - tokens["sampler_logp"].to_numpy(np.float64))
    want = np.ones_like(ratio) if correction == "none" else np.clip(ratio, 0.0, 1.001)
    np.testing.assert_allclose(tokens["token_weight"], want, rtol=1e-5)
    # the TIS clip share is reported for every correction, recomputed here from the rows
    for step, tok in tokens.assign(ratio=ratio).groupby("step"):
        row = df[df["step"] == int(step)].iloc[0]
        assert math.isclose(row["tis_clip_frac"], float((tok["ratio"] > 1.001).mean()), abs_tol=1e-6)


def test_without_torchao_the_native_backend_gives_the_same_run(tmp_path, monkeypatch):
    import importlib.util

    cfg = DemoConfig(**{**SMALL, "steps": 2, "sft_steps": 0})
    ref = run_demo(cfg, tmp_path / "torchao", quiet=True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    df = run_demo(cfg, tmp_path / "native", quiet=True)
    info = json.loads((tmp_path / "native" / "run.json").read_text())["info"]
    assert info["recipes"]["sampler"]["backend"] == "native"
    pd.testing.assert_frame_equal(_comparable(df), _comparable(ref))
