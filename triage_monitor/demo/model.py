"""The demo policy: a tiny causal transformer (nanoGPT-style) with a KV cache.

Pre-norm blocks of multi-head causal self-attention and a GELU MLP
(``mlp.fc``: d → 4d, ``mlp.proj``: 4d → d).  The MLP projections are
:class:`~triage_monitor.demo.nvfp4.NVFP4Linear` layers, so a numeric recipe can be
switched per computation path (sampler vs learner) with
:func:`~triage_monitor.demo.nvfp4.use_recipe`; attention, norms, embeddings and
the LM head stay in full precision, as in the published native-NVFP4 runs
(docs/metrics.md#nvfp4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .nvfp4 import quantize_linears_

Tensor = torch.Tensor
LayerKV = tuple[Tensor, Tensor]  # one layer's (k, v), each (B, heads, T_cached, head_dim)
KVCache = list[LayerKV]  # per layer: (k, v)


class LayerOutput(NamedTuple):
    """An attention layer's or block's output ``(B, T, d_model)`` and its layer's updated ``(k, v)`` cache."""

    out: Tensor
    kv: LayerKV


class GPTOutput(NamedTuple):
    """:class:`TinyGPT`'s forward: logits ``(B, T, vocab)`` float32 and the updated per-layer KV cache."""

    logits: Tensor
    cache: KVCache


@dataclass
class GPTConfig:
    """Size of the demo policy (``d_model`` and ``4·d_model`` must be multiples of 16 for NVFP4)."""

    vocab_size: int = 14
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    #: glob patterns of the linears made NVFP4-capable (default: the MLP projections)
    quantized: tuple = ("blocks.*.mlp.*",)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor, cache: Optional[LayerKV]) -> LayerOutput:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        # new queries sit at the end: causal among themselves, full view of the cache
        if T == 1:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return LayerOutput(self.proj(y.transpose(1, 2).reshape(B, T, C)), (k, v))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x: Tensor, cache: Optional[LayerKV]) -> LayerOutput:
        a, kv = self.attn(self.ln1(x), cache)
        x = x + a
        return LayerOutput(x + self.mlp(self.ln2(x)), kv)


class TinyGPT(nn.Module):
    """Causal LM over ``cfg.vocab_size`` tokens; MLP projections are NVFP4-capable.

    ``forward(idx (B, T) int64, cache=None)`` returns a :class:`GPTOutput`: logits ``(B, T, vocab)``
    float32 and the updated KV cache (list of per-layer ``(k, v)``); with a
    cache, ``idx`` holds only the new tokens and positions continue after
    the cached ones.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % 16 or cfg.d_model % cfg.n_head:
            raise ValueError(f"GPTConfig.d_model = {cfg.d_model} must be a multiple of 16 and of n_head = {cfg.n_head}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        self.quantized = quantize_linears_(self, tuple(cfg.quantized))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor, cache: Optional[KVCache] = None) -> GPTOutput:
        past = 0 if cache is None else cache[0][0].shape[2]
        T = idx.shape[1]
        if past + T > self.cfg.block_size:
            raise ValueError(f"TinyGPT: sequence length {past + T} exceeds block_size {self.cfg.block_size}")
        x = self.tok(idx) + self.pos(torch.arange(past, past + T, device=idx.device))
        new_cache = []
        for i, blk in enumerate(self.blocks):
            x, c = blk(x, None if cache is None else cache[i])
            new_cache.append(c)
        return GPTOutput(self.head(self.ln_f(x)).float(), new_cache)
