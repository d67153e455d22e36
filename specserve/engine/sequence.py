"""Per-request state inside the engine: tokens, how many have KV in the cache, stop handling."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from specserve.types import FinishReason, SamplingParams


class Status(Enum):
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # holds a page reservation; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    max_len: int  # hard cap on prompt + output (the model's context limit)
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    detok: object | None = None  # IncrementalDetokenizer when the engine has a tokenizer
    stopper: object | None = None  # StopStringMatcher when stop strings were given
    arrival: int = 0
    budget: int = 0  # draft nodes per step (0 = plain autoregressive decoding)
    pending_context: list = field(default_factory=list)  # tapped features not yet drafted on
    spec_stats: object | None = None  # RequestSpecStats

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def reserve_tokens(self) -> int:
        """Slots this request can ever occupy (its page reservation)."""
        return min(len(self.prompt_ids) + self.params.max_tokens, self.max_len)

    def append(self, token_id: int) -> FinishReason | None:
        """Append one generated token and say whether it ends the request."""
        self.output_ids.append(token_id)
        if token_id in self.stop_ids:
            return FinishReason.STOP
        if len(self.output_ids) >= self.params.max_tokens or self.num_tokens >= self.max_len:
            return FinishReason.LENGTH
        return None
