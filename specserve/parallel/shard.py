"""Shard a loaded `DecoderModel` in place for rank r of N (Megatron / gpt-fast layout).

Per layer: q/k/v and gate/up column-parallel (each rank its heads / its slice of the
intermediate), o_proj and down_proj row-parallel (each rank the matching input columns; their
biases on rank 0 only, so the all-reduce adds them once). One all-reduce after attention and one
after the MLP (`lean.layer_inference`'s `reduce`). Key/value heads: with Hkv ≥ N each rank
holds Hkv / N of them; with Hkv < N (N a multiple of Hkv) each rank holds the one kv head its
query heads read — kv heads replicated over N / Hkv ranks, as transformers' and vLLM's TP do.
q/k RMSNorm weights (per head_dim) are replicated. Embedding and final norm are replicated; the
LM head is vocab-parallel (rows of the vocabulary, padded with zero rows up to a multiple of N;
`DecoderModel.logits` all-gathers and trims). `model.config` keeps the full model's shape; the
local head counts are the attention modules' `num_heads` / `num_kv_heads`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ShardPlan:
    world: int
    heads: int  # query heads per rank
    kv_heads: int  # kv heads per rank (1 when replicated)
    intermediate: int  # MLP intermediate per rank
    vocab: int  # LM-head rows per rank (padded vocab / world)

    def q_heads(self, rank: int) -> range:
        return range(rank * self.heads, (rank + 1) * self.heads)

    def kv_head_start(self, rank: int, total_kv: int) -> int:
        if total_kv >= self.world:
            return rank * self.kv_heads
        return rank * total_kv // self.world  # the group of this rank's query heads


def plan_for(cfg, world: int) -> ShardPlan:
    """Per-rank sizes for `world` ranks (ValueError where the model does not split)."""
    if world < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {world}")
    hq, hkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if hq % world:
        raise ValueError(f"tensor_parallel={world} does not divide the {hq} attention heads")
    if hkv % world and world % hkv:
        raise ValueError(f"tensor_parallel={world} and the {hkv} key/value heads: one must "
                         "divide the other (kv heads are split, or replicated when fewer)")
    if inter % world:
        raise ValueError(f"tensor_parallel={world} does not divide intermediate_size {inter}")
    return ShardPlan(world, hq // world, max(1, hkv // world), inter // world,
                     -(-cfg.vocab_size // world))


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


def _rows(lin: nn.Linear, start: int, n: int) -> None:
    """Keep output rows [start, start + n) of `lin` (column parallel)."""
    lin.weight = _param(lin.weight[start:start + n])
    if lin.bias is not None:
        lin.bias = _param(lin.bias[start:start + n])
    lin.out_features = n


def _cols(lin: nn.Linear, start: int, n: int, rank: int) -> None:
    """Keep input columns [start, start + n) of `lin` (row parallel; bias on rank 0 only)."""
    lin.weight = _param(lin.weight[:, start:start + n])
    if lin.bias is not None and rank != 0:
        lin.bias = _param(torch.zeros_like(lin.bias))
    lin.in_features = n


@torch.no_grad()
def shard_model(model, rank: int, world: int) -> ShardPlan:
    """Slice `model`'s weights to rank `rank`'s shard of `world` (in place); returns the plan.
    Call before `fuse_projections` (or it re-fuses: the fused tensors are dropped here)."""
    cfg = model.config
    plan = plan_for(cfg, world)
    if world == 1:
        return plan
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside tensor_parallel={world}")
    model._fused = None  # the fused q/k/v, gate/up tensors hold the full weights
    d = cfg.head_dim
    q0 = plan.q_heads(rank).start * d
    kv0 = plan.kv_head_start(rank, cfg.num_kv_heads) * d
    i0 = rank * plan.intermediate
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        _rows(a.q_proj, q0, plan.heads * d)
        _rows(a.k_proj, kv0, plan.kv_heads * d)
        _rows(a.v_proj, kv0, plan.kv_heads * d)
        _cols(a.o_proj, q0, plan.heads * d, rank)
        a.num_heads, a.num_kv_heads = plan.heads, plan.kv_heads
        _rows(mlp.gate_proj, i0, plan.intermediate)
        _rows(mlp.up_proj, i0, plan.intermediate)
        _cols(mlp.down_proj, i0, plan.intermediate, rank)
    w = model.lm_head.weight  # tied: the embedding's (stays whole); the head gets its own rows
    v0, n = rank * plan.vocab, plan.vocab
    local = w.new_zeros(n, w.shape[1])
    rows = w[v0:min(v0 + n, w.shape[0])]
    local[: rows.shape[0]] = rows
    model.lm_head = nn.Linear(w.shape[1], n, bias=False, device=w.device, dtype=w.dtype)
    model.lm_head.weight = _param(local)
    return plan
