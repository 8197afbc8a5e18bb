"""Each framework's knowledge that the core reads by name, beside the framework's hook: its timer names and its dumps.

* :data:`FRAMEWORKS` — ``{framework: FrameworkTimers}``: the timer names as the framework logs them → phase (one of
  :data:`triage_monitor.metrics.timings.PHASES`, ``"step"``, or None: recognised, no phase of its own), how a name
  it hands over becomes a key of its table (``key``), and whether that needs the framework named
  (``needs_framework``).  The core reads it through :func:`triage_monitor.metrics.timings.frameworks` (this module
  imported by name on first use), so any framework's names are recognised without its hook imported
  (docs/hooks.md#phase-timings).
* :data:`DUMP_READERS` — the framework sources of ``triage-monitor import``: the sub-command's help text and the
  reader, a :class:`triage_monitor.offline.importers.StepReader` named ``"module:function"`` (imported when the
  command runs).

Adding a framework: its hook module in ``hooks/`` and its entries here; no core module changes.
Torch-free: imports :mod:`triage_monitor.metrics.timings` only.
"""

from __future__ import annotations

from typing import Dict, NamedTuple

from triage_monitor.metrics.timings import FrameworkTimers

# A framework's timer name → phase; None: recognised but not a phase of its own (a span that contains other
# timers, or one outside the step).  Names as the framework logs them (docs/hooks.md#phase-timings).
_VERL = {f"timing_s/{k}": v for k, v in {  # verl 0.9.1 (trainer/ppo/v1, ray_trainer, experimental async trainers):
    # timing_raw[<key>], logged by compute_timing_metrics as timing_s/<key>
    "gen": "generation", "generate_async": "generation", "switch_wait": "generation",
    "wait_for_enough_samples": "generation", "reward": "reward", "old_log_prob": "logprob", "ref": "reference",
    "values": "other", "adv": "reward", "update_critic": "update", "update_actor": "update",
    "update_weights": "weight_sync", "param_sync": "weight_sync", "sync_rollout_weights": "weight_sync",
    "switch_to_trainer": "other", "switch_to_rollout": "other", "save_checkpoint": "other",
    "start_profile": "other", "stop_profile": "other", "step": "step",
    "testing": None, "dump_rollout_generations": None,
}.items()}
_TRL = {  # TRL 1.13 / 1.16: profiling_context spans (logged as "profiling/Time taken: <Trainer>.<span>"), step_time
    "transformers.generate": "generation", "vLLM.generate": "generation", "transformers.generate_batch": "generation",
    "sync_weights": "weight_sync", "_calculate_rewards": "reward", "step_time": "step",
    "_prepare_inputs": None, "_get_per_token_logps_and_entropies": None, "compute_loss": None,
}
_OPENRLHF = {  # OpenRLHF 0.11.2 (trainer/ppo_trainer.py, ppo_trainer_async.py): status["timing/<name>"]
    "timing/generation": "generation", "timing/make_experience": "logprob", "timing/ppo_train": "update",
    "timing/broadcast": "weight_sync", "timing/step_total": "step",
}
_SKYRL = {  # SkyRL 0.3.0 (train/trainer.py, fully_async_trainer.py): all_timings logged as timing/<name>
    "timing/generate": "generation", "timing/wait_for_generation_buffer": "generation",
    "timing/postprocess_generator_output": "reward", "timing/convert_to_training_input": "other",
    "timing/fwd_logprobs_values_reward": "logprob", "timing/apply_reward_kl_penalty": "reward",
    "timing/compute_advantages_and_returns": "reward", "timing/train_critic_and_policy": "update",
    "timing/sync_weights": "weight_sync", "timing/save_checkpoints": "other", "timing/save_hf_model": "other",
    "timing/update_ref_with_policy": "other", "timing/step": "step",
    "timing/policy_train": None, "timing/critic_train": None, "timing/run_training": None, "timing/eval": None,
    "timing/cleanup_old_checkpoints": None,
}
_NEMO_RL = {  # NeMo RL 7ea279ab (algorithms/grpo.py): Timer → timing/train/<name>
    "timing/train/generation": "generation", "timing/train/exposed_generation": "generation",
    "timing/train/idle/buffer_starvation": "generation", "timing/train/prepare_for_generation/total": "weight_sync",
    "timing/train/weight_sync": "weight_sync", "timing/train/offload_before_refit": "weight_sync",
    "timing/train/reward_calculation": "reward", "timing/train/advantage_calculation": "reward",
    "timing/train/logprob_inference_prep": "logprob", "timing/train/policy_and_reference_logprobs": "logprob",
    "timing/train/training_prep": "update", "timing/train/policy_training": "update",
    "timing/train/recompute_kv_scales": "quantize", "timing/train/data_processing": "other",
    "timing/train/dynamic_sampling": "other", "timing/train/checkpointing": "other",
    "timing/train/total_step_time": "step",
    "timing/train/prepare_for_generation/transfer_and_update_weights": None, "timing/train/idle/refit_bubble": None,
    "timing/train/overlong_filter": None, "timing/train/mask_sample_filter": None, "timing/train/idle/validation": None,
}
_PRIME_RL = {  # prime-rl 559b4477 (src/prime_rl/trainer/rl/train.py): the trainer's time/<name>
    "time/wait_for_batch": "generation", "time/load_data": "other", "time/forward_backward": "update",
    "time/broadcast_weights": "weight_sync", "time/save_ckpt": "other", "time/step": "step",
}
_SLIME = {  # slime 624b824a: the training actor's Timer (observability/train_metric_utils.py log_perf_data) and
    # the rollout manager's rollout_time (observability/rollout_metrics.py), logged as perf/<name>
    "perf/rollout_time": "generation", "perf/log_probs_time": "logprob", "perf/ref_log_probs_time": "reference",
    "perf/data_preprocess_time": "other", "perf/actor_train_time": "update", "perf/update_weights_time": "weight_sync",
    "perf/ref_model_update_time": "other", "perf/wake_up_time": "other", "perf/sleep_time": "other",
    "perf/save_model_time": "other", "perf/step_time": "step",
    "perf/train_time": None, "perf/train_wait_time": None, "perf/teacher_log_probs_time": "other",
}


def _verl_key(name: str) -> str:
    """verl's in-process ``timing_raw`` key (``gen``) → its logged name ``timing_s/gen``; every other name as given
    (a bare name only where ``framework="verl"`` is said: ``gen`` alone is too common a word)."""
    if not name.startswith("timing_s/") and f"timing_s/{name}" in _VERL:
        return f"timing_s/{name}"
    return name


_TRL_PREFIX = "profiling/Time taken: "


def _trl_key(name: str) -> str:
    """TRL's logged ``profiling/Time taken: GRPOTrainer.vLLM.generate`` → its span ``vLLM.generate`` (the trainer's
    class name dropped); every other name as given."""
    if name.startswith(_TRL_PREFIX):
        span = name[len(_TRL_PREFIX):]
        return span.split(".", 1)[1] if "." in span else span
    return name


#: ``{framework: FrameworkTimers}``, the tables above.  TRL's names are its ``profiling_context`` span names (logged
#: as ``profiling/Time taken: <Trainer>.<span>``, :func:`_trl_key`) and its ``step_time``; verl's bare
#: ``timing_raw`` keys count only where ``framework="verl"`` is said (:func:`_verl_key`).
FRAMEWORKS: Dict[str, FrameworkTimers] = {
    "verl": FrameworkTimers("verl", _VERL, key=_verl_key, needs_framework=True),
    "trl": FrameworkTimers("trl", _TRL, key=_trl_key),
    "openrlhf": FrameworkTimers("openrlhf", _OPENRLHF),
    "skyrl": FrameworkTimers("skyrl", _SKYRL),
    "nemo_rl": FrameworkTimers("nemo_rl", _NEMO_RL),
    "prime_rl": FrameworkTimers("prime_rl", _PRIME_RL),
    "slime": FrameworkTimers("slime", _SLIME),
}


class DumpReader(NamedTuple):
    """A framework source of ``triage-monitor import <source> FILES...``.

    Fields:
        help: the sub-command's help line.
        paths_help: the help of its ``FILES`` argument.
        target: the reader as ``"module:function"``, a :class:`triage_monitor.offline.importers.StepReader`
            (``(paths, on_invalid, info=None) -> (step, TokenBatch)`` pairs), imported when the command runs.
        dump: what the files are, recorded as run.json's ``import_source`` (the framework's dump option).
    """
    help: str
    paths_help: str
    target: str
    dump: str


#: ``{source: DumpReader}`` of ``triage-monitor import`` (docs/hooks.md, "Importing existing logs").
DUMP_READERS: Dict[str, DumpReader] = {
    "slime": DumpReader("slime --save-debug-train-data files (.pt, globs allowed)",
                        "train-data files or globs, e.g. 'dump/train_*_*.pt'",
                        "triage_monitor.hooks.slime_dumps:slime_steps", "save_debug_train_data"),
    "miles": DumpReader("Miles --save-debug-train-data per-rank files (.pt, globs allowed)",
                        "train-data files or globs, e.g. 'dump/train_data/*_*.pt'",
                        "triage_monitor.hooks.slime_dumps:miles_steps", "save_debug_train_data"),
}

__all__ = ["FRAMEWORKS", "DUMP_READERS", "DumpReader"]
