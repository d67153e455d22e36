"""Per-request state inside the engine: tokens, how many have KV in the cache, stop handling."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from specserve.types import FinishReason, SamplingParams


class Status(Enum):
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # holds a page reservation; prefilling or decoding
    FINISHED = "finished"


class TokenView(Seq[int]):
    """Prompt + output ids of one request without copying them (a 128k-token context copied per
    step costs milliseconds). Live: it sees tokens appended later; read it within the call it
    was handed to."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __getitem__(self, index):  # int → int; slice → list[int] (only the slice is copied)
        n = len(self._prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return (self._prompt[start:min(stop, n)]
                    + self._output[max(start - n, 0):max(stop - n, 0)])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self._prompt[index] if index < n else self._output[index - n]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self._prompt + self._output, dtype=dtype)


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
    drafter_kind: str | None = None  # which drafter (drafters/registry.py); None: the default
    pending_context: list = field(default_factory=list)  # tapped features not yet drafted on
    drafts: int = 0  # trees the drafter sent for it since its prefill (its state's age there)
    recompute_to: int = 0  # after a preemption: prefill again up to here (its tokens then)
    spec_stats: object | None = None  # RequestSpecStats
    prompt_logprobs: list = field(default_factory=list)  # prompt tokens' TokenLogprobs, unsent
    prompt_logprob_count: int = 0  # prompt tokens (from the second) whose logprob is known

    @property
    def ids(self) -> TokenView:
        return TokenView(self.prompt_ids, self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """Its prompt (or, after a preemption, everything it had) is not all in the cache."""
        return self.num_computed < max(len(self.prompt_ids), self.recompute_to)

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

    def text_delta(self, taken: list[int], reason: FinishReason | None
                   ) -> tuple[str, FinishReason | None]:
        """The text of newly appended `taken` tokens and the finish reason, which a stop string
        in that text turns into STOP ("" and `reason` when the engine has no tokenizer). A stop
        id that ends the request (EOS, `stop_token_ids`) is left out of the text, as vLLM's."""
        if self.detok is None:
            return "", reason
        if reason == FinishReason.STOP and taken and taken[-1] in self.stop_ids \
                and not self.params.include_stop_str_in_output:
            taken = taken[:-1]
        delta = self.detok.push(taken)
        if reason is not None:
            delta += self.detok.flush()
        if self.stopper is not None:
            delta, stopped = self.stopper.feed(delta)
            if stopped:
                return delta, FinishReason.STOP
            if reason is not None:
                delta += self.stopper.flush()
        return delta, reason
