"""The target model: a Qwen3 / Llama-family decoder that runs on a paged KV cache.

One class covers Qwen3 (per-head q/k RMSNorm), Llama/Mistral (no q/k norm) and Qwen2 (q/k/v bias).
The forward takes a flat ragged batch of new tokens plus an `AttnBatch` and returns hidden states;
logits are computed only for the rows asked for (`logits()`), and the hidden states of chosen
layers (the DFlash taps) are collected only when asked — nothing is kept otherwise.

Two forwards, same math: with autograd on, the nn.Module path (HF-shaped, trainable); with
autograd off (inference), a lean path that launches about half the kernels per layer — on an
eager GPU step the host's per-op cost, not the GPU, sets the step time. The lean path calls
F.linear / F.rms_norm directly (no module call overhead), normalises and rotates q and k of all
heads in one pass (RoPE by `roll` with the sign folded into sin: 4 kernels for q and k together
instead of 7 each), and — after `fuse_projections()` — runs q/k/v as one GEMM and gate/up as one.
Rounding follows HF: RMSNorm normalises in fp32, rounds to the activation dtype, then × weight.
On CUDA the lean path runs `fused_layer` instead: these ops fused into 3 kernels per layer.
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
from specserve.models.lean import FusedWeights, layer_inference, tap_features
from specserve.models.norm import RMSNorm, rms_norm
from specserve.models.rope import Rotary, apply_rotary


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

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
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, d, bias=cfg.o_proj_bias)
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
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
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


class FusedProjections:
    """Mixin of a model whose layers have `self_attn.{q,k,v}_proj` (+ q/k norms) and
    `mlp.{gate,up}_proj`: their fused weights (`FusedWeights`, one per layer), kept valid through
    `.to()` and weight replacement. The target (`DecoderModel`) and the DFlash drafter
    (`models/dflash.py`) share it; `fused_layer.py` runs their layers on it."""

    _fused: list[FusedWeights | None] | None = None

    def fusable_layers(self) -> nn.ModuleList:
        raise NotImplementedError

    def fuse_projections(self) -> None:
        """Store each layer's q/k/v weights (and biases) as one tensor, and gate/up as one, so
        the inference forward runs 4 GEMMs per layer instead of 7. Idempotent.

        The nn.Linear parameters become views of the fused tensors: names, shapes, values and
        `state_dict()` keys are unchanged and in-place updates reach the fused weights, but the
        q/k/v (gate/up) state-dict tensors then share storage (clone them before
        `safetensors.save_file`). `.to()` / `.half()` re-fuse; if the weights are replaced any
        other way, the next inference forward sees it (data pointers) and re-fuses.
        """
        layers = self.fusable_layers()
        if self._fused is None:
            self._fused = [None] * len(layers)
        with torch.inference_mode(False), torch.no_grad():
            for i, layer in enumerate(layers):
                if self._fused[i] is None or not self._fused[i].valid(layer):
                    self._fused[i] = None  # let the old tensors go before the new ones exist
                    self._fused[i] = FusedWeights(layer)

    def _apply(self, fn, recurse=True):
        fused, self._fused = getattr(self, "_fused", None), None  # old fused tensors can go
        out = super()._apply(fn, recurse)  # as each parameter is converted
        if fused is not None:
            self.fuse_projections()
        return out

    def fused_layer(self, i: int) -> FusedWeights | None:
        """Layer i's fused weights (None before `fuse_projections`); fused again first if the
        weights were replaced since."""
        f = self._fused[i] if self._fused is not None else None
        if f is not None and not f.valid(self.fusable_layers()[i]):
            self.fuse_projections()
            f = self._fused[i]
        return f


class DecoderModel(FusedProjections, nn.Module):
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
        # tensor parallel (`specserve.parallel`): this rank's group once the weights are
        # sharded (`parallel.shard.shard_model`); None = the whole model here
        self.tp = None

    def fusable_layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        batch: AttnBatch,
        kv: KVPool,
        taps: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the new tokens of `batch`; returns final-norm hidden `[T, hidden]` and, if `taps`
        names layers, their outputs concatenated `[T, len(taps) * hidden]` (else None)."""
        if not torch.is_grad_enabled():
            return self._forward_inference(input_ids, batch, kv, taps)
        if self.tp is not None:
            raise RuntimeError("a tensor-parallel shard runs inference only (autograd off)")
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(batch.positions, x.dtype)
        tapped: dict[int, torch.Tensor] = {}
        wanted = set(taps) - {len(self.model.layers) - 1}  # the last one: after the final norm
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, batch, kv, self.attn_backend)
            if i in wanted:
                tapped[i] = x
        normed = self.model.norm(x)
        return normed, tap_features(tapped, taps, normed)

    def _forward_inference(self, input_ids, batch, kv, taps):
        """The same function as the module path with about half the kernel launches (module
        docstring); one python loop over layers, nothing recomputed per layer that is per step.
        On CUDA: the same math with each layer's small ops in 3 Triton kernels (fused_layer)."""
        reduce = self.tp.all_reduce if self.tp is not None else None
        if input_ids.is_cuda and reduce is None:  # tensor parallel: the lean path (below)
            from specserve.models.fused_layer import forward_fused

            return forward_fused(self, input_ids, batch, kv, taps)
        backbone, attn_fn = self.model, self.attn_backend
        x = F.embedding(input_ids, backbone.embed_tokens.weight)
        cos, sin = self.rotary.rolled_tables(batch.positions, x.dtype)  # [T, 1, D], once
        tapped: dict[int, torch.Tensor] = {}
        wanted = set(taps) - {len(backbone.layers) - 1}  # the last one: after the final norm
        for i, layer in enumerate(backbone.layers):
            x = layer_inference(layer, self.fused_layer(i), x, cos, sin, batch, kv, attn_fn,
                                 reduce)
            if i in wanted:
                tapped[i] = x
        norm = backbone.norm
        normed = rms_norm(x, norm.weight, norm.eps)
        return normed, tap_features(tapped, taps, normed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        if self.tp is not None:  # vocab-parallel head: every rank's rows, padding trimmed
            local = F.linear(hidden, self.lm_head.weight)
            return self.tp.all_gather_last(local)[:, : self.config.vocab_size].float()
        return self.lm_head(hidden).float()
