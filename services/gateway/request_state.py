"""What the gateway keeps of one request while the verifier generates it: the incremental
detokenizer (special tokens such as EOS left out of the text unless the request keeps them, as
vLLM's `skip_special_tokens`), the stop-string matcher, usage, TTFT and the stats seen so far,
and the final sent to the client. A stop string that completes mid-step ends the text, the
step's token ids and the usage at the token that completed it.
"""

from __future__ import annotations

import time
from dataclasses import replace

from services.gateway.convert import GatewayFinal, GatewayRequest, Step, VerifierFinal
from specserve.spec.metrics import RequestSpecStats
from specserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from specserve.types import FinishReason


class RequestState:
    """Per-request detokenizer, stop-string matcher, usage and the stats seen so far."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], req: GatewayRequest) -> None:
        self.req, self.prompt_ids = req, prompt_ids
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids,
                                            skip_special_tokens=not req.keep_special_tokens)
        include = req.params.include_stop_str_in_output
        self.stopper = StopStringMatcher(req.params.stop, include) if req.params.stop else None
        self.stats = RequestSpecStats()
        self.completion_tokens = 0
        self.t0 = time.perf_counter()
        self.ttft_s = 0.0
        self.final_: GatewayFinal | None = None  # what the client was sent last
        self.verifier = ""  # the replica serving it
        self.cut = False  # a stop string ended it before the verifier did

    def push(self, step: Step, at_stop_id: bool = False) -> tuple[str, Step, bool]:
        """Text for a step's tokens, the step and whether a stop string completed: then text
        and step end at the token that completed it (usage counts no token after it).
        `at_stop_id`: the step's last token is the stop id (EOS or a `stop_token_ids` id) that
        ended the request — counted, its text left out unless the request asks for it
        (include_stop_str_in_output, as vLLM's)."""
        if not self.ttft_s:
            self.ttft_s = time.perf_counter() - self.t0
        if self.completion_tokens:  # the first event is prefill's sampled token, not a step
            self.stats.record(step)  # the verifier's own stats replace these when it finishes
        elif self.req.params.prompt_logprobs is not None:  # for whoever shows their logprobs
            step = replace(step, prompt_ids=tuple(self.prompt_ids))
        at_stop_id = at_stop_id and not self.req.params.include_stop_str_in_output
        shown = len(step.token_ids) - at_stop_id  # tokens whose text is shown
        if self.stopper is None:
            self.completion_tokens += len(step.token_ids)
            return self.detok.push(step.token_ids[:shown]), step, False
        text, stopped, n = "", False, 0
        while not stopped and n < len(step.token_ids):  # token by token: where it stops
            n += 1
            piece = self.detok.push(step.token_ids[n - 1:n]) if n <= shown else ""
            delta, stopped = self.stopper.feed(piece)
            text += delta
        self.completion_tokens += n
        return text, replace(step, token_ids=step.token_ids[:n],
                             logprobs=step.logprobs[:n]), stopped

    def tail(self) -> tuple[str, bool]:
        """Held-back text at the end of generation."""
        text, stopped = self._stop(self.detok.flush())
        if self.stopper is not None and not stopped:
            text += self.stopper.flush()
        return text, stopped

    def _stop(self, delta: str) -> tuple[str, bool]:
        return (delta, False) if self.stopper is None else self.stopper.feed(delta)

    def final(self, reason: FinishReason | None, v: VerifierFinal | None) -> GatewayFinal:
        """The verifier's usage and stats when it finished the request, ours when we cut it."""
        wall = time.perf_counter() - self.t0
        stats, prompt, completion = (self.stats, len(self.prompt_ids), self.completion_tokens) \
            if v is None else (v.stats, v.prompt_tokens, v.completion_tokens)
        phases = stats.prefill_s + stats.draft_s + stats.verify_s + stats.commit_s
        self.final_ = GatewayFinal(reason, prompt, completion, stats, max(0.0, wall - phases),
                                   self.req.request_id, self.ttft_s, wall, self.verifier)
        return self.final_
