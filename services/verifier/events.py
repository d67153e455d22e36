"""What the step loop hands the asyncio side: a request's per-step events and the loop's stats.
No grpc here."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.spec.metrics import RequestSpecStats, StepRecord
from specserve.types import RequestOutput


@dataclass(frozen=True)
class StepEvent:
    """What one step committed for one request."""

    output: RequestOutput
    step: StepRecord | None  # None for the token sampled at the end of prefill
    stats: RequestSpecStats | None = None  # a snapshot, on the request's final event only


@dataclass(frozen=True)
class LoopStats:
    pages_used: int
    pages_free: int
    pages_total: int
    pages_reserved: int  # promised to running requests (used ≤ reserved ≤ total)
    preempted: int  # requests preempted since start (recomputed later)
    active: int
    waiting: int
    fallbacks: dict[str, int]  # fallback kind (metrics.FALLBACK_KINDS) -> steps, since start
    steps: int
    max_model_len: int  # the longest prompt + max_tokens a request may have
