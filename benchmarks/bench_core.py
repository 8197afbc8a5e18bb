"""Cost of monitoring and of the TRIAGE controller relative to a plain PPO-clip loss .

On a batch of B responses × T tokens (default 256 × 4,096, ~1M tokens) it times
  * the plain PPO-clip loss (forward + backward) : the reference;
  * the full metric set (MismatchStats.update + compute, τ_tail given);
  * the controller: Gate + Repair + TIS + weighted per-response loss (forward + backward);
and the throughput of `triage-monitor analyze` (offline recomputation from Parquet) in tokens/s.

    python benchmarks/bench_core.py [--batch 256] [--seq 4096] [--repeats 3] [--device cpu|cuda]

Prints one line per figure.  Timings are medians over --repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from triage_monitor.offline.analysis import open_run, recompute
from triage_monitor.batch import TokenBatch
from triage_monitor.triage.controller import TriageConfig, TriageController
from triage_monitor.triage.loss import weighted_policy_loss
from triage_monitor.triage.corrections import ppo_clip_loss
from triage_monitor.metrics.stats import MetricConfig, MismatchStats
from triage_monitor.monitor import MismatchMonitor, MonitorConfig


def make_inputs(B: int, T: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(B, T, generator=g) * 3
    learner = (sampler + torch.randn(B, T, generator=g) * 0.05
               - (torch.rand(B, T, generator=g) < 0.03) * torch.rand(B, T, generator=g) * 4).clamp(max=0)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(B, generator=g)
    return [t.to(device) for t in (learner, sampler, adv, mask)]


def timeit(fn, repeats: int, device: str) -> float:
    fn()
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--analyze-steps", type=int, default=4)
    args = ap.parse_args()
    B, T, dev = args.batch, args.seq, args.device
    learner, sampler, adv, mask = make_inputs(B, T, dev)
    n = int(mask.sum())
    print(f"batch {B} x {T}, {n:,} valid tokens, device {dev}, torch threads {torch.get_num_threads()}")

    def ppo():
        lp = learner.clone().requires_grad_(True)
        b = TokenBatch.from_padded(lp, sampler, adv, mask)
        loss = ppo_clip_loss(b.learner_logp, b.learner_logp.detach(), b.advantage).mean()
        loss.backward()

    def metrics():
        b = TokenBatch.from_padded(learner, sampler, adv, mask)
        MismatchStats(MetricConfig(), device=dev).update(b, -0.25).compute()

    ctrl = TriageController(TriageConfig())

    def controller():
        lp = learner.clone().requires_grad_(True)
        b = TokenBatch.from_padded(lp, sampler, adv, mask)
        out = ctrl(b, step=0)
        pg = ppo_clip_loss(b.learner_logp, b.learner_logp.detach(), b.advantage)
        loss = weighted_policy_loss(pg, out.token_weights, b, normalization="per_response") + out.repair_loss
        loss.backward()

    t_ppo = timeit(ppo, args.repeats, dev)
    t_met = timeit(metrics, args.repeats, dev)
    t_ctl = timeit(controller, args.repeats, dev)
    print(f"plain PPO-clip loss fwd+bwd          {t_ppo * 1e3:9.1f} ms  (1.00x)")
    print(f"full metric set (update+compute)     {t_met * 1e3:9.1f} ms  ({t_met / t_ppo:.2f}x PPO-clip)")
    print(f"controller Gate+Repair+TIS+loss f+b  {t_ctl * 1e3:9.1f} ms  ({t_ctl / t_ppo:.2f}x PPO-clip)")

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        with MismatchMonitor(tmp, MonitorConfig(tau_tail=-0.25)) as mon:
            for step in range(args.analyze_steps):
                l2, s2, a2, m2 = make_inputs(B, T, "cpu", seed=step)
                mon.log_step(step, TokenBatch.from_padded(l2, s2, a2, m2))
        t_log = time.perf_counter() - t
        run = open_run(tmp)
        t = time.perf_counter()
        df = recompute(run)
        t_an = time.perf_counter() - t
        tokens = int(df["n_tokens"].sum())
        print(f"monitor.log_step incl. Parquet write {t_log / args.analyze_steps * 1e3:9.1f} ms/step "
              f"({tokens / t_log:,.0f} tokens/s)")
        print(f"triage-monitor analyze (recompute)   {tokens / t_an:,.0f} tokens/s  ({tokens:,} tokens, {t_an:.2f} s)")


if __name__ == "__main__":
    main()
