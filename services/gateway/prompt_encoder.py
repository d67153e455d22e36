"""The gateway's prompt tokenization, kept off its event loop.

A short text is encoded inline. A long one goes to one worker process: HF `tokenizers` holds
the GIL through much of a long encode, so in a thread of this process it stalls the event loop
— every other request's stream, `/health` and the health checks — for as long as it runs (a
4 MB prompt: seconds). One worker bounds what long prompts can take: they queue there, and
short prompts never wait for them. A worker that dies is replaced; the prompt it held is encoded
in a thread instead (correct, only slower for the others).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from specserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

INLINE_CHARS = 16_384  # longer texts are encoded in the worker process

_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_dir: str) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the gateway, which closes us
    _worker_tokenizer = Tokenizer.from_dir(model_dir)


def _encode_in_worker(text: str) -> list[int]:
    return _worker_tokenizer.encode(text)


class PromptEncoder:
    """`encode(text)` → token ids, the event loop free while a long text is encoded."""

    def __init__(self, tokenizer: Tokenizer, model_dir: str | None,
                 inline_chars: int = INLINE_CHARS) -> None:
        self.tokenizer, self.model_dir, self.inline_chars = tokenizer, model_dir, inline_chars
        self._pool: ProcessPoolExecutor | None = None

    async def encode(self, text: str) -> list[int]:
        if not isinstance(text, str) or len(text) <= self.inline_chars or self.model_dir is None:
            return self.tokenizer.encode(text)
        try:
            return await asyncio.wrap_future(self._worker().submit(_encode_in_worker, text))
        except BrokenProcessPool:
            log.warning("prompt tokenizer process died; encoding this prompt in a thread")
            self._pool = None
            return await asyncio.to_thread(self.tokenizer.encode, text)

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
            self._worker().submit(_encode_in_worker, "warm")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
