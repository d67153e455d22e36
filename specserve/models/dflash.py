"""The DFlash block drafter in the z-lab checkpoint format (`DFlashDraftModel`).

Owns the drafter's modules with checkpoint parameter names and strict loading (`load_dflash`;
the config is `models/dflash_config.py`): the
drafter's own tensors from its directory, the embedding and LM head from the TARGET checkpoint.
The math mirrors `dflash.model.DFlashDraftModel`: context features → `hidden_norm(fc(x))`, whose
per-layer K/V (k_norm + RoPE at the context rows' absolute positions) every block query attends
to; block queries are the target embeddings of `[bonus, mask × (n−1)]`. The model does not own a
cache: context K/V come out of `context_kv`, and block attention goes through an `attend`
callback (drafters/dflash_cache.py keeps the pages). `forward_fused` is the same forward with
the layers run as the target's fused layers (models/fused_layer.py), for the drafter's graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.base import AttnBatch
from specserve.errors import ModelError
from specserve.kernels.fused import fused_ops
from specserve.models.decoder import MLP, FusedProjections, RMSNorm
from specserve.models.dflash_config import DFlashConfig, load_dflash_config, read_config_json
from specserve.models.fused_layer import covered, layer_fused
from specserve.models.loader import read_tensors, resolve_dtype, tensor_files
from specserve.models.rope import Rotary, apply_rotary

TARGET_EMBED = "model.embed_tokens.weight"
TARGET_HEAD = "lm_head.weight"
NOT_IN_CHECKPOINT = ("embed.weight", "lm_head.weight")  # taken from the target


# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], scale) -> [T, Hq, D]: one layer's
# block queries over [their request's context K/V | block K/V] (q/k normed and RoPE'd).
BlockAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, d, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """K (k_norm, RoPE) and V `[T, Hkv, D]` of rows `x [T, hidden]` (context or block)."""
        t = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attend: BlockAttention) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k, v = self.kv(x, *rope)
        o = attend(self.layer, apply_rotary(q, *rope), k, v, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, attend: BlockAttention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


# layer_kv(layer) -> (k_cache, v_cache [P, page_size, Hkv, D], batch, window): where `forward_fused`
# writes a layer's block K/V (batch.slot_mapping) and what its block attention reads.
LayerCaches = Callable[[int], tuple[torch.Tensor, torch.Tensor, AttnBatch, int | None]]


class DFlashDraftModel(FusedProjections, nn.Module):
    """The drafter; parameter names match the checkpoint (`embed`, `lm_head`: the target's)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope, cfg.head_dim)

    def fusable_layers(self) -> nn.ModuleList:
        return self.layers

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """`[T, taps * hidden]` target features → `[T, hidden]` fused context rows."""
        return self.hidden_norm(self.fc(features))

    def context_kv(
        self, layer: int, fused: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # K, V [T, Hkv, D]
        """Layer `layer`'s K/V of fused context rows `[T, hidden]` at absolute `positions [T]`."""
        cos, sin = self.rotary(positions, fused.dtype)
        return self.layers[layer].self_attn.kv(fused, cos, sin)

    def context_kv_layers(
        self, layers: Sequence[int], fused: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # K, V [len(layers), T, Hkv, D]
        """`context_kv` of several layers at once: one GEMM over their stacked k|v weights,
        one k-norm, one RoPE (the same math per element; GEMM blocking may round differently)."""
        w, b, norm_w = self._stacked_kv(tuple(layers))
        a = self.layers[layers[0]].self_attn
        t, n, h, d = fused.shape[0], len(layers), a.num_kv_heads, a.head_dim
        y = F.linear(fused, w, b).view(t, n, 2, h, d)
        k = F.rms_norm(y[:, :, 0], (d,), eps=a.k_norm.eps) * norm_w  # [T, n, Hkv, D]
        cos, sin = self.rotary(positions, fused.dtype)
        k = apply_rotary(k.reshape(t, n * h, d), cos, sin).view(t, n, h, d)
        return k.transpose(0, 1), y[:, :, 1].transpose(0, 1)

    def _stacked_kv(self, layers: tuple[int, ...]):
        """(k|v weight `[n·2·Hkv·D, hidden]`, bias or None, k-norm weights `[n, 1, D]`) of
        `layers`, rebuilt when a source tensor was replaced or changed in place (`_version`)."""
        attn = [self.layers[i].self_attn for i in layers]
        src = [t for a in attn for t in (a.k_proj.weight, a.v_proj.weight, a.k_proj.bias,
                                         a.v_proj.bias, a.k_norm.weight) if t is not None]
        stamp = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in src)
        cache = self.__dict__.setdefault("_kv_stacks", {})  # not a module attribute / buffer
        got = cache.get(layers)
        if got is None or got[0] != stamp:
            with torch.inference_mode(False), torch.no_grad():  # usable outside inference
                w = torch.cat([x for a in attn for x in (a.k_proj.weight, a.v_proj.weight)])
                b = (torch.cat([x for a in attn for x in (a.k_proj.bias, a.v_proj.bias)])
                     if attn[0].k_proj.bias is not None else None)
                norm_w = torch.stack([a.k_norm.weight for a in attn])[:, None, :]
            got = cache[layers] = (stamp, (w, b, norm_w))
        return got[1]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: BlockAttention
    ) -> torch.Tensor:  # [T] block ids, [T] positions -> [T, hidden] after the final norm
        x = self.embed(input_ids) * self.config.input_embedding_scale  # [T, hidden]
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, attend)
        return self.norm(x)

    def fused_covers(self, dtype: torch.dtype) -> bool:
        """Whether `forward_fused` covers every layer for caches and activations of `dtype`
        (fusing the projections first)."""
        self.fuse_projections()
        return all(covered(layer, self.fused_layer(i), dtype, self.fc.weight.dtype)
                   for i, layer in enumerate(self.layers))

    @torch.inference_mode()
    def forward_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layer_kv: LayerCaches,
        attn_fn, impl: str = "auto",
    ) -> torch.Tensor:  # [T] block ids, [T] positions -> [T, hidden] after the final norm
        """`forward` with each layer run as the target's fused layer (models/fused_layer.py: q|k|v
        and gate|up as one GEMM each, add + RMSNorm, q/k norm + RoPE + the block K/V write in
        one kernel, silu · up; `impl` as `specserve.kernels.fused.fused_ops`). The block K/V of
        layer i go to `layer_kv(i)`'s caches at its batch's slot mapping, and
        `attn_fn(q, k_cache, v_cache, batch, scale, window)` attends (a `BlockAttention`
        without the write). Needs `fused_covers`."""
        ops = fused_ops(impl, input_ids.device)
        x = F.embedding(input_ids, self.embed.weight) * self.config.input_embedding_scale
        cos, sin = self.rotary.rolled_tables(positions, x.dtype)  # [T, 1, D]
        res = None  # pending residual: the stream is x + res
        for i, layer in enumerate(self.layers):
            k_cache, v_cache, batch, window = layer_kv(i)
            x, res = layer_fused(ops, layer, self.fused_layer(i), x, res, cos, sin, batch,
                                 (k_cache, v_cache), window, attn_fn)
        return ops.add_rms_norm(x, res, self.norm.weight, self.norm.eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] float32
        logits = self.lm_head(hidden).float() * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


def _target_head(target_dir: Path) -> dict[str, str]:
    """Our name -> the target checkpoint's tensor name (the LM head is absent when tied)."""
    raw = read_config_json(target_dir / "config.json")
    names = {"embed.weight": TARGET_EMBED}
    if not raw.get("tie_word_embeddings", False):
        names["lm_head.weight"] = TARGET_HEAD
    return names


def load_dflash(
    draft_dir: str | Path,
    target_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> DFlashDraftModel:
    """Load a drafter strictly: every checkpoint tensor present, of the right shape, no extras."""
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    cfg = load_dflash_config(draft_dir)
    dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    own = [n for n in expected if n not in NOT_IN_CHECKPOINT]
    extra = sorted(set(tensor_files(draft_dir)) - set(own))
    if extra:
        raise ModelError(f"drafter checkpoint {draft_dir} has unexpected tensors: {extra[:8]}")
    tensors = read_tensors(draft_dir, own, dtype)
    head = _target_head(target_dir)
    target = read_tensors(target_dir, head.values(), dtype)
    tensors.update({ours: target[theirs] for ours, theirs in head.items()})
    for name, shape in expected.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ModelError(f"tensor {head.get(name, name)} has shape "
                             f"{tuple(tensors[name].shape)}, expected {shape}")
    tensors.setdefault("lm_head.weight", tensors["embed.weight"])
    model.load_state_dict(tensors, strict=True, assign=True)
    model.rotary = Rotary(cfg.rope, cfg.head_dim)  # rebuild the buffer off meta
    model = model.to(device).eval()
    if "lm_head.weight" not in head:
        model.lm_head.weight = model.embed.weight  # tied target: one tensor
    return model



class ContextProjection(nn.Module):
    """The drafter's first step alone, `hidden_norm(fc(x))`: what a verifier applies to its
    taps before they cross hosts (hidden per token instead of taps × hidden)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [T, taps·hidden] -> [T, hidden]
        return self.hidden_norm(self.fc(features))


def load_context_projection(draft_dir: str | Path, dtype: str | torch.dtype = "float32",
                            device: str | torch.device = "cpu") -> ContextProjection:
    """The `fc` and `hidden_norm` tensors of a drafter checkpoint, strictly."""
    cfg = load_dflash_config(draft_dir)
    with torch.device("meta"):
        proj = ContextProjection(cfg)
    names = [n for n, _ in proj.named_parameters()]
    proj.load_state_dict(read_tensors(draft_dir, names, resolve_dtype(dtype)), strict=True,
                         assign=True)
    return proj.to(device).eval()
