"""What a prefill chunk costs, in tokens at context 0: how the scheduler sizes the chunks that
ride beside decoding requests (`EngineConfig.mixed_chunks = "cost"`).

A chunk of n tokens from position s costs its weights' FLOPs (n tokens' worth) plus, in each
layer, its attention's FLOPs over the keys its tokens attend (a token at position p attends
p + 1 keys, at most the layer's sliding window). Counted in tokens at context 0:

    cost(n, s) = n + Σ_layers keys_l(n, s) / (L · scale)

with `scale` the keys at which a token's attention costs as much as its weights (a layer's
weight FLOPs per token 2·P over its attention FLOPs per key 4·Hq·D; 23.6k for the
Qwen3-8B body). At 128k context an 8192-token chunk costs about 6× one at context 0, and the
decoding requests in its step wait for all of it: beside them, a chunk is cut to the cost of
`max_num_batched_tokens` tokens at context 0, so their steps stay about as long at any
context. Pure Python (the scheduler's), no torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

# beside decoding requests a step's first chunk takes at least 1/MIN_SHARE of the token budget,
# whatever its cost (a model whose attention dwarfs its weights still makes progress)
MIN_SHARE = 16


@dataclass(frozen=True)
class ChunkCost:
    scale: float  # keys at which a token's attention FLOPs equal its weights' FLOPs
    # (sliding window or None for full attention, how many layers have it)
    windows: tuple[tuple[int | None, int], ...]

    def __post_init__(self) -> None:
        if not self.scale > 0 or not self.windows or any(k <= 0 for _, k in self.windows):
            raise ValueError(f"need scale > 0 and layers, got {self.scale}, {self.windows}")

    @classmethod
    def of(cls, cfg) -> ChunkCost:
        """From a `ModelConfig`: weights per layer (q|k|v, o, gate|up|down) and its heads."""
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        weights = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
        layers = Counter(cfg.window(i) for i in range(cfg.num_layers))
        return cls(weights / (2 * q), tuple(layers.items()))

    def __call__(self, n: int, start: int) -> float:
        keys = sum(k * _keys(n, start, w) for w, k in self.windows)
        return n + keys / (sum(k for _, k in self.windows) * self.scale)

    def tokens_within(self, start: int, budget: float, most: int) -> int:
        """The most tokens (≤ `most`) a chunk from `start` can take for at most `budget`."""
        lo, hi = 0, most
        while lo < hi:  # cost grows with n
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self(mid, start) <= budget else (lo, mid - 1)
        return lo


def _keys(n: int, start: int, window: int | None) -> int:
    """Σ over positions p in [start, start + n) of the keys p attends: min(p + 1, window)."""
    grow_end = start + n if window is None else min(start + n, max(start, window))
    grown = grow_end - start  # positions still below the window: p + 1 keys each
    full = n - grown
    return grown * (start + 1 + grow_end) // 2 + full * (window or 0)
