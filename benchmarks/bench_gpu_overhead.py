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
                                            [--batch 16] [--seq 2048] [--steps 12] [--json PATH] [--csv PATH]

``--part monitor`` measures instead the monitor on CUDA tensors alone, at each of ``--sizes`` padded tokens
(default 64k, 640k, 4M: rows of ``--cols`` 4,096 columns, lengths uniform in [cols/4, cols], as
benchmarks/bench_step_cost.py): per step ``TokenBatch.from_padded`` and ``MismatchMonitor.log_step`` (records on,
alerts off), CUDA synchronised, medians of ``--repeats`` steps after one warm-up; valid tokens per second of the
two; the device-to-host copy of the batch's per-token columns alone (learner / sampler log-probs, advantage,
sample index, position) and its share of the two; the host synchronisations of one ``from_padded`` + ``log_step``
(``torch.cuda.set_sync_debug_mode``); the writer's time to drain its queue after the last step.

``--json PATH`` / ``--csv PATH`` write the figures (the headline / one row per timed step or size; the monitor
part rewrites both after each size, so a run cut short keeps the sizes it finished); scripts/gpu_kit.sh reads them.

Needs CUDA: without a CUDA device it prints why on stderr and exits with status 2, having measured nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
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


def write_json(path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` whole or not at all (a temporary file renamed over it)."""
    if path is None:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def write_csv(path, rows: list) -> None:
    """Write ``rows`` (dicts; every key of any row a column, in order of appearance) as CSV to ``path``, whole or
    not at all."""
    if path is None or not rows:
        return
    tmp = Path(f"{path}.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def parse_size(text: str) -> int:
    """Padded tokens from ``64k`` / ``640k`` / ``4M`` / ``2048`` (k = 1,024, M = 1,024²).

    Raises:
        ValueError: not a positive count.
    """
    t = text.strip()
    mult = {"k": 1024, "M": 1024 ** 2}.get(t[-1:], 1)
    n = int(float(t[:-1] if mult > 1 else t) * mult)
    if n < 1:
        raise ValueError(f"size {text!r} is not a positive token count")
    return n


def monitor_part(args, dev: torch.device, sync) -> int:
    """The monitor on ``dev`` tensors alone (``--part monitor``, module docstring); returns the exit status."""
    import warnings

    from triage_monitor.batch import TokenBatch
    from triage_monitor.monitor import MismatchMonitor, MonitorConfig

    cuda = dev.type == "cuda"
    rows: list = []
    head = {"part": "monitor", "device": torch.cuda.get_device_name(0) if cuda else "CPU (smoke run: not a figure)",
            "torch": torch.__version__, "cols": args.cols, "repeats": args.repeats, "sizes": rows}
    g = torch.Generator(device="cpu").manual_seed(0)
    for name in args.sizes.split(","):
        B = max(1, round(parse_size(name) / args.cols))
        T = args.cols
        lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None] < lengths[:, None]).to(dev)
        sampler = (-torch.rand(B, T, generator=g) * 3).to(dev)
        learner = (sampler + torch.randn(B, T, generator=g).to(dev) * 0.1).clamp(max=0.0)
        adv = torch.randn(B, generator=g).to(dev)
        n_valid = int(lengths.sum())
        got: dict = {"from_padded": [], "log_step": [], "d2h": []}
        syncs = math.nan
        with tempfile.TemporaryDirectory() as d, \
                MismatchMonitor(Path(d) / "run", MonitorConfig(), alerts=False) as mon:
            for n in range(args.repeats + 1):              # step 0 warms up (kernels, numba, the writer)
                sync()
                t0 = time.perf_counter()
                batch = TokenBatch.from_padded(learner, sampler, adv, mask)
                sync()
                t1 = time.perf_counter()
                mon.log_step(n, batch)
                sync()
                t2 = time.perf_counter()
                cols = (batch.learner_logp, batch.sampler_logp, batch.advantage, batch.sample_index, batch.position)
                host = [c.to("cpu") for c in cols] if cuda else []   # the per-token columns' copy alone
                sync()
                t3 = time.perf_counter()
                del host
                if n:
                    got["from_padded"].append(t1 - t0)
                    got["log_step"].append(t2 - t1)
                    got["d2h"].append(t3 - t2 if cuda else math.nan)
            if cuda:                                       # the host synchronisations of one step, counted
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        mon.log_step(args.repeats + 1, TokenBatch.from_padded(learner, sampler, adv, mask))
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                syncs = sum("synchroniz" in str(w.message) for w in caught)
            t = time.perf_counter()
            mon.flush()
            drain = time.perf_counter() - t
        med = {k: statistics.median(v) * 1e3 for k, v in got.items()}
        total = med["from_padded"] + med["log_step"]
        row = {"size": name, "padded_tokens": B * T, "valid_tokens": n_valid, "from_padded_ms": med["from_padded"],
               "log_step_ms": med["log_step"], "total_ms": total, "tokens_per_s": n_valid / (total / 1e3),
               "d2h_ms": med["d2h"], "d2h_share": med["d2h"] / total, "syncs_per_step": syncs,
               "writer_drain_ms": drain * 1e3}
        rows.append(row)
        print(f"{name}: {n_valid:,} valid of {B * T:,} padded tokens: from_padded {med['from_padded']:.2f} ms + "
              f"log_step {med['log_step']:.2f} ms = {total:.2f} ms ({row['tokens_per_s'] / 1e6:.1f} M tokens/s); "
              f"the per-token columns' copy to the host {med['d2h']:.2f} ms ({row['d2h_share']:.1%} of it); "
              f"{syncs} host synchronisations a step; writer drained {drain * 1e3:.0f} ms after the last step",
              flush=True)
        write_json(args.json, head)
        write_csv(args.csv, rows)
    return 0 if rows and all(math.isfinite(r["total_ms"]) for r in rows) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=16, help="responses per step (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per response, padded (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps of each kind (default: %(default)s)")
    ap.add_argument("--part", choices=("overhead", "monitor"), default="overhead",
                    help="overhead: log_step + the TRIAGE loss in a training step; monitor: from_padded + log_step "
                         "alone at --sizes (default: %(default)s)")
    ap.add_argument("--sizes", default="64k,640k,4M", help="--part monitor: padded tokens a step (default: %(default)s)")
    ap.add_argument("--cols", type=int, default=4096, help="--part monitor: padded columns (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="--part monitor: timed steps a size (default: %(default)s)")
    ap.add_argument("--json", default=None, help="write the figures as JSON here")
    ap.add_argument("--csv", default=None, help="write one row per timed step (overhead) or size (monitor) here")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the code on the CPU (a check of the script, not a figure: scripts/gpu_kit.sh --smoke)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("bench_gpu_overhead.py: no CUDA device (torch.cuda.is_available() is False); this benchmark measures "
              "the learner overhead on a GPU training step and measured nothing", file=sys.stderr)
        return 2
    if args.part == "monitor":
        dev = torch.device("cpu" if args.cpu_smoke else "cuda")
        return monitor_part(args, dev, torch.cuda.synchronize if dev.type == "cuda" else (lambda: None))

    from triage_monitor.batch import TokenBatch
    from triage_monitor.triage.controller import TriageConfig, TriageController
    from triage_monitor.triage.loss import triage_policy_loss
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
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else math.nan
    write_json(args.json, {
        "part": "overhead", "device": name, "torch": torch.__version__, "params_m": params / 1e6,
        "layers": args.layers, "d_model": args.d_model, "batch": B, "seq": T, "valid_tokens": int(mask.sum()),
        "steps": args.steps, "plain_step_ms": plain["step"], "triage_step_ms": tri["step"],
        "triage_loss_extra_ms": extra_loss, "log_step_ms": tri["log_step"], "overhead_pct": overhead * 100,
        "paper_overhead_pct": 0.84, "writer_drain_ms": drain * 1e3, "peak_gib": peak})
    write_csv(args.csv, [{"kind": kind, "step": i, **{f"{k}_ms": v * 1e3 for k, v in r.items()}}
                         for kind, rs in got.items() for i, r in enumerate(rs)])
    return 0 if math.isfinite(overhead) else 1


if __name__ == "__main__":
    sys.exit(main())
