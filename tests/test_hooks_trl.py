"""A real TRL GRPOTrainer run (CPU, tiny local model and tokenizer, no hub download) with the hook attached.

Checks the run directory the MismatchMonitor wrote: token rows (sampler log-probs recorded from
KV-cached generation vs the learner's teacher-forced recomputation), step metrics and Gate weights;
and that the TRIAGE loss through TRL equals the core API on the same tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pd = pytest.importorskip("pandas")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from triage_monitor.controller import TriageConfig, TriageController, weighted_policy_loss  # noqa: E402
from triage_monitor.corrections import ppo_clip_loss  # noqa: E402
from triage_monitor.hooks.trl import TriageGRPOTrainer  # noqa: E402
from triage_monitor.monitor import MismatchMonitor, MonitorConfig  # noqa: E402

WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]


def tiny_tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def tiny_model(vocab_size: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return transformers.LlamaForCausalLM(cfg)


def reward_count_a(completions, **kwargs):
    return [float(c.split().count("a")) - 0.3 * len(c.split()) for c in completions]


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl")
    tok = tiny_tokenizer()
    ds = datasets.Dataset.from_dict({"prompt": [" ".join(WORDS[i % 8:(i % 8) + 3]) for i in range(16)]})
    args = trl.GRPOConfig(output_dir=str(tmp / "out"), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=12, max_steps=3, learning_rate=5e-3, logging_steps=1,
                          report_to="none", use_cpu=True, beta=0.0, save_strategy="no", seed=0,
                          gradient_accumulation_steps=2, temperature=1.0)
    run_dir = tmp / "run"
    mon = MismatchMonitor(run_dir, MonitorConfig(calibration_steps=1), manifest={"test": "trl"})
    # the two paths differ by ~1e-4 nats here (fp32 CPU): thresholds at that scale make the Gate fire
    ctrl = TriageController(TriageConfig(neg_threshold=-1e-6, severe_threshold=-2e-6, delta_bad=-5e-5))
    trainer = TriageGRPOTrainer(model=tiny_model(len(tok)), reward_funcs=reward_count_a, args=args,
                                train_dataset=ds, processing_class=tok, triage_monitor=mon, triage_controller=ctrl)
    captured = []
    orig = trainer._compute_loss

    def spy(model, inputs):
        loss = orig(model, inputs)
        captured.append((inputs, trainer.triage_last, loss.detach()))
        return loss

    trainer._compute_loss = spy
    trainer.train()
    mon.close()
    return dict(run_dir=run_dir, trainer=trainer, captured=captured, ctrl_cfg=ctrl.config)


def test_run_directory_tokens_metrics_and_gate(trl_run):
    run_dir = trl_run["run_dir"]
    tokens = pd.read_parquet(run_dir / "tokens")
    steps = pd.read_parquet(run_dir / "steps")
    assert sorted(steps["step"].astype(int).unique()) == [0, 1, 2]             # one row per optimizer step
    assert sorted(tokens["step"].astype(int).unique()) == [0, 1, 2]
    # sampler log-probs come from KV-cached generation, learner from teacher forcing: both real log-probs,
    # close (same weights, fp32) but computed independently
    assert (tokens["sampler_logp"] <= 0).all() and (tokens["learner_logp"] <= 0).all()
    assert tokens["sampler_logp"].abs().max() < 1e3 and tokens["learner_logp"].abs().max() < 1e3
    delta = tokens["learner_logp"] - tokens["sampler_logp"]
    assert delta.abs().max() < 1e-3
    # ... and they are two computations: incremental KV-cached decoding and a full-sequence forward round
    # differently (~1e-4 nats on CPU fp32).  Recording the recomputed values by mistake would make δ ≡ 0.
    assert (delta != 0).any()
    # each step holds the 8 completions of its 2 micro-batches, positions from 0 within each response
    for s, g in tokens.groupby("step"):
        assert g["sample_id"].nunique() == 8
        assert (g.groupby("sample_id")["position"].min() == 0).all()
    # Gate weights recorded per token, in (0, 1]; the low thresholds make the Gate fire on A<0 δ<0 tokens
    assert "gate_weight" in tokens.columns
    gw = tokens["gate_weight"]
    assert ((gw > 0) & (gw <= 1)).all()
    fired = tokens[gw < 1]
    assert len(fired) > 0 and (fired["advantage"] < 0).all() and (fired["learner_logp"] < fired["sampler_logp"]).all()
    # metrics of each step recomputed from its token rows by an independent formula
    for s, g in tokens.groupby("step"):
        row = steps[steps["step"] == s].iloc[0]
        d = g["learner_logp"] - g["sampler_logp"]
        assert math.isclose(row["delta_mean"], d.mean(), rel_tol=1e-5, abs_tol=1e-9)
        amp_neg = g["advantage"][(g["advantage"] < 0) & (d < 0)].abs().sum()
        assert math.isclose(row["mass_amp_neg"], amp_neg, rel_tol=1e-5, abs_tol=1e-9)
        assert 0 <= row["gate_weight_mean"] <= 1


def test_trl_loss_equals_core_api(trl_run):
    """Same tensors through the core API (independently flattened) give the same weights, repair and loss."""
    trainer, captured, cfg = trl_run["trainer"], trl_run["captured"], trl_run["ctrl_cfg"]
    assert len(captured) == 6                                                   # 3 steps × 2 micro-batches
    inputs, res, loss = captured[-1]
    mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
    sampler = inputs["sampling_per_token_logps"][mask]
    learner = res.batch.learner_logp.detach()
    assert torch.equal(sampler, res.batch.sampler_logp)
    adv = inputs["advantages"].unsqueeze(1).expand_as(mask)[mask]
    assert torch.equal(adv, res.batch.advantage)
    out = TriageController(cfg)(res.batch.detach(), step=2)
    assert torch.equal(out.gate_weights, res.output.gate_weights)
    assert torch.allclose(out.repair_loss, res.output.repair_loss.detach(), rtol=0, atol=0)
    ptl = ppo_clip_loss(learner, learner, adv, trainer.epsilon_low, trainer.epsilon_high)
    expected = weighted_policy_loss(ptl, out.token_weights, res.batch, "per_response") + out.repair_loss
    assert torch.allclose(loss * trainer.args.gradient_accumulation_steps, expected, atol=1e-6)


def test_manifest_says_which_sampler_logps(trl_run):
    import json
    info = json.loads((trl_run["run_dir"] / "run.json").read_text())["info"]
    assert info["framework"] == "trl" and "KV-cache" in info["sampler_logp_kind"]


def test_monitor_only_keeps_trl_loss(tmp_path):
    """Without a controller the trainer keeps TRL's own loss and still records every step's tokens."""
    tok = tiny_tokenizer()
    ds = datasets.Dataset.from_dict({"prompt": [" ".join(WORDS[i % 8:(i % 8) + 2]) for i in range(8)]})
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, max_steps=2, learning_rate=1e-3, report_to="none", use_cpu=True,
                          beta=0.0, save_strategy="no", seed=1, logging_steps=1)
    with MismatchMonitor(tmp_path / "run", MonitorConfig()) as mon:
        trainer = TriageGRPOTrainer(model=tiny_model(len(tok)), reward_funcs=reward_count_a, args=args,
                                    train_dataset=ds, processing_class=tok, triage_monitor=mon)
        trainer.train()
    tokens = pd.read_parquet(tmp_path / "run" / "tokens")
    assert sorted(tokens["step"].astype(int).unique()) == [0, 1]
    assert "gate_weight" not in tokens.columns
    assert (tokens["learner_logp"] - tokens["sampler_logp"]).abs().max() < 1e-3
    assert not any(k.startswith("triage/") for k in trainer._metrics["train"])
