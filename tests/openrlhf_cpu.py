"""Run OpenRLHF 0.11.2's real policy-training code on a CPU (support for tests/test_hooks_openrlhf.py).

OpenRLHF itself is never replaced.  What cannot run on a CPU is:

* imported modules that need CUDA at install time: ``flash_attn`` (``models/ring_attn_utils.py`` imports
  ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed``; ``log_probs_from_logits`` falls back to plain
  torch when ``flash_attn.ops`` is missing) and ``vllm`` (imported by ``trainer/ray/vllm_engine.py``).  They
  are stood in for by empty modules whose functions raise if ever called (:func:`install_stubs`);
  ``deepspeed`` itself is installed (``scripts/install_frameworks.sh``).
* the DeepSpeed engine (its optimizers are CUDA kernels, ZeRO needs NCCL): :class:`CPUEngine` does what
  ``DeepSpeedEngine`` does for ``DeepspeedStrategy.backward`` / ``optimizer_step`` / ``get_grad_norm``:
  forward to the module, ``backward`` of ``loss / gradient_accumulation_steps``, a torch optimizer step (and
  zero_grad, scheduler step) on every ``gradient_accumulation_steps``-th ``step()`` call.
* ``torch.cuda`` calls of ``PolicyModelActor.fit``, ``ActorPPOTrainer.__init__`` / ``ppo_train`` and
  ``NaiveReplayBuffer``: :func:`cpu_cuda` makes ``current_device`` name the CPU and ``synchronize`` /
  ``empty_cache`` no-ops while OpenRLHF code runs.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from argparse import Namespace

import torch

STUBBED = ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed",
           "vllm", "vllm.inputs", "vllm.utils")


def _raiser(name):
    def f(*a, **k):
        raise RuntimeError(f"{name} is a CPU test stand-in (CUDA-only module) and must not be called")
    return f


def install_stubs() -> list:
    """Put the stand-in modules for flash_attn and vllm into ``sys.modules``; returns the names added.

    transformers' flash-attention availability checks run first, without them (so it never uses the stand-ins).
    """
    from transformers.utils import import_utils

    import_utils.is_flash_attn_2_available()
    import transformers.integrations.hub_kernels  # noqa: F401  (evaluates flash-attn support at import)
    added = []
    for name in STUBBED:
        if name in sys.modules:
            continue
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__stub__ = True
        sys.modules[name] = m
        added.append(name)
    fa = sys.modules["flash_attn.bert_padding"]
    for n in ("index_first_axis", "pad_input", "rearrange", "unpad_input"):
        setattr(fa, n, _raiser(f"flash_attn.bert_padding.{n}"))
    sys.modules["flash_attn.utils.distributed"].all_gather = _raiser("flash_attn.utils.distributed.all_gather")
    sys.modules["vllm"].__version__ = "0.29.0"
    sys.modules["vllm"].SamplingParams = _raiser("vllm.SamplingParams")
    sys.modules["vllm.inputs"].TokensPrompt = _raiser("vllm.inputs.TokensPrompt")
    sys.modules["vllm.utils"].random_uuid = _raiser("vllm.utils.random_uuid")
    return added


def remove_stubs(names) -> None:
    for n in names:
        if getattr(sys.modules.get(n), "__stub__", False):
            del sys.modules[n]


@contextlib.contextmanager
def cpu_cuda(current_device=0):
    """``torch.cuda.current_device`` returns ``current_device``; ``synchronize`` / ``empty_cache`` do nothing."""
    saved = torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.empty_cache
    torch.cuda.current_device = lambda: current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.empty_cache = saved


class CPUEngine(torch.nn.Module):
    """The part of ``DeepSpeedEngine`` that ``DeepspeedStrategy`` uses, with a torch optimizer (module docstring)."""

    def __init__(self, module, optimizer, scheduler, gradient_accumulation_steps: int):
        super().__init__()
        self.module = module
        self.optimizer, self.scheduler = optimizer, scheduler
        self.gas = int(gradient_accumulation_steps)
        self.micro_steps = 0
        self.global_steps = 0
        self._grad_norm = None

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def config(self):
        return self.module.config

    def backward(self, loss):
        (loss / self.gas).backward()

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.gas == 0:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), float("inf"))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.global_steps += 1

    def get_global_grad_norm(self):
        return self._grad_norm


def ns(**kw):
    """Nested namespace from ``{"a.b": v}`` keys, as OpenRLHF's ``hierarchize`` builds its args."""
    from openrlhf.utils.config import hierarchize

    return hierarchize(Namespace(**kw))


def openrlhf_args(*, loss_agg_mode="token-mean", dual_clip=None, is_level="token", is_mode="mask",
                  is_gating="ratio", is_threshold=(0.5, 5.0), eps=(0.2, 0.28), max_epochs=1):
    """The args fields ``ActorPPOTrainer`` / ``DeepspeedStrategy`` read, with train_ppo_ray.py's defaults."""
    return ns(**{
        "train.max_epochs": max_epochs, "train.dynamic_batch_enable": False, "train.colocate_all": False,
        "train.async_enable": False, "actor.eps_clip_low_high": list(eps), "actor.dual_clip": dual_clip,
        "actor.loss_agg_mode": loss_agg_mode, "actor.policy_loss_type": "ppo", "actor.aux_loss_coef": 0.0,
        "actor.entropy_coef": None, "algo.advantage.is_correction_level": is_level,
        "algo.advantage.is_correction_mode": is_mode, "algo.advantage.is_correction_gating": is_gating,
        "algo.advantage.is_correction_threshold": list(is_threshold), "algo.kl.use_loss": False,
        "ds.packing_samples": False, "ds.tensor_parallel_size": 1, "ds.param_dtype": "bf16", "ds.zero_stage": 2,
        "vllm.sync_backend": "gloo", "local_rank": -1, "ckpt.path": "ckpt", "ckpt.max_num": 3,
        "ckpt.max_mem": 1000})


def tiny_model_dir(path, seed=0):
    """A 2-layer Llama with a 64-token vocabulary, saved to ``path`` (no hub download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def experiences(actor, n=24, seed=0, max_prompt=6, max_resp=10, amplify=0.0):
    """``n`` single-sample ``Experience`` objects laid out as ``samples_generator`` builds them (prompt + response
    shifted by one, a tool span with mask 0, rollout log-probs 0.0 off the mask), with ``action_log_probs``
    from the actor (old policy) and rollout log-probs = old + noise, + 0.8 nats on every third sample (a sampler
    that differs, enough for the Gate to act).  ``amplify`` > 0 instead: rollout log-probs = old ∓ ``amplify``
    nats (above the learner's on A < 0 samples, below on A > 0: the amplifying direction) ± 0.05 nats noise."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P = int(torch.randint(2, max_prompt + 1, (), generator=g))
        R = int(torch.randint(3, max_resp + 1, (), generator=g))
        seq = torch.randint(1, 64, (1, P + R), generator=g)
        attn = torch.ones(1, P + R, dtype=torch.long)
        am = torch.zeros(1, P + R, dtype=torch.long)
        am[0, P:] = 1
        if R >= 7:
            am[0, P + 2:P + 4] = 0                                  # tool output inside the response
        am = am[:, 1:].bool()
        with torch.no_grad():
            old = actor(seq, am, attention_mask=attn).float()
        shift = 0.8 if i % 3 == 0 else 0.0                          # a sampler well above the learner: δ < 0
        noise = torch.randn(old.shape, generator=g)
        a = float(torch.randn((), generator=g))
        if amplify:
            rollout = (old - amplify * (1.0 if a > 0 else -1.0) + 0.05 * noise).clamp(max=-1e-4) * am
        else:
            rollout = (old + shift + 0.3 * noise).clamp(max=-1e-4) * am
        adv = torch.full(old.shape, a) * am
        out.append(Experience(sequences=seq, attention_mask=attn, action_mask=am, action_log_probs=old,
                              rollout_log_probs=rollout, advantages=adv, info={}))
    return out


def set_up_policy_actor(obj, model_dir, *, gas=4, micro=2, seed=0, checkpoint_states=None, **args_kw):
    """What ``PolicyModelActor.init_model_from_pretrained`` sets up, on the CPU: a real ``Actor`` loaded from
    ``model_dir`` (fp32 master weights, the :class:`CPUEngine`), a real ``DeepspeedStrategy`` and a real
    ``ActorPPOTrainer``; then the hook's ``_install_triage`` when ``obj`` has it.  ``torch.distributed`` must be
    initialised (OpenRLHF calls barrier / all_reduce)."""
    import torch.distributed as dist
    from openrlhf.models import Actor
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    args = openrlhf_args(**args_kw)
    strategy = DeepspeedStrategy(seed=seed, micro_train_batch_size=micro, train_batch_size=micro * gas,
                                 zero_stage=2, args=args)
    strategy.world_size, strategy.accumulated_gradient = dist.get_world_size(), gas   # setup_distributed's
    actor = Actor(str(model_dir), attn_implementation="eager", param_dtype="bf16")
    actor.model.float()
    optim = torch.optim.SGD(actor.model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    actor.model = CPUEngine(actor.model, optim, sched, gas)
    obj.strategy, obj.actor, obj.actor_optim, obj.actor_scheduler = strategy, actor, optim, sched
    with cpu_cuda(0):
        obj.trainer = ActorPPOTrainer(strategy, actor, ema_model=None, actor_optim=optim, actor_scheduler=sched,
                                      micro_train_batch_size=micro, dataloader_pin_memory=False)
    obj.checkpoint_states = checkpoint_states or {}                       # what load_ckpt restored
    if hasattr(obj, "_install_triage"):
        obj._install_triage()
    return obj


def fit(obj, exps, seed=0):
    """Hand ``exps`` to the actor as the experience maker does (one right-padded batch, ``append``) and run
    ``PolicyModelActor.fit`` (→ ``ppo_train`` → ``training_step`` per micro-batch); returns its status."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    obj.trainer.replay_buffer.append(Experience.concat_experiences(exps, pad_token_id=0))
    torch.manual_seed(seed)                                                # DataLoader shuffle order
    with cpu_cuda("cpu"):
        return obj.fit(kl_ctl=0.0)


def ray_actor_run(obj, model_dir, fits=2, seed=0, amplify=0.0):
    """Run inside a Ray policy actor (``actor.__ray_call__``): join the actors' gloo group from the
    MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE that OpenRLHF's ``BaseDistributedActor`` set, set up on the CPU,
    ``fits`` fits of 16 samples (this rank's own; :func:`experiences`' ``amplify``), close the hook; returns
    (pid, statuses, what this actor's monitor was built with: rank, alert rule names, trackers)."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    set_up_policy_actor(obj, model_dir)
    exps = experiences(obj.actor, n=16, seed=seed + 100 * dist.get_rank(), amplify=amplify)
    statuses = [fit(obj, exps, seed=k) for k in range(fits)]
    mon = obj.triage_loss.monitor
    info = {"rank": mon.rank, "rules": None if mon.alerts is None else [r.name for r in mon.alerts.rules],
            "loggers": [(type(lg).__name__, lg.keys) for lg in mon.loggers]}
    obj.triage_loss.close()
    return os.getpid(), statuses, info
