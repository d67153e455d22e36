"""Request-level value types shared by the engine, the drafters and the services.

These are plain frozen dataclasses: the services convert protobuf messages to and from them
(services/*/convert.py), so nothing here knows about the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from specserve.errors import InvalidRequest

if TYPE_CHECKING:
    from specserve.spec.metrics import StepOutcome

GREEDY_TEMPERATURE = 1e-5  # below it a request is greedy (vLLM's _SAMPLING_EPS)
# the wire's ranges (proto/specserve/v1/common.proto: int32, float, uint64, int64 fields)
INT32_MAX, INT64_MAX, UINT64_MAX = 2**31 - 1, 2**63 - 1, 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the least positive float32: a top_p below it sent as it
MAX_LOGPROBS = 20  # most alternatives a token's logprobs list (as vLLM's default cap)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request turns target logits into tokens.

    temperature below GREEDY_TEMPERATURE (0 included) means greedy (argmax): softmax(z / T) at
    such T is argmax up to rounding. top_k None means no top-k cut; top_p 1.0 means no nucleus
    cut. seed None means a fresh random seed. A stop token id (or EOS) ends the generation as
    a token (counted, with its logprob) whose text is left out; a stop string ends it and is left
    out of the text — both kept with include_stop_str_in_output (vLLM's). logprobs None: none;
    N in [0, MAX_LOGPROBS]: each generated token's log-probability under the target model, and
    the N most likely tokens'; prompt_logprobs the same for each prompt token after the first.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name),
                                                                       int | float):
                raise InvalidRequest(f"{name} must be a number, got {getattr(self, name)!r}",
                                     name)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a bool, got {getattr(self, name)!r}", name)
        if not _is_int(self.max_tokens) or not 0 < self.max_tokens <= INT32_MAX:
            raise InvalidRequest(f"max_tokens must be an integer in [1, {INT32_MAX}], got "
                                 f"{self.max_tokens!r}", "max_tokens")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise InvalidRequest(f"temperature must be in [0, {FLOAT32_MAX:.4g}], got "
                                 f"{self.temperature!r}", "temperature")
        if self.top_k is not None and (not _is_int(self.top_k)
                                       or not 0 < self.top_k <= INT32_MAX):
            raise InvalidRequest(f"top_k must be an integer in [1, {INT32_MAX}] or None, got "
                                 f"{self.top_k!r}", "top_k")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not 0 <= self.seed <= UINT64_MAX):
            raise InvalidRequest(f"seed must be an integer in [0, 2**64), got {self.seed!r}",
                                 "seed")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty", "stop")
        if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise InvalidRequest(
                f"stop_token_ids must be integers in [0, 2**63): {self.stop_token_ids!r}",
                "stop_token_ids")

        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (type(n) is not int or not 0 <= n <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, "
                                     f"got {n!r}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class FinishReason(StrEnum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens (admission makes prompt + max_tokens fit the context)
    ABORT = "abort"  # cancelled


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability under the target model (log-softmax of its raw
    logits: before temperature, top-k and top-p, as vLLM reports them by default) and the most
    likely tokens' (`top_ids`, `top_logprobs`: SamplingParams.logprobs of them, best first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request: the newly committed tokens and text.

    `error` is set when this request failed inside the engine (its sampling, commit or its part
    of the forward); it is then finished (ABORT), its pages are free and the other requests of
    the step went on."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    stats: StepOutcome | None = None  # a decode step's record (None after prefill's token)
    error: Exception | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, if the request asked
    # with the first token, if the request asked: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None
