"""The gateway's prompt tokenization (and /detokenize's long decodes), kept off its event loop.

A short text is encoded inline. A long one goes to one worker process: HF `tokenizers` holds
the GIL through much of a long encode, so in a thread of this process it stalls the event loop
— every other request's stream, `/health` and the health checks — for as long as it runs (a
4 MB prompt: seconds). One worker bounds what long prompts can take: they queue there, and
short prompts never wait for them. A worker that dies is replaced; the prompt it held is encoded
in a thread instead (correct, only slower for the others).

`shared` is what requests call: requests with the same text (the choices of one HTTP request)
wait for one encoding; an encoding nobody waits for any more (its clients gone or out of time)
is cancelled, so a queued long prompt whose client left is never encoded; a wait past the
request's deadline raises DeadlineExceeded.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from specserve.errors import DeadlineExceeded
from specserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

INLINE_CHARS = 16_384  # longer texts are encoded in the worker process

_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_dir: str) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the gateway, which closes us
    _worker_tokenizer = Tokenizer.from_dir(model_dir)


def _with_tokenizer(fn, *args):
    return fn(_worker_tokenizer, *args)


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    return tokenizer.encode(text, add_special_tokens)


class PromptEncoder:
    """`encode(text, add_special_tokens)` → token ids, the event loop free while a long text is
    encoded."""

    def __init__(self, tokenizer: Tokenizer, model_dir: str | None,
                 inline_chars: int = INLINE_CHARS) -> None:
        self.tokenizer, self.model_dir, self.inline_chars = tokenizer, model_dir, inline_chars
        self._pool: ProcessPoolExecutor | None = None
        # (text, add_special_tokens) -> [its encoding task, requests waiting]
        self._shared: dict[tuple[str, bool], list] = {}

    async def shared(self, text: str, timeout_s: float, add_special_tokens: bool = False
                     ) -> list[int]:
        """`encode(text, add_special_tokens)`, one encoding for every request waiting on the
        same; cancelled when the last of them stops waiting. Raises DeadlineExceeded after
        `timeout_s`."""
        key = (text, add_special_tokens)
        entry = self._shared.get(key)
        if entry is None:
            entry = self._shared[key] = [
                asyncio.ensure_future(self.encode(text, add_special_tokens)), 0]
            entry[0].add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        entry[1] += 1
        try:
            return list(await asyncio.wait_for(asyncio.shield(entry[0]), max(timeout_s, 0.0)))
        except TimeoutError:
            raise DeadlineExceeded("the request's deadline passed while its prompt was being "
                                   "tokenized (the client's timeout, else the gateway's "
                                   "--request-timeout-s)") from None
        finally:
            entry[1] -= 1
            if entry[1] == 0:  # the last waiter leaves: a queued encode is dropped
                entry[0].cancel()
                del self._shared[key]

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text`'s ids (`add_special_tokens`: the tokenizer's own, e.g. a BOS, as transformers'
        `tokenizer(text)` adds them)."""
        if not isinstance(text, str) or len(text) <= self.inline_chars:
            return self.tokenizer.encode(text, add_special_tokens)
        return await self.run(_encode, text, add_special_tokens)

    async def run(self, fn, *args):
        """`fn(tokenizer, *args)` in the worker process (`fn` a module's function; its
        arguments, result and exceptions pickle), inline when there is none."""
        if self.model_dir is None:
            return fn(self.tokenizer, *args)
        try:
            return await asyncio.wrap_future(self._worker().submit(_with_tokenizer, fn, *args))
        except BrokenProcessPool:
            log.warning("prompt tokenizer process died; doing its work in a thread")
            self._pool = None
            return await asyncio.to_thread(fn, self.tokenizer, *args)

    def _worker(self) -> ProcessPoolExecutor:
        if self._pool is None:  # spawned: a fork would copy gRPC's threads' state
            self._pool = ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(self.model_dir,))
        return self._pool

    def start(self) -> None:
        """Start the worker now (it imports and loads the tokenizer: about a second), so the
        first long prompt does not wait for it."""
        if self.model_dir is not None:
            self._worker().submit(_with_tokenizer, _encode, "warm")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
