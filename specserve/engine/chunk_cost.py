"""What a prefill chunk costs, in tokens at context 0: how the scheduler sizes the chunks that
ride beside decoding requests (`EngineConfig.mixed_chunks`: "cost" or "flops").

A chunk of n tokens from position s costs its weights' FLOPs (n tokens' worth) plus, in each
layer, its attention's FLOPs over the keys its tokens attend (a token at position p attends
p + 1 keys, at most the layer's sliding window). Counted in tokens at context 0:

    cost(n, s) = n + Σ_layers keys_l(n, s) / (L · scale)

with `scale` the keys at which a token's attention costs as much as its weights (a layer's
weight FLOPs per token 2·P over its attention FLOPs per key 4·Hq·D; 23.6k for the
Qwen3-8B body). At 128k context an 8192-token chunk costs about 6× one at context 0, and the
decoding requests in its step wait for all of it: beside them, a chunk is cut to the cost of
`max_num_batched_tokens` tokens at context 0, so their steps stay about as long at any
context.

A FLOP of attention over a long prefix takes longer than a FLOP of the weights' GEMMs (the
attention kernels run further below their peak), so with "cost" the attention term is
weighted by κ, measured (`AttentionRate`): a least-squares fit of the forwards that carried
prefill chunks, seconds ≈ c + α·rows + β·attention, with κ = β/α (1 — FLOPs at par, the
"flops" mode — until those forwards tell the two apart). No torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

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

    def __call__(self, n: int, start: int, weight: float = 1.0) -> float:
        """The chunk's cost, its attention's part weighted by `weight` (κ)."""
        return n + weight * self.attention(n, start)

    def attention(self, n: int, start: int) -> float:
        """The chunk's attention FLOPs, in tokens' weights at context 0."""
        keys = sum(k * _keys(n, start, w) for w, k in self.windows)
        return keys / (sum(k for _, k in self.windows) * self.scale)

    def tokens_within(self, start: int, budget: float, most: int, weight: float = 1.0) -> int:
        """The most tokens (≤ `most`) a chunk from `start` can take for at most `budget`."""
        lo, hi = 0, most
        while lo < hi:  # cost grows with n
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self(mid, start, weight) <= budget else (lo, mid - 1)
        return lo


# the attention rate's fit: sample weight decay; forwards before a fit; the least eigenvalue of
# the regressors' normalized Gram matrix below which they are too alike to tell apart; κ's range;
# a forward this many times slower than the fit predicts is a one-off (a plan built, a compile)
DECAY = 0.98
MIN_SAMPLES = 6
MIN_SPREAD = 1e-3
WEIGHT_RANGE = (0.25, 8.0)
SPIKE = 1.5


@dataclass
class AttentionRate:
    """κ, from the forwards that carried prefill chunks: decayed least squares of their seconds
    on (1, rows, attention) — the step's fixed part, its rows (trees and chunks: weights), its
    chunks' attention (`ChunkCost.attention`). κ = β/α once the samples tell the three apart
    and both are positive, clamped to WEIGHT_RANGE; until then the last such κ (first 1). A
    forward SPIKE × slower than the fit says is not booked, unless the one before was not
    either (then the rate itself moved)."""

    decay: float = DECAY
    gram: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))  # Σ w·x·xᵀ
    moment: np.ndarray = field(default_factory=lambda: np.zeros(3))  # Σ w·x·t
    samples: int = 0  # forwards booked
    forwards: int = 0  # forwards observed
    weight: float = 1.0
    spiked: bool = False  # the last forward was not booked

    def observe(self, rows: float, attention: float, seconds: float) -> None:
        x, self.forwards = np.array([1.0, rows, attention]), self.forwards + 1
        fit = self.fit()
        if fit is not None and seconds > SPIKE * float(fit @ x) and not self.spiked:
            self.spiked = True
            return
        self.spiked = False
        self.gram = self.decay * self.gram + np.outer(x, x)
        self.moment = self.decay * self.moment + x * seconds
        self.samples += 1
        fit = self.fit()
        if fit is not None and fit[1] > 0 and fit[2] > 0:
            self.weight = float(np.clip(fit[2] / fit[1], *WEIGHT_RANGE))

    def fit(self) -> np.ndarray | None:
        """(c, α, β), or None while the samples cannot tell them apart."""
        if self.samples < MIN_SAMPLES or np.any(np.diag(self.gram) <= 0):
            return None
        norm = 1.0 / np.sqrt(np.diag(self.gram))
        if np.linalg.eigvalsh(self.gram * np.outer(norm, norm))[0] < MIN_SPREAD:
            return None
        return np.linalg.solve(self.gram, self.moment)


def _keys(n: int, start: int, window: int | None) -> int:
    """Σ over positions p in [start, start + n) of the keys p attends: min(p + 1, window)."""
    grow_end = start + n if window is None else min(start + n, max(start, window))
    grown = grow_end - start  # positions still below the window: p + 1 keys each
    full = n - grown
    return grown * (start + 1 + grow_end) // 2 + full * (window or 0)
