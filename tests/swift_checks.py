"""Checks of the ms-swift hook against ms-swift's own code; run by tests/test_hooks_ms_swift.py in the side
environments ``.venv-fw/ms-swift-4.6.0`` and ``.venv-fw/ms-swift-4.4.0`` (ms-swift pins trl < 1.0, peft < 0.21 and
datasets < 4.8.5; the main venv holds TRL 1.16).

What runs is ms-swift's real GRPO path on CPU: its ``swift rlhf`` pipeline (``rlhf_main`` with ``RLHFArguments``:
model loading, template, dataset, ``TrainerFactory``), the plugin mechanism (``external_plugins``) that registers the
hook, ms-swift's ``GRPOTrainer`` with its ``TransformersEngine`` rollout (no vLLM: nothing is stubbed), its loss
(``_compute_loss_and_metrics``), metrics and ``log``.  The model is a tiny Llama with a word-level tokenizer built
here (no hub download, ``check_model=False``: no hub query).  The spy trainer below only copies what ms-swift hands
the loss; in the alert run it moves the rollout log-probs 0.5 nats the amplifying way (sampler != learner), as a
low-precision sampler would.  Stood in for: vLLM's version check (below).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("USE_HF", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import swift  # noqa: E402
import swift.rlhf_trainers.rollout_mixin as _rollout_mixin  # noqa: E402
from swift.rlhf_trainers import GRPOTrainer as SwiftGRPOTrainer  # noqa: E402

# The one stand-in: ms-swift turns its rollout importance sampling and its ``rollout_correction/*`` metrics off unless
# ``check_vllm_version_ge('0.10.2')`` (rollout_mixin.py L382-383 in 4.6.0), even when the rollout does not use vLLM.
# vLLM does not install on a CPU; this answers that one question as an installed vLLM 0.10.2+ would.
_vllm_version_ge = _rollout_mixin.check_vllm_version_ge
_rollout_mixin.check_vllm_version_ge = lambda v: v == "0.10.2" or _vllm_version_ge(v)

import recording_tracker  # noqa: E402
from runfiles import shown  # noqa: E402
from triage_monitor.alerting.alert_rules import Rule  # noqa: E402
from triage_monitor.triage.controller import TriageConfig  # noqa: E402
from triage_monitor.hooks import ms_swift as hook_mod  # noqa: E402
from triage_monitor.hooks.trainer_mixin import TrainerLossHook  # noqa: E402
from triage_monitor.hooks.worker_runtime import HookSettings, close_all  # noqa: E402
from triage_monitor.hooks.ms_swift import (LOSS_TYPE_AGG, ROLLOUT_IS_CORRECTIONS, TriageSwiftGRPOTrainer,  # noqa: E402
                                           batch_from_swift, rollout_is_weights)
from triage_monitor.alerting.trackers import CURATED_KEYS  # noqa: E402

WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]
OFF = TriageConfig(gate=False, tis=False, repair=False)
MODES = sorted(ROLLOUT_IS_CORRECTIONS)
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- the job
def make_model_dir(out: Path) -> Path:
    """A tiny Llama (2 layers, d = 32) and an 11-token word-level tokenizer saved as a local model, plus a 16-prompt
    chat dataset."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                             unk_token="<unk>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(t), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    t.save_pretrained(out)
    with open(out / "data.jsonl", "w") as f:
        for i in range(32):
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(WORDS[i % 8:(i % 8) + 3])}]}) + "\n")
    return out


class CountA:
    """Reward: count of ``a`` minus 0.3 per word (ms-swift builds reward classes with ``args=``)."""

    def __init__(self, args=None, **kwargs):
        pass

    def __call__(self, completions, **kwargs):
        return [float(c.split().count("a")) - 0.3 * len(c.split()) for c in completions]


class SpyTrainer(TriageSwiftGRPOTrainer):
    """The hook's trainer, keeping a copy of what ms-swift hands each training loss call and of the result; with
    ``BIAS`` the rollout log-probs are moved BIAS nats up where A < 0 and down where A > 0 before ms-swift's loss
    sees them (δ = learner − sampler then has the sign of A: the amplifying regions)."""

    last = None
    BIAS = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.captured = []
        SpyTrainer.last = self

    def _compute_loss_and_metrics(self, model, model_inputs, grpo_batch):
        if self.model.training and SpyTrainer.BIAS and grpo_batch.rollout_per_token_logps is not None:
            adv = grpo_batch.advantages
            bias = torch.where(adv < 0, SpyTrainer.BIAS, -SpyTrainer.BIAS)   # A<0: sampler above, δ<0; A>0: δ>0
            grpo_batch.rollout_per_token_logps = (grpo_batch.rollout_per_token_logps + bias).clamp(max=-1e-4) \
                * grpo_batch.completion_mask
        saved = (dict(model_inputs), copy.deepcopy(grpo_batch), int(self.state.global_step))
        loss, metrics = super()._compute_loss_and_metrics(model, model_inputs, grpo_batch)
        if self.model.training:
            self.captured.append(saved + (loss.detach(),))
        return loss, metrics


PLUGIN = """
import sys
sys.path.insert(0, {tests!r})
import swift_checks
from swift.rewards import orms
from swift.trainers import TrainerFactory
from triage_monitor.hooks.ms_swift import register
orms["count_a"] = swift_checks.CountA
register(settings=swift_checks.SETTINGS)
TrainerFactory.TRAINER_MAPPING["grpo"] = "swift_checks.SpyTrainer"      # the hook's trainer, spied on
"""

SETTINGS = None


def run_job(tmp: Path, settings: HookSettings, *, bias: float = 0.0, **kw):
    """ms-swift's ``rlhf_main`` (what ``swift rlhf`` runs) with the plugin above; returns the trainer and the log."""
    from swift.arguments import RLHFArguments
    from swift.pipelines.train.rlhf import rlhf_main

    global SETTINGS
    SETTINGS = settings
    SpyTrainer.BIAS = bias
    sys.modules.setdefault("swift_checks", sys.modules[__name__])
    model = tmp / "model"
    if not model.exists():
        model.mkdir(parents=True)
        make_model_dir(model)
    run_job.calls = getattr(run_job, "calls", 0) + 1      # a new file name each run: ms-swift 4.4 caches by name
    plugin = tmp / f"triage_plugin_{run_job.calls}.py"
    plugin.write_text(PLUGIN.format(tests=str(HERE)))
    args = dict(rlhf_type="grpo", model=str(model), model_type="llama", template="default",
                dataset=[str(model / "data.jsonl")], external_plugins=[str(plugin)], reward_funcs=["count_a"],
                use_vllm=False, num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                max_completion_length=10, max_steps=3, learning_rate=5e-3, logging_steps=1, report_to=["none"],
                output_dir=str(tmp / f"out{plugin.stem}"), save_strategy="no", beta=0.0, tuner_type="full",
                torch_dtype="float32", dataset_num_proc=1, split_dataset_ratio=0, temperature=1.0, loss_type="grpo",
                log_rollout_offpolicy_metrics=True, seed=0, check_model=False)
    args.update(kw)
    rlhf_main(RLHFArguments(**args))
    trainer = SpyTrainer.last
    return trainer, [row for row in trainer.state.log_history if "loss" in row]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One monitored run, TRIAGE on (thresholds at the scale of this model's mismatch so that the Gate acts)."""
    tmp = tmp_path_factory.mktemp("swift")
    cfg = TriageConfig(neg_threshold=-0.05, severe_threshold=-0.2, gate_width=4, tis=False)
    settings = HookSettings(run_dir=str(tmp / "run"), triage=cfg, manifest={"test": "ms-swift"})
    trainer, logs = run_job(tmp, settings, bias=0.3, max_steps=4)
    close_all()
    return dict(tmp=tmp, trainer=trainer, logs=logs, run=tmp / "run", cfg=cfg)


# ----------------------------------------------------------------------------- monitoring through the real job
def test_the_release_under_test():
    want = os.environ.get("TRIAGE_SWIFT_RELEASE")
    assert want is None or swift.__version__ == want, (swift.__version__, want)


def test_the_real_job_writes_every_valid_token_once_per_step(job):
    import pandas as pd

    trainer, run = job["trainer"], job["run"]
    steps = pd.read_parquet(run / "steps").sort_values("step")
    tokens = pd.read_parquet(run / "tokens")
    captured = trainer.captured
    assert [c[2] for c in captured] == [0, 1, 2, 3]                      # ms-swift's global_step at each loss call
    assert steps["step"].tolist() == [0, 1, 2, 3]
    for (_, gb, step, _) in captured:
        mask = trainer._loss_mask(gb)
        got = tokens[tokens["step"] == step]
        assert len(got) == int(mask.sum()) > 0                              # every valid token, once
        rows = got.sort_values(["sample_id", "position"])
        want = gb.rollout_per_token_logps[mask]
        assert torch.allclose(torch.tensor(rows["sampler_logp"].to_numpy()).double(), want.double(), atol=1e-6)
        assert torch.allclose(torch.tensor(rows["advantage"].to_numpy()).double(), gb.advantages[mask].double(), atol=1e-6)
        # positions count from each row's first completion token
        first = rows.groupby("sample_id")["position"].min()
        assert (first == 0).all()
        assert (rows["learner_logp"] != rows["sampler_logp"]).all()         # the biased sampler differs
    info = json.loads((run / "run.json").read_text())["info"]
    assert info["framework"] == "ms-swift" and info["framework_version"] == swift.__version__
    assert info["sampler_logp_kind"] == hook_mod.SAMPLER_LOGP_KIND and info["test"] == "ms-swift"
    assert info["swift_loss_type"] == "grpo"


def test_the_step_time_and_the_profiled_methods_are_the_phase_timings(job):
    """ms-swift's own step timer (TRL's training_step: ``step_time``, in the trainer's log) is each row's time/step;
    the methods ms-swift profiles (generation through its engine, scoring the rewards, the old log-probs) and the
    loss forward + backward, timed by the hook, fill their phases inside the step."""
    import math

    import pandas as pd

    steps = pd.read_parquet(job["run"] / "steps").sort_values("step")
    logged = {int(h["step"]) - 1: h["step_time"] for h in job["trainer"].state.log_history if "step_time" in h}
    assert sorted(logged) == steps["step"].astype(int).tolist()
    for _, row in steps.iterrows():
        assert row["time/step"] == pytest.approx(logged[int(row["step"])], rel=1e-12)
        assert row["time/generation"] > 0 and row["time/reward"] > 0 and row["time/update"] > 0
        phases = [row[f"time/{p}"] for p in ("generation", "logprob", "reference", "reward", "update")]
        assert sum(v for v in phases if math.isfinite(v)) <= row["time/step"] * 1.01 + 1e-3
        assert math.isnan(row["time/weight_sync"])                       # no vLLM here


def test_swifts_reward_is_each_rows_reward(job):
    """ms-swift's own ``reward`` (its log: ``_compute_advantages``' mean over the generation batch of the reward
    functions' weighted sum, every process's completions) is each row's ``reward``: the column the report, the
    dashboard and the verdict read; each step its own."""
    import pandas as pd

    steps = pd.read_parquet(job["run"] / "steps").sort_values("step")
    logged = {int(h["step"]) - 1: h["reward"] for h in job["trainer"].state.log_history if "reward" in h}
    assert sorted(logged) == steps["step"].astype(int).tolist() == [0, 1, 2, 3]
    for _, row in steps.iterrows():
        assert row["reward"] == pytest.approx(logged[int(row["step"])], rel=1e-12)
    assert len(set(logged.values())) > 1


def test_swifts_own_mismatch_metrics_are_kept_and_ours_join_its_log_under_triage(job):
    """ms-swift's ``rollout_correction/*`` keep their names and ms-swift's values; ours come under ``triage/``, the
    monitored step before each log row (``triage/metrics_step``).  With one micro-batch per step the two sides
    measure the same tokens: ms-swift's k3_kl, chi2_token and log_ppl_diff equal the steps table's, its ``kl`` is
    −delta_mean."""
    import pandas as pd

    logs = job["logs"]
    steps = pd.read_parquet(job["run"] / "steps").set_index("step")
    assert [row["step"] for row in logs] == [1, 2, 3, 4]
    assert "triage/metrics_step" not in logs[0] or logs[0]["triage/metrics_step"] == 0
    seen = 0
    for row in logs:
        for key in ("rollout_correction/k3_kl", "rollout_correction/chi2_token", "rollout_correction/log_ppl_diff",
                    "rollout_correction/training_ppl", "rollout_correction/rollout_ppl", "clip_ratio/region_mean"):
            assert key in row, (key, sorted(row))
        s = row["step"] - 1                                                 # the update that made global_step N
        assert row["rollout_correction/k3_kl"] == pytest.approx(steps.loc[s, "k3_kl"], rel=1e-4)
        assert row["rollout_correction/chi2_token"] == pytest.approx(steps.loc[s, "chi2_token"], rel=1e-4, abs=1e-6)
        assert row["rollout_correction/log_ppl_diff"] == pytest.approx(steps.loc[s, "log_ppl_diff"], rel=1e-4, abs=1e-6)
        assert row["rollout_correction/kl"] == pytest.approx(-steps.loc[s, "delta_mean"], rel=1e-4, abs=1e-6)
        assert "triage/gate_weight_mean" in row and "triage/repair_loss" in row           # the controller's
        if "triage/metrics_step" in row:
            seen += 1
            m = int(row["triage/metrics_step"])
            assert m == s
            want = shown(steps.loc[m])              # ratios at noise level left out, as on every tracker
            for k in CURATED_KEYS:
                v = want.get(k, math.nan)
                if k not in ("gate_downweighted_frac", "alerts_active") and math.isfinite(v):
                    assert row[f"triage/{k}"] == pytest.approx(v, rel=1e-6), k
    assert seen == len(logs)
    assert not [k for row in logs for k in row if k.startswith("triage/") and k[7:] in ("kl", "k3_kl")]
    assert all(row["triage/gate_downweighted_frac"] > 0 for row in logs)        # the Gate acted


# ----------------------------------------------------------------------------- the loss against ms-swift's own
def _perturbed(gb, seed: int):
    """A copy of a captured batch with a sampler and an old policy that differ from the learner (δ up to ±1 nat,
    ratios up to e^±0.6: the clip and every importance-sampling mode act)."""
    g = torch.Generator().manual_seed(seed)
    gb = copy.deepcopy(gb)
    mask = gb.completion_mask
    noise = lambda s: (torch.rand(mask.shape, generator=g) * 2 - 1) * s     # noqa: E731
    gb.rollout_per_token_logps = ((gb.rollout_per_token_logps + noise(1.0)).clamp(max=-1e-4)) * mask
    return gb, noise


def _losses(trainer, mi, gb, old_noise):
    """ms-swift's own ``_compute_loss_and_metrics`` and the hook's (controller with Gate, TIS, Repair off) on the same
    inputs; returns both losses and both gradients of every parameter."""
    model = trainer.model
    with torch.no_grad():
        live, _ = SwiftGRPOTrainer._get_per_token_logps_and_entropies(trainer, model, dict(mi), gb)
    gb.old_per_token_logps = (live + old_noise).detach()
    out = []
    for own in (True, False):
        model.zero_grad()
        if own:
            loss, _ = SwiftGRPOTrainer._compute_loss_and_metrics(trainer, model, dict(mi), copy.deepcopy(gb))
        else:
            loss, _ = TriageSwiftGRPOTrainer._compute_loss_and_metrics(trainer, model, dict(mi), copy.deepcopy(gb))
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    return out


@pytest.mark.parametrize("mode", [None, *MODES])
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPE_AGG))
def test_triage_off_equals_swifts_own_loss_and_gradients(job, loss_type, mode):
    """With Gate, TIS and Repair off, the hook's loss and every parameter gradient equal ms-swift's own
    ``_compute_loss_and_metrics`` on a real micro-batch of the job (sampler ≠ old ≠ learner), for each loss type and
    each ``rollout_importance_sampling_mode`` (reproduced by our corrections: ROLLOUT_IS_CORRECTIONS); with dual clip
    ``delta`` for grpo."""
    trainer = job["trainer"]
    saved = {k: getattr(trainer, k) for k in ("loss_type", "rollout_importance_sampling_mode",
                                                "rollout_importance_sampling_threshold", "triage_hook")}
    saved_delta = trainer.args.delta
    trainer.triage_hook = TrainerLossHook(HookSettings(triage=OFF))
    trainer.loss_type, trainer.rollout_importance_sampling_mode = loss_type, mode
    trainer.rollout_importance_sampling_threshold = 1.3
    trainer.args.delta = 1.5 if loss_type == "grpo" else None
    try:
        trainer.model.train()
        for i, (mi, gb, _, _) in enumerate(trainer.captured[:2]):
            gb, noise = _perturbed(gb, seed=10 + i)
            old_noise = noise(0.6) * gb.completion_mask
            (ref, ref_g), (ours, ours_g) = _losses(trainer, mi, gb, old_noise)
            assert float(ref) != 0.0
            assert float(ours) == pytest.approx(float(ref), rel=1e-5, abs=1e-7), (loss_type, mode)
            for a, b in zip(ours_g, ref_g):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    finally:
        for k, v in saved.items():
            setattr(trainer, k, v)
        trainer.args.delta = saved_delta


@pytest.mark.parametrize("mode", MODES)
def test_each_rollout_is_mode_is_one_of_our_corrections(job, mode):
    """ms-swift's ``_apply_rollout_importance_sampling`` (its own code) and :func:`rollout_is_weights` (our
    corrections) give the same weights on every valid token, at three thresholds."""
    trainer = job["trainer"]
    saved = (trainer.rollout_importance_sampling_mode, trainer.rollout_importance_sampling_threshold)
    try:
        for mi, gb, _, _ in trainer.captured[:2]:
            gb, noise = _perturbed(gb, seed=3)
            old = (gb.rollout_per_token_logps + noise(0.8)) * gb.completion_mask
            mask = gb.completion_mask
            batch = batch_from_swift(old, gb, mask)
            for thr in (0.9, 1.3, 2.0):
                trainer.rollout_importance_sampling_mode, trainer.rollout_importance_sampling_threshold = mode, thr
                theirs = trainer._apply_rollout_importance_sampling(old - gb.rollout_per_token_logps, mask)
                ours = rollout_is_weights(mode, thr, batch.learner_logp, batch.sampler_logp, batch)
                torch.testing.assert_close(ours, theirs[mask].float(), rtol=1e-6, atol=1e-8)
                assert 0 < float((ours == 0).float().mean() + (ours < 1).float().mean())   # the mode acts here
    finally:
        trainer.rollout_importance_sampling_mode, trainer.rollout_importance_sampling_threshold = saved


def test_options_the_triage_loss_cannot_honour_are_refused(job):
    trainer = job["trainer"]
    hook = trainer.triage_hook
    cases = [("loss_type", "cispo", "loss_type='cispo'"), ("beta", 0.04, "beta=0.04"),
             ("top_entropy_quantile", 0.5, "top_entropy_quantile"), ("importance_sampling_level", "sequence",
                                                                      "importance_sampling_level"),
             ("off_policy_sequence_mask_delta", 0.1, "off_policy_sequence_mask_delta")]
    try:
        for name, value, match in cases:
            old = getattr(trainer, name)
            setattr(trainer, name, value)
            try:
                with pytest.raises(ValueError, match=match):
                    trainer._check_triage()
            finally:
                setattr(trainer, name, old)
        trainer.triage_hook = TrainerLossHook(HookSettings(triage=TriageConfig(tis=True)))
        trainer.rollout_importance_sampling_mode = "token_truncate"
        with pytest.raises(ValueError, match="two importance corrections"):
            trainer._check_triage()
        trainer.triage_hook = TrainerLossHook(HookSettings(triage=TriageConfig(normalization="global_token")))
        trainer.rollout_importance_sampling_mode = None
        with pytest.raises(ValueError, match="global_token"):
            trainer._check_triage()
        trainer.temperature = 0.7
        with pytest.raises(ValueError, match="temperature=0.7"):
            trainer._check_monitoring()
    finally:
        trainer.triage_hook, trainer.temperature, trainer.rollout_importance_sampling_mode = hook, 1.0, None


# ----------------------------------------------------------------------------- alerts, trackers, monitoring only
def test_monitoring_only_keeps_swifts_loss_and_alerts_reach_the_trackers(tmp_path):
    """``register(triage=None, alerts=[rule], loggers=[tracker])``: ms-swift's own loss trains (the loss the trainer
    returned is ms-swift's), a sampler 0.5 nats off in the amplifying direction makes the rule fire once, the tracker
    gets the steps and the alert, and ms-swift's log carries ``triage/alerts_active``."""
    import pandas as pd

    recording_tracker.register()
    rule = Rule(name="rho_asym_above_1", metric="window/rho_asym", condition="above", threshold=1.0, hold=2)
    rec = tmp_path / "rec.jsonl"
    settings = HookSettings(run_dir=str(tmp_path / "run"), alerts=[rule], loggers=[{"kind": "recorder",
                                                                                    "path": str(rec)}])
    trainer, logs = run_job(tmp_path, settings, bias=0.5, max_steps=4, rollout_importance_sampling_mode="token_mask",
                            rollout_importance_sampling_threshold=2.0)
    close_all()
    assert trainer.triage_hook.runtime.controller is None
    mi, gb, _, _ = trainer.captured[0]                                  # the loss that trains is ms-swift's
    gb, noise = _perturbed(gb, seed=5)
    own, _ = SwiftGRPOTrainer._compute_loss_and_metrics(trainer, trainer.model, dict(mi), copy.deepcopy(gb))
    hooked, _ = TriageSwiftGRPOTrainer._compute_loss_and_metrics(trainer, trainer.model, dict(mi), copy.deepcopy(gb))
    assert float(hooked) == float(own) != 0.0
    alerts = pd.read_parquet(tmp_path / "run" / "alerts")
    assert alerts["rule"].tolist() == [rule.name]
    rows = recording_tracker.read(rec)
    assert [r["rule"] for r in rows if r["kind"] == "alert"] == [rule.name]
    assert [r["step"] for r in rows if r["kind"] == "metrics"] == [0, 1, 2, 3]
    fired = int(alerts["step"][0])
    assert any(row.get("triage/alerts_active") == 1.0 and row["triage/metrics_step"] == fired for row in logs)
    assert "rollout_correction/clipped_frac" in logs[0] and "triage/gate_weight_mean" not in logs[0]


def test_the_docs_plugin_registers_the_trainer():
    """The plugin lines of docs/hooks.md#ms-swift, run as written: ms-swift's trainer factory then builds the hook's
    trainer for ``--rlhf_type grpo`` with the settings given."""
    from swift.trainers import TrainerFactory

    text = (HERE.parent / "docs" / "hooks.md").read_text()
    section = text.split("\n## ms-swift\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n# triage_plugin.py\n", 1)[1].split("```", 1)[0]
    saved = TrainerFactory.TRAINER_MAPPING["grpo"]
    try:
        exec(code, {})
        assert TrainerFactory.TRAINER_MAPPING["grpo"] == "triage_monitor.hooks.ms_swift.TriageSwiftGRPOTrainer"
        s = hook_mod._REGISTERED
        assert (s.run_dir, s.alerts, s.framework_keys) == ("/shared/runs/grpo", True, "curated")
        assert s.triage is not None and [t.kind for t in s.loggers] == ["tensorboard", "mlflow"]
    finally:
        TrainerFactory.TRAINER_MAPPING["grpo"] = saved
    with pytest.raises(ValueError, match="register: loggers"):
        hook_mod.register(run_dir="/tmp/x", loggers="nope")
