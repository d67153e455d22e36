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
from specserve.models.rope import Rotary, apply_rotary, apply_rotary_rolled


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm — `weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)` — in 2 kernels:
    F.rms_norm without a weight computes in fp32 and rounds once to x's dtype (bitwise the HF
    value on the CPU; a fused kernel on CUDA), then the weight multiply rounds as HF's does."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight


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


class _Fused:
    """One layer's fused weights. q/k/v and gate/up: the nn.Linear weights are views into them.
    q/k norm: a `[Hq + Hkv, D]` copy of the two weights stacked per head (tiny), so all heads
    are scaled in one multiply; it is rebuilt when either weight changes (`_version`)."""

    __slots__ = ("qkv_w", "qkv_b", "gate_up_w", "gate_up_b", "qk_norm_w", "ptrs")

    def __init__(self, layer: DecoderLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [m._parameters for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.qkv_w = _fuse(qkv, "weight")
        self.qkv_b = _fuse(qkv, "bias") if all(p["bias"] is not None for p in qkv) else None
        gate_up = [mlp.gate_proj._parameters, mlp.up_proj._parameters]
        self.gate_up_w = _fuse(gate_up, "weight")
        self.gate_up_b = _fuse(gate_up, "bias") if all(p["bias"] is not None
                                                        for p in gate_up) else None
        self.qk_norm_w = None
        if attn.q_norm is not None and attn.q_norm.eps == attn.k_norm.eps:
            self.qk_norm_w = torch.cat([
                attn.q_norm.weight.detach().expand(attn.num_heads, attn.head_dim),
                attn.k_norm.weight.detach().expand(attn.num_kv_heads, attn.head_dim)])
        self.ptrs = _ptrs(layer)

    def valid(self, layer: DecoderLayer) -> bool:
        return _ptrs(layer) == self.ptrs


def _fuse(params: list[dict], name: str) -> torch.Tensor:
    """Concatenate `name` of each module (dim 0) and make each module's parameter a view of the
    result (same values; memory is freed as the old tensors go)."""
    fused = torch.cat([p[name].detach() for p in params])
    row = 0
    for p in params:
        n = p[name].shape[0]
        p[name].data = fused[row : row + n]
        row += n
    return fused


def _ptrs(layer: DecoderLayer) -> tuple[int, ...]:
    """Where the fused tensors' sources live now (and the q/k norm weights' versions)."""
    attn, mlp = layer.self_attn._modules, layer.mlp._modules
    out = []
    for m in (attn["q_proj"], attn["k_proj"], attn["v_proj"], mlp["gate_proj"], mlp["up_proj"]):
        for t in m._parameters.values():
            out.append(-1 if t is None else t.data_ptr())
    for name in ("q_norm", "k_norm"):
        m = attn.get(name)  # absent (a plain None attribute) without q/k norm
        if m is not None:
            w = m._parameters["weight"]
            out += (w.data_ptr(), w._version)
    return tuple(out)


class FusedProjections:
    """Mixin of a model whose layers have `self_attn.{q,k,v}_proj` (+ q/k norms) and
    `mlp.{gate,up}_proj`: their fused weights (`_Fused`, one per layer), kept valid through
    `.to()` and weight replacement. The target (`DecoderModel`) and the DFlash drafter
    (`models/dflash.py`) share it; `fused_layer.py` runs their layers on it."""

    _fused: list[_Fused | None] | None = None

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
                    self._fused[i] = _Fused(layer)

    def _apply(self, fn, recurse=True):
        fused, self._fused = getattr(self, "_fused", None), None  # old fused tensors can go
        out = super()._apply(fn, recurse)  # as each parameter is converted
        if fused is not None:
            self.fuse_projections()
        return out

    def fused_layer(self, i: int) -> _Fused | None:
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
        if input_ids.is_cuda:
            from specserve.models.fused_layer import forward_fused

            return forward_fused(self, input_ids, batch, kv, taps)
        backbone, attn_fn = self.model, self.attn_backend
        x = F.embedding(input_ids, backbone.embed_tokens.weight)
        cos, sin = self.rotary.rolled_tables(batch.positions, x.dtype)  # [T, 1, D], once
        tapped: dict[int, torch.Tensor] = {}
        wanted = set(taps) - {len(backbone.layers) - 1}  # the last one: after the final norm
        for i, layer in enumerate(backbone.layers):
            x = _layer_inference(layer, self.fused_layer(i), x, cos, sin, batch, kv, attn_fn)
            if i in wanted:
                tapped[i] = x
        norm = backbone.norm
        normed = rms_norm(x, norm.weight, norm.eps)
        return normed, tap_features(tapped, taps, normed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()


def tap_features(tapped: dict[int, torch.Tensor], taps: Sequence[int],
                 normed: torch.Tensor) -> torch.Tensor | None:  # [T, len(taps) * hidden]
    """The drafter's context features: each tapped layer's output, but the last layer's after
    the final norm — transformers' `hidden_states[L]`, which DFlash reads for tap L − 1 (and its
    checkpoints were trained on). `tapped` holds every tap but the last layer's."""
    if not taps:
        return None
    return torch.cat([tapped.get(i, normed) for i in taps], dim=-1)


def _layer_inference(layer: DecoderLayer, f: _Fused | None, x, cos, sin, batch, kv, attn_fn):
    a, mlp = layer.self_attn, layer.mlp
    t, hq, hkv, d = x.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
    ln = layer.input_layernorm
    h = rms_norm(x, ln.weight, ln.eps)
    if f is not None:  # one GEMM for q, k and v
        qk, v = F.linear(h, f.qkv_w, f.qkv_b).split([(hq + hkv) * d, hkv * d], dim=1)
        qk, v = qk.view(t, hq + hkv, d), v.view(t, hkv, d)
    else:
        qk = torch.cat([F.linear(h, a.q_proj.weight, a.q_proj.bias).view(t, hq, d),
                        F.linear(h, a.k_proj.weight, a.k_proj.bias).view(t, hkv, d)], dim=1)
        v = F.linear(h, a.v_proj.weight, a.v_proj.bias).view(t, hkv, d)
    if f is not None and f.qk_norm_w is not None:  # q and k heads: one norm, one multiply
        qk = F.rms_norm(qk, (d,), eps=a.q_norm.eps) * f.qk_norm_w
    elif a.q_norm is not None:  # unfused: one normalisation, then each weight
        normed = F.rms_norm(qk, (d,), eps=a.q_norm.eps)
        if a.k_norm.eps != a.q_norm.eps:  # never in practice (one config value): k's own eps
            normed[:, hq:] = F.rms_norm(qk[:, hq:], (d,), eps=a.k_norm.eps)
        qk = normed
        qk[:, :hq].mul_(a.q_norm.weight)
        qk[:, hq:].mul_(a.k_norm.weight)
    q, k = apply_rotary_rolled(qk, cos, sin).split([hq, hkv], dim=1)  # all heads, one pass
    kv.write(a.layer, batch.slot_mapping, k, v)
    o = attn_fn(q, kv.k[a.layer], kv.v[a.layer], batch, a.scale, a.window)
    x = x + F.linear(o.reshape(t, hq * d), a.o_proj.weight, a.o_proj.bias)
    ln = layer.post_attention_layernorm
    h = rms_norm(x, ln.weight, ln.eps)
    if f is not None:  # one GEMM for gate and up
        g, u = F.linear(h, f.gate_up_w, f.gate_up_b).chunk(2, dim=1)
    else:
        g = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
        u = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
    return x + F.linear(F.silu(g) * u, mlp.down_proj.weight, mlp.down_proj.bias)
