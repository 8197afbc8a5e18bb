"""log_step + the TRIAGE loss as a fraction of a real model's training step on CUDA (a few minutes on one GPU).

A decoder-only transformer (torch's own layers: pre-norm, causal attention, GELU MLP, tied embeddings; default
24 layers, d = 1024, 16 heads, a 32,000-token vocabulary: ~335M parameters) trains with AdamW in bf16 autocast on
B × T tokens (default 16 × 2,048, responses of uniform length in [T/4, T]).  Two training steps alternate, on the
same tokens, so that both see the same GPU state:

  * plain: forward, the learner log-probs of the sampled tokens, a plain PPO-clip loss on the padded tensors (verl's
    formula: dual clip 3, masked token mean), backward, optimizer step — a trainer without triage-monitor;
  * TRIAGE: the same step with ``TokenBatch.from_padded`` + ``triage_policy_loss`` (Gate, Repair, TIS: the default
    controller) instead of the plain loss, then ``MismatchMonitor.log_step`` (records on; the writer works on its
    own thread while the next step trains).

Printed: the medians of each step's wall time (CUDA synchronised), of the TRIAGE loss's extra time and of
log_step's, and the learner overhead (TRIAGE step + log_step − plain step) ÷ plain step, the figure the TRIAGE paper
reports as 0.84 %; also the writer's time to drain its queue at the end.

    python benchmarks/bench_gpu_overhead.py [--layers 24] [--d-model 1024] [--heads 16] [--vocab 32000]
                                            [--batch 16] [--seq 2048] [--steps 12]

Needs CUDA: without a CUDA device it prints why on stderr and exits with status 2, having measured nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class DecoderLM(torch.nn.Module):
    """A decoder-only language model from torch's own layers: token and position embeddings, ``layers`` pre-norm
    transformer blocks with causal self-attention, a final norm and the tied output projection."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, max_len: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(max_len, d_model)
        block = torch.nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, activation="gelu",
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        x = self.embed(ids) + self.pos(torch.arange(T, device=ids.device))[None]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(T, device=ids.device, dtype=x.dtype)
        x = self.blocks(x, mask=causal, is_causal=True)
        return self.norm(x) @ self.embed.weight.T                          # (B, T, vocab) logits


def plain_ppo_loss(logp, old, adv, mask, clip=0.2, clip_c=3.0):
    """verl's PPO-clip loss (``compute_policy_loss_vanilla``'s formula, dual clip, token mean) on padded tensors."""
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    a = adv[:, None]
    pg1 = -a * ratio
    pg2 = -a * ratio.clamp(1 - clip, 1 + clip)
    clipped = torch.maximum(pg1, pg2)
    pg = torch.where(a < 0, torch.minimum(-a * clip_c, clipped), clipped)
    m = mask.float()
    return (pg * m).sum() / m.sum()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=16, help="responses per step (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per response, padded (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps of each kind (default: %(default)s)")
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)   # the code path on the CPU, no figure
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("bench_gpu_overhead.py: no CUDA device (torch.cuda.is_available() is False); this benchmark measures "
              "the learner overhead on a GPU training step and measured nothing", file=sys.stderr)
        return 2

    from triage_monitor.batch import TokenBatch
    from triage_monitor.controller import TriageConfig, TriageController
    from triage_monitor.loss import triage_policy_loss
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    B, T = args.batch, args.seq
    model = DecoderLM(args.vocab, args.d_model, args.heads, args.layers, T).to(dev)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(args.vocab, (B, T + 1), generator=g).to(dev)
    mask = (torch.arange(T)[None] < torch.randint(T // 4, T + 1, (B, 1), generator=g)).to(dev)
    adv = torch.randn(B, generator=g).to(dev)
    noise = (torch.randn(B, T, generator=g) * 0.05).to(dev)
    ctrl = TriageController(TriageConfig())

    def learner_logp():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        return logits.float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)       # (B, T) nats

    def step(kind: str, n: int, mon) -> dict:
        sync()
        t0 = time.perf_counter()
        logp = learner_logp()
        old = logp.detach()
        sampler = (old + noise).clamp(max=0.0)                 # the rollout engine's log-probs of the same tokens
        sync()
        t1 = time.perf_counter()
        if kind == "plain":
            loss = plain_ppo_loss(logp, old, adv, mask)
            batch = None
        else:
            batch = TokenBatch.from_padded(logp, sampler, adv, mask)
            loss = triage_policy_loss(ctrl, batch, n, old_logp=batch.gather(old), clip_low=0.2, clip_high=0.2,
                                      dual_clip=3.0, agg_mode="token_mean").loss
        sync()
        t2 = time.perf_counter()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        out = {"step": t3 - t0, "loss_fwd": t2 - t1}
        if mon is not None:
            mon.log_step(n, batch.detach())
            sync()
            out["log_step"] = time.perf_counter() - t3
        return out

    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "CPU (smoke run: not a figure)"
    print(f"{name}, torch {torch.__version__}; model {params / 1e6:.0f}M parameters "
          f"({args.layers} layers, d = {args.d_model}); {B} x {T} tokens a step ({int(mask.sum()):,} valid); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    got: dict = {"plain": [], "triage": []}
    with tempfile.TemporaryDirectory() as d, \
            MismatchMonitor(Path(d) / "run", MonitorConfig(), alerts=False) as mon:
        for n in range(2):                                     # warm-up: kernels, allocator, numba, the writer
            step("plain", n, None)
            step("triage", n, mon)
        for n in range(2, args.steps + 2):
            order = ("plain", "triage") if n % 2 == 0 else ("triage", "plain")
            for kind in order:
                got[kind].append(step(kind, n, mon if kind == "triage" else None))
            print(f"step {n - 1}/{args.steps}", file=sys.stderr, flush=True)
        t = time.perf_counter()
        mon.flush()
        drain = time.perf_counter() - t
    med = {k: {m: statistics.median(r[m] for r in rows) * 1e3 for m in rows[0]} for k, rows in got.items()}
    plain, tri = med["plain"], med["triage"]
    extra_loss = tri["step"] - plain["step"]
    overhead = (extra_loss + tri["log_step"]) / plain["step"]
    print(f"plain step {plain['step']:.1f} ms (its loss forward {plain['loss_fwd']:.2f} ms); TRIAGE step "
          f"{tri['step']:.1f} ms (batch + TRIAGE loss forward {tri['loss_fwd']:.2f} ms): the TRIAGE loss adds "
          f"{extra_loss:.2f} ms; log_step {tri['log_step']:.2f} ms (medians of {args.steps} interleaved steps each)")
    print(f"learner overhead (TRIAGE step + log_step - plain step) / plain step: {overhead * 100:.2f} % "
          f"(the TRIAGE paper: 0.84 %); the writer drained its queue {drain * 1e3:.0f} ms after the last step")
    return 0 if math.isfinite(overhead) else 1


if __name__ == "__main__":
    sys.exit(main())
