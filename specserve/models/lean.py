"""The lean inference layer: one decoder layer's forward with autograd off, as
`DecoderModel` runs it off CUDA (and `fused_layer` around its fused kernels), the fused
projection weights it reads (`FusedWeights`) and the drafter's tap features.

Below both `decoder` (the modules) and `fused_layer` (the CUDA path), so neither imports the
other's internals back. `layer` is a `decoder.DecoderLayer` (attribute access only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specserve.models.norm import rms_norm
from specserve.models.rope import apply_rotary_rolled


class FusedWeights:
    """One layer's fused weights. q/k/v and gate/up: the nn.Linear weights are views into them.
    q/k norm: a `[Hq + Hkv, D]` copy of the two weights stacked per head (tiny), so all heads
    are scaled in one multiply; it is rebuilt when either weight changes (`_version`)."""

    __slots__ = ("qkv_w", "qkv_b", "gate_up_w", "gate_up_b", "qk_norm_w", "ptrs")

    def __init__(self, layer) -> None:
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

    def valid(self, layer) -> bool:
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


def _ptrs(layer) -> tuple[int, ...]:
    """Where the fused tensors' sources live now (and the q/k norm weights' versions)."""
    attn, mlp = layer.self_attn._modules, layer.mlp._modules
    out = []
    for m in (attn["q_proj"], attn["k_proj"], attn["v_proj"], mlp["gate_proj"], mlp["up_proj"]):
        for t in m._parameters.values():
            out.append(None if t is None else t.data_ptr())
    for name in ("q_norm", "k_norm"):
        m = attn.get(name)  # absent (a plain None attribute) without q/k norm
        if m is not None:
            w = m._parameters["weight"]
            out += (w.data_ptr(), w._version)
    return tuple(out)


def tap_features(tapped: dict[int, torch.Tensor], taps: Sequence[int],
                 normed: torch.Tensor) -> torch.Tensor | None:  # [T, len(taps) * hidden]
    """The drafter's context features: each tapped layer's output, but the last layer's after
    the final norm — transformers' `hidden_states[L]`, which DFlash reads for tap L − 1 (and its
    checkpoints were trained on). `tapped` holds every tap but the last layer's."""
    if not taps:
        return None
    return torch.cat([tapped.get(i, normed) for i in taps], dim=-1)


def layer_inference(layer, f: FusedWeights | None, x, cos, sin, batch, kv, attn_fn, reduce=None):
    """One layer. `reduce` (tensor parallel: the group's in-place all-reduce) sums the
    row-parallel o_proj and down_proj outputs over the ranks before each residual add."""
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
    o = F.linear(o.reshape(t, hq * d), a.o_proj.weight, a.o_proj.bias)
    x = x + (o if reduce is None else reduce(o))
    ln = layer.post_attention_layernorm
    h = rms_norm(x, ln.weight, ln.eps)
    if f is not None:  # one GEMM for gate and up
        g, u = F.linear(h, f.gate_up_w, f.gate_up_b).chunk(2, dim=1)
    else:
        g = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
        u = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
    y = F.linear(F.silu(g) * u, mlp.down_proj.weight, mlp.down_proj.bias)
    return x + (y if reduce is None else reduce(y))
