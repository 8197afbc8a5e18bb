"""What a user pays per step: the batch build, the TRIAGE loss, and the whole monitoring cost, against verl and TRL.

Per step of B × 4,096 padded tokens (lengths uniform in [1,024, 4,096], ~62 % valid) at 64k, 640k and 4M padded
tokens, on the same tensors (a framework's padded learner / sampler log-probs, per-sample advantages and its int64
response mask), in one process:

  1. ``TokenBatch.from_padded`` ÷ the bare gathers it needs: the valid tokens' flat indices, their row and column,
     the two log-probs and the advantage at them, with no check (goal <= 1.5);
  2. the TRIAGE loss forward + backward (``TokenBatch.from_padded`` + ``triage_policy_loss`` with the default
     controller — Gate, Repair, TIS — dual clip 3, token mean, + ``backward()``, as the verl hook runs it) ÷ verl
     0.9.1's own ``compute_policy_loss`` (``verl.trainer.ppo.core_algos``) forward + backward (goal <= 1.2);
  3. a user's whole per-step cost — ``TokenBatch.from_padded`` from the framework's tensors, ``log_step`` (records
     on) and the background writer's work on its own thread, to its flush — ÷ verl's metric function
     (``verl.trainer.ppo.rollout_corr_helper.compute_offpolicy_metrics``) and ÷ TRL 1.16.0's GRPOTrainer
     mismatch / sampling metric block (reproduced below line for line: it cannot be called alone), with the
     writer counted and without it (goal <= 1.0 x verl at 640k and 4M, <= 2 x at 64k).

Times are CPU seconds, the measure that the other jobs on a shared machine disturb least: ``time.thread_time`` of
the calling thread (torch with one thread; the state update and the loss run there), and for the writer the
process's CPU time over the step to its flush minus the calling thread's (the writer thread and pyarrow's pool).
Each step runs every compared call once, in alternating order (A B C, C B A, ...), so they all see the same load;
medians over ``--rounds`` fresh processes × ``--steps`` steps (the first step of each size warms up, not timed).
Wall-clock medians are printed beside (with one core free the writer overlaps the next step; on a loaded machine
wall time mostly measures the wait for a core).

    python benchmarks/bench_step_cost.py [--rounds 3] [--steps 5] [--sizes 64k,640k,4M] [--old PATH]

``--old PATH``: a checkout of an earlier commit (``git worktree add /tmp/old <commit>``), measured with this
script in fresh processes alternating with this checkout's; prints new ÷ old per figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"64k": 16, "640k": 160, "4M": 1024}          # rows of 4,096 columns: ~64k, ~640k, ~4M padded tokens
T_COLS = 4096


def inputs(b: int, seed: int = 0):
    """The framework's padded tensors of one step: learner, sampler and old log-probs ``(b, 4096)`` float32 (nats),
    per-sample advantages ``(b,)`` and the int64 response mask (what verl's ``response_mask`` and TRL's
    ``completion_mask`` are)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1024, T_COLS + 1, (b,), generator=g)
    mask = (torch.arange(T_COLS)[None] < lengths[:, None]).long()
    sampler = -torch.rand(b, T_COLS, generator=g) * 3
    learner = (sampler + torch.randn(b, T_COLS, generator=g) * 0.1).clamp(max=0)
    old = (learner + torch.randn(b, T_COLS, generator=g) * 0.02).clamp(max=0)
    adv = torch.randn(b, generator=g)
    return learner, sampler, old, adv, mask


def bare_gathers(learner, sampler, adv, mask):
    """What ``from_padded`` cannot do without: the valid tokens' flat indices, each one's row and column, and the
    learner / sampler log-probs and the per-sample advantage at them; no check, no bookkeeping."""
    import torch

    T = learner.shape[1]
    source = torch.nonzero(mask.reshape(-1)).squeeze(1)
    rows = torch.div(source, T, rounding_mode="floor")
    return learner.reshape(-1)[source], sampler.reshape(-1)[source], adv[rows], rows, source % T


def trl_is_ratio(old_per_token_logps, sampling_per_token_logps, completion_mask, clip_min=None, clip_max=3.0):
    """TRL 1.16.0 ``trl/trainer/grpo_trainer.py`` L2660-2707 (``GRPOTrainer._generate_and_score_completions``) for
    its default ``vllm_importance_sampling_mode="sequence_mask"``, ``vllm_importance_sampling_clip_max=3.0``, no
    tool mask: the importance-sampling ratio the metric block reads (the correction's input, computed outside the
    timed block, as TRL computes it for its loss anyway).  Returns ``(ratio (B, 1), sequence_level_is)``."""
    import torch

    mask = completion_mask                                                                 # L2661 (tool_mask None)
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask         # L2662
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)                # L2665
    sequence_level_is = True                                                               # L2667: sequence_mask
    per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)               # L2669
    logps_diff = per_sequence_logps_diff                                                   # L2670
    vllm_importance_sampling_ratio = torch.exp(logps_diff)                                 # L2674
    min_val = clip_min if clip_min is not None else -math.inf                              # L2687-2691
    max_val = clip_max if clip_max is not None else math.inf                               # L2692-2696
    invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (                      # L2698-2700
        vllm_importance_sampling_ratio > max_val
    )
    vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(          # L2701-2703
        invalid_mis_mask, value=0.0
    )
    return vllm_importance_sampling_ratio, sequence_level_is


def trl_metric_block(old_per_token_logps, sampling_per_token_logps, completion_mask, vllm_importance_sampling_ratio,
                     sequence_level_is, nanmin, nanmax, device="cpu") -> dict:
    """TRL 1.16.0 ``trl/trainer/grpo_trainer.py`` L2860-2896 (``GRPOTrainer._generate_and_score_completions``), line
    for line: the mismatch / sampling metrics TRL computes every step when vLLM's importance-sampling correction is
    on (its default).  On one process ``self.accelerator.gather`` returns its input; ``self._metrics[mode][k]
    .append(v)`` becomes ``metrics[k] = v``; ``nanmin`` / ``nanmax`` are TRL's own (``trl.trainer.utils``)."""
    import torch

    gather = (lambda t: t)
    metrics = {}
    tool_mask = None
    delta = torch.abs(old_per_token_logps - sampling_per_token_logps)                                     # L2861
    mask = completion_mask.bool() if tool_mask is None else (completion_mask * tool_mask).bool()          # L2862
    delta = delta[mask & ~torch.isnan(delta)]                                                             # L2865
    mean_delta = torch.mean(delta) if delta.numel() > 0 else torch.tensor(0.0, device=device)             # L2866
    max_delta = torch.max(delta) if delta.numel() > 0 else torch.tensor(0.0, device=device)               # L2867
    metrics["sampling/sampling_logp_difference/mean"] = gather(mean_delta).mean().item()                  # L2868-2870
    metrics["sampling/sampling_logp_difference/max"] = gather(max_delta).max().item()                     # L2871-2873
    if sequence_level_is:                                                                                 # L2874
        flat_is_ratio = vllm_importance_sampling_ratio.flatten()                                          # L2875
    else:
        flat_is_ratio = vllm_importance_sampling_ratio[mask]                                              # L2877
    min_importance_sampling_ratio = (                                                                     # L2879-2881
        torch.min(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
    )
    mean_importance_sampling_ratio = (                                                                    # L2882-2884
        torch.mean(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
    )
    max_importance_sampling_ratio = (                                                                     # L2885-2887
        torch.max(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
    )
    metrics["sampling/importance_sampling_ratio/min"] = nanmin(gather(min_importance_sampling_ratio)).item()  # L2888-2890
    metrics["sampling/importance_sampling_ratio/mean"] = gather(mean_importance_sampling_ratio).nanmean().item()  # L2891-2893
    metrics["sampling/importance_sampling_ratio/max"] = nanmax(gather(max_importance_sampling_ratio)).item()  # L2894-2896
    return metrics


class Clock:
    """CPU time of the calling thread, of the whole process, and wall time, read together."""

    def __init__(self):
        self.thread, self.process, self.wall = time.thread_time(), time.process_time(), time.perf_counter()

    def since(self) -> tuple:
        """(thread CPU, process CPU, wall) seconds since this clock was read."""
        return (time.thread_time() - self.thread, time.process_time() - self.process, time.perf_counter() - self.wall)


def measure(steps: int, sizes: list) -> dict:
    """In this process (the package on sys.path): per size, lists of seconds per step of every figure's parts."""
    import shutil
    import tempfile

    import torch

    from triage_monitor.batch import TokenBatch
    # the 0.1 module paths (they still import: triage_monitor/_compat.py), so that --old runs a checkout from before
    # the modules moved into sub-packages
    from triage_monitor.controller import TriageConfig, TriageController
    from triage_monitor.loss import triage_policy_loss
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    warnings.simplefilter("ignore")            # verl's compute_policy_loss warns that it is deprecated, every call
    from trl.trainer.utils import nanmax, nanmin
    from verl.trainer.ppo.core_algos import compute_policy_loss
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    torch.set_num_threads(1)
    out = {}
    for name in sizes:
        b = SIZES[name]
        learner, sampler, old, adv, mask = inputs(b)
        adv_tokens = adv[:, None].expand(b, T_COLS)                  # verl's advantages are per token
        is_ratio, seq_is = trl_is_ratio(learner, sampler, mask)
        ctrl = TriageController(TriageConfig())
        d = tempfile.mkdtemp(prefix="bench-step-")
        got: dict = {k: [] for k in ("build", "main", "writer", "whole_wall", "bare", "verl", "verl_wall", "trl",
                                     "trl_wall", "loss", "loss_wall", "verl_loss", "verl_loss_wall")}
        try:
            with MismatchMonitor(Path(d) / "run", MonitorConfig(tau_tail=-1.0), alerts=False) as mon:
                def ours(step):
                    c = Clock()
                    batch = TokenBatch.from_padded(learner, sampler, adv, mask.bool())
                    build = time.thread_time() - c.thread
                    mon.log_step(step, batch)
                    mon.flush()
                    th, pr, wall = c.since()
                    return {"build": build, "main": th, "writer": pr - th, "whole_wall": wall}

                def bare(step):
                    c = Clock()
                    bare_gathers(learner, sampler, adv, mask.bool())
                    return {"bare": c.since()[0]}

                def verl_metrics(step):
                    c = Clock()
                    compute_offpolicy_metrics(learner, sampler, mask)
                    th, _, wall = c.since()
                    return {"verl": th, "verl_wall": wall}

                def trl_metrics(step):
                    c = Clock()
                    trl_metric_block(learner, sampler, mask, is_ratio, seq_is, nanmin, nanmax)
                    th, _, wall = c.since()
                    return {"trl": th, "trl_wall": wall}

                def triage_loss(step):
                    lp = learner.clone().requires_grad_(True)
                    c = Clock()
                    batch = TokenBatch.from_padded(lp, sampler, adv, mask.bool())
                    res = triage_policy_loss(ctrl, batch, step, old_logp=batch.gather(old), clip_low=0.2,
                                             clip_high=0.2, dual_clip=3.0, agg_mode="token_mean")
                    res.loss.backward()
                    th, _, wall = c.since()
                    return {"loss": th, "loss_wall": wall}

                def verl_loss(step):
                    lp = learner.clone().requires_grad_(True)
                    c = Clock()
                    loss = compute_policy_loss(old, lp, adv_tokens, mask, cliprange=0.2, clip_ratio_c=3.0,
                                               loss_agg_mode="token-mean")[0]
                    loss.backward()
                    th, _, wall = c.since()
                    return {"verl_loss": th, "verl_loss_wall": wall}

                jobs = [ours, bare, verl_metrics, trl_metrics, triage_loss, verl_loss]
                for step in range(steps + 1):                    # the first step warms up (compilation, caches)
                    for job in (jobs if step % 2 == 0 else jobs[::-1]):
                        res = job(step)
                        if step:
                            for k, v in res.items():
                                got[k].append(v)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        got["tokens"] = int(mask.sum())
        out[name] = got
    return out


def run_tree(tree: Path, steps: int, sizes: list) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    code = (f"import json, sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(ROOT / 'benchmarks')!r}); "
            f"import bench_step_cost as b; print('RESULT ' + json.dumps(b.measure({steps}, {sizes!r})))")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    if res.returncode:
        raise SystemExit(f"{tree}: {res.stderr[-2000:]}")
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per checkout (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per size and round (default: %(default)s)")
    ap.add_argument("--sizes", default=",".join(SIZES), help="of %(default)s")
    ap.add_argument("--old", type=Path, default=None, help="a checkout of an earlier commit to compare with")
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            ap.error(f"--sizes: {s!r} is not one of {', '.join(SIZES)}")
    trees = {"new": ROOT, **({"old": args.old.resolve()} if args.old else {})}
    got: dict = {k: {} for k in trees}
    load = [os.getloadavg()[0]]
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the start", flush=True)
    for r in range(args.rounds):
        for k, tree in trees.items():
            for s, v in run_tree(tree, args.steps, sizes).items():
                per = got[k].setdefault(s, {})
                for name, xs in v.items():
                    if name == "tokens":
                        per["tokens"] = xs
                    else:
                        per.setdefault(name, []).extend(xs)
            load.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds}: {k} done (load average {load[-1]:.1f})", file=sys.stderr, flush=True)
    med = {k: {s: {n: (statistics.median(x) * 1e3 if isinstance(x, list) else x) for n, x in per.items()}
               for s, per in by.items()} for k, by in got.items()}
    n_calls = args.rounds * args.steps
    print(f"medians of {n_calls} interleaved calls each ({args.rounds} processes x {args.steps} steps); CPU ms "
          f"(wall ms); load average {min(load):.1f}-{max(load):.1f} during the run")
    for s in sizes:
        m = med["new"][s]
        print(f"\n{s} ({m['tokens']:,} valid tokens of {SIZES[s] * T_COLS:,})")
        print(f"  1. from_padded {m['build']:8.2f} ms, bare gathers {m['bare']:8.2f} ms: "
              f"{m['build'] / m['bare']:.2f}x (goal <= 1.5)")
        print(f"  2. TRIAGE loss f+b {m['loss']:8.1f} ms ({m['loss_wall']:.1f}), verl compute_policy_loss f+b "
              f"{m['verl_loss']:8.1f} ms ({m['verl_loss_wall']:.1f}): {m['loss'] / m['verl_loss']:.2f}x (goal <= 1.2)")
        whole = m["main"] + m["writer"]
        goal = "<= 2" if s == "64k" else "<= 1"
        print(f"  3. whole step {whole:8.1f} ms = batch + log_step {m['main']:.1f} (build {m['build']:.1f}) + writer "
              f"{m['writer']:.1f} ({m['whole_wall']:.1f} wall to the flush); verl {m['verl']:.2f} ms "
              f"({m['verl_wall']:.2f}), TRL block {m['trl']:.2f} ms ({m['trl_wall']:.2f})")
        print(f"     ÷ verl: {whole / m['verl']:.2f}x with the writer, {m['main'] / m['verl']:.2f}x without "
              f"(goal {goal}); ÷ TRL: {whole / m['trl']:.2f}x with, {m['main'] / m['trl']:.2f}x without")
        if "old" in med and s in med["old"]:
            o = med["old"][s]
            print(f"     new ÷ old: from_padded {m['build'] / o['build']:.2f}, loss {m['loss'] / o['loss']:.2f}, "
                  f"batch + log_step {m['main'] / o['main']:.2f}, writer {m['writer'] / o['writer']:.2f}, whole "
                  f"{whole / (o['main'] + o['writer']):.2f}")


if __name__ == "__main__":
    main()
