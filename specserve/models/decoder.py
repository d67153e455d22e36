"""The target model: a Qwen3 / Llama-family decoder that runs on a paged KV cache.

One class covers Qwen3 (per-head q/k RMSNorm), Llama/Mistral (no q/k norm) and Qwen2 (q/k/v bias).
The forward takes a flat ragged batch of new tokens plus an `AttnBatch` and returns hidden states;
logits are computed only for the rows asked for (`logits()`), and the hidden states of chosen
layers (the DFlash taps) are collected only when asked — nothing is kept otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.base import AttentionBackend, AttnBatch
from specserve.attention.torch_ref import torch_ref_attention
from specserve.kvcache.pool import KVPool
from specserve.models.config import ModelConfig
from specserve.models.rope import Rotary, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.window(layer)
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, d, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, D]
        batch: AttnBatch,
        kv: KVPool,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        kv.write(self.layer, batch.slot_mapping, k, v)
        o = attn(q, kv.k[self.layer], kv.v[self.layer], batch, self.scale, self.window)
        return self.o_proj(o.reshape(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, batch, kv, attn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, kv, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (HF module names under `model.`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderModel(nn.Module):
    """Causal LM over a paged KV cache. Parameter names match HF checkpoints."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        self.attn_backend: AttentionBackend = torch_ref_attention

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        batch: AttnBatch,
        kv: KVPool,
        taps: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the new tokens of `batch`; returns final-norm hidden `[T, hidden]` and, if `taps`
        names layers, their outputs concatenated `[T, len(taps) * hidden]` (else None)."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(batch.positions, x.dtype)
        tapped: dict[int, torch.Tensor] = {}
        wanted = set(taps)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, batch, kv, self.attn_backend)
            if i in wanted:
                tapped[i] = x
        features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return self.model.norm(x), features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()
