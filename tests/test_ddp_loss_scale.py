"""The TRIAGE loss under DistributedDataParallel: with a process group the loss *value* is the global loss on every
rank while the *gradient* flows through the rank's own tokens, and DDP averages the gradients over the W ranks —
so the policy part needs ``loss_scale=world_size`` (README, docs/hooks.md#the-loss-under-ddp).

Two real gloo ranks (this file run as a script: ``python tests/test_ddp_loss_scale.py <rank> <world> <dir>``),
each training a ``DistributedDataParallel`` copy of one small linear policy on its shard (rows ``rank::world``) of
one global batch; the parent compares the gradients DDP leaves with the gradient of the single-process loss on
the whole batch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from triage_monitor.batch import TokenBatch  # noqa: E402
from triage_monitor.triage.controller import TriageConfig, TriageController  # noqa: E402
from triage_monitor.triage.loss import triage_policy_loss  # noqa: E402

pytestmark = pytest.mark.multiprocess

B, T, D, V, WORLD = 8, 40, 6, 11, 2
POLICY = TriageConfig(repair=False)                       # Gate and TIS on: weights that differ from 1
WITH_REPAIR = TriageConfig(repair_tau=-0.01, repair_coef=1.0)   # Repair too (made large): loss_scale does not scale it


def policy():
    torch.manual_seed(0)
    return torch.nn.Linear(D, V)


def data(rows=slice(None)):
    """One global batch: features, sampled tokens, sampler log-probs (the learner's plus noise: δ ≠ 0), advantages,
    a mask with responses of different lengths."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, D, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    noise = torch.randn(B, T, generator=g) * 0.4 + 0.3           # sampler above the learner: Repair pulls
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    return tuple(t[rows] for t in (x, y, noise, adv, mask))


def loss_of(model, cfg, group=None, rows=slice(None), **kw):
    x, y, noise, adv, mask = data(rows)
    logp = torch.log_softmax(model(x), -1).gather(-1, y[..., None])[..., 0]
    sampler = (logp.detach() + noise).clamp(max=0)
    b = TokenBatch.from_padded(logp, sampler, adv, mask)
    return triage_policy_loss(TriageController(cfg, group=group), b, 0, group=group, **kw).loss


def grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def worker(rank, world, outdir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    outdir = Path(outdir)
    dist.init_process_group("gloo", init_method=f"file://{outdir / 'rendezvous'}", rank=rank, world_size=world)
    out = {}
    for name, cfg, kw, scale in (("unscaled", POLICY, {}, 1), ("loss_scale", POLICY, {"loss_scale": world}, 1),
                                 ("repair_loss_scale", WITH_REPAIR, {"loss_scale": world}, 1),
                                 ("repair_whole", WITH_REPAIR, {}, world)):
        model = DDP(policy())
        loss = loss_of(model, cfg, dist.group.WORLD, slice(rank, None, world), **kw)
        (loss * scale).backward()                        # DDP averages the gradients over the ranks here
        out[name] = (loss.detach(), grads(model.module))
    torch.save(out, outdir / f"rank{rank}.pt")
    dist.barrier()                   # neither rank tears its gloo pairs down while the other still uses them
    dist.destroy_process_group()


def test_under_ddp_the_policy_loss_needs_loss_scale_world_size(tmp_path):
    """DDP's averaged gradient is the single-process gradient of the global loss divided by W without a scale,
    equal to it with ``loss_scale=world_size`` (the Gate and TIS on); with Repair on, ``loss_scale`` scales only
    the policy part, and multiplying the whole loss by W gives the exact gradient.  Every rank's loss value is the
    global loss (× W with ``loss_scale``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(WORLD), str(tmp_path)], env=env,
                              stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

    def single(cfg):
        model = policy()
        loss = loss_of(model, cfg)
        loss.backward()
        return loss.detach(), grads(model)

    ref_loss, ref = single(POLICY)
    ref_repair_loss, ref_repair = single(WITH_REPAIR)
    _, policy_only = single(TriageConfig(repair_tau=-0.01, repair_coef=0.0))     # the same Gate and TIS, no Repair
    assert ref.abs().max() > 1e-3 and (ref_repair - policy_only).abs().max() > 1e-4    # Repair moves the gradient
    for r in ranks:
        torch.testing.assert_close(r["unscaled"][0], ref_loss, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r["unscaled"][1], ref / WORLD, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(r["loss_scale"][0], ref_loss * WORLD, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r["loss_scale"][1], ref, rtol=1e-4, atol=1e-7)
        # loss_scale leaves Repair's gradient W times too small: policy part exact, Repair part / W
        torch.testing.assert_close(r["repair_loss_scale"][1], policy_only + (ref_repair - policy_only) / WORLD,
                                   rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(r["repair_whole"][0], ref_repair_loss, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r["repair_whole"][1], ref_repair, rtol=1e-4, atol=1e-7)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
