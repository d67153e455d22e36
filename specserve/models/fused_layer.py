"""The inference forward with each layer's small ops fused: 3 kernels (specserve/kernels/fused)
in place of the ~18 elementwise / norm / RoPE / index_copy kernels of `lean.layer_inference`.

Same math and rounding as that torch path (its CPU twin), restructured around one idea: the
residual add waits. A layer returns its MLP output and the stream before it, unadded; the next
RMSNorm kernel adds them as it reads them (`add_rms_norm`: x_new = x + residual, h = norm), so
every add of the residual stream happens inside a norm kernel — the next layer's input norm, the
post-attention norm, the final norm. A tapped layer's output is added (materialised) there, as
the drafter reads it. Per layer: input norm, q|k|v GEMM, `qk_norm_rope_kv` (q/k norm, RoPE,
K/V cache write), attention, o_proj, post-attention norm, gate|up GEMM, `silu_mul`, down GEMM
(through cuBLASLt at the row counts where that was measured faster: `down_proj`).

A layer the fused kernels do not cover — projections not fused (`fuse_projections` not called),
q and k norms with different eps, a cache dtype other than the activations' — runs the torch
layer instead. `DecoderModel._forward_inference` calls this on CUDA; tests call it anywhere
(impl="triton" under the CPU interpreter, impl="ref" for the torch ops in this structure). The
DFlash drafter runs its layers through `layer_fused` too (`DFlashDraftModel.forward_fused`:
the same module names, its own caches and windows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specserve.attention.base import AttnBatch
from specserve.kernels.fused import FusedOps, fused_ops
from specserve.kvcache.pool import KVPool
from specserve.models.lean import FusedWeights, layer_inference, tap_features

if TYPE_CHECKING:
    from specserve.models.decoder import DecoderModel


def forward_fused(
    model: DecoderModel,
    input_ids: torch.Tensor,  # [T] int64
    batch: AttnBatch,
    kv: KVPool,
    taps: Sequence[int] = (),
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:  # final-norm hidden [T, hidden], taps or None
    """`DecoderModel.forward` with autograd off, the small ops fused (`impl`: see `fused_ops`)."""
    ops = fused_ops(impl, input_ids.device)
    backbone, attn_fn = model.model, model.attn_backend
    x = F.embedding(input_ids, backbone.embed_tokens.weight)
    cos, sin = model.rotary.rolled_tables(batch.positions, x.dtype)  # [T, 1, D], once
    res = None  # pending residual: the stream is x + res
    tapped: dict[int, torch.Tensor] = {}
    wanted = set(taps) - {len(backbone.layers) - 1}  # the last one: after the final norm
    for i, layer in enumerate(backbone.layers):
        f = model.fused_layer(i)
        a = layer.self_attn
        if covered(layer, f, kv.shape.dtype, x.dtype):
            x, res = layer_fused(ops, layer, f, x, res, cos, sin, batch,
                                 (kv.k[a.layer], kv.v[a.layer]), a.window, attn_fn)
        else:
            x, res = layer_inference(layer, f, _added(x, res), cos, sin, batch, kv, attn_fn), None
        if i in wanted:
            x, res = _added(x, res), None
            tapped[i] = x
    norm = backbone.norm
    normed = ops.add_rms_norm(x, res, norm.weight, norm.eps)[0]
    return normed, tap_features(tapped, taps, normed)


def _added(x: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
    return x if res is None else x + res


def covered(layer, f: FusedWeights | None, cache_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether the fused kernels cover this layer (else it runs its torch path)."""
    a, mlp = layer.self_attn, layer.mlp
    return (f is not None and (a.q_norm is None or f.qk_norm_w is not None)
            and cache_dtype == dtype and a.o_proj.bias is None  # o / MLP biases: torch path
            and all(m.bias is None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)))


def layer_fused(ops: FusedOps, layer, f: FusedWeights, x, res, cos, sin, batch: AttnBatch,
                caches: tuple[torch.Tensor, torch.Tensor], window: int | None,
                attn_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer (a `DecoderLayer` or a DFlash drafter layer: the same module names) on the
    stream x + res, its K/V written at `batch.slot_mapping` into `caches` (k, v
    `[P, page_size, Hkv, D]`); returns (MLP output, stream after attention): the layer's
    output is their sum, left for the next norm kernel to add."""
    a, t = layer.self_attn, x.shape[0]
    ln = layer.input_layernorm
    h, x = ops.add_rms_norm(x, res, ln.weight, ln.eps)  # x: the layer's input, materialised
    qkv = F.linear(h, f.qkv_w, f.qkv_b)  # [T, (Hq + 2·Hkv)·D], bias in the GEMM
    eps = a.q_norm.eps if a.q_norm is not None else 0.0
    k_cache, v_cache = caches
    q = ops.qk_norm_rope_kv(qkv, f.qk_norm_w, cos, sin, batch.slot_mapping, k_cache, v_cache,
                            a.num_heads, a.num_kv_heads, eps)
    o = attn_fn(q, k_cache, v_cache, batch, a.scale, window)
    attn_out = F.linear(o.reshape(t, -1), a.o_proj.weight, a.o_proj.bias)
    ln = layer.post_attention_layernorm
    h, x = ops.add_rms_norm(attn_out, x, ln.weight, ln.eps)  # x + attention, normalised
    mlp_out = down_proj(ops.silu_mul(F.linear(h, f.gate_up_w)), layer.mlp.down_proj.weight)
    return mlp_out, x


# Rows for which the down projection goes through cuBLASLt: on the H200 (experiments/diag_gemm.py,
# Qwen3-8B shape, K = 12288, N = 4096) it is faster there than torch's default choice (a split-K
# kernel + its reduce), not at 17 or 128 rows; q|k|v, o and gate|up are the same either way
# (BENCHMARKS.md, "Skinny GEMMs", and "Figures formerly in source comments").
LT_DOWN_ROWS = range(64, 97)


def down_proj(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)`; on CUDA for LT_DOWN_ROWS rows through cuBLASLt (torch's preferred
    BLAS library switched for this call only — also inside CUDA-graph capture)."""
    if not x.is_cuda or x.shape[0] not in LT_DOWN_ROWS:
        return F.linear(x, weight)
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight)
    finally:
        torch.backends.cuda.preferred_blas_library(prev)
