"""The gateway's prompt tokenization (services/gateway/prompt_encoder.py): long texts are encoded
in a worker process (a thread would hold this process's GIL, stalling every other request),
with the same ids as inline; a dead worker is replaced and its prompt still encoded."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from services.gateway.prompt_encoder import PromptEncoder
from specserve.errors import InvalidRequest
from specserve.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo-target"
TEXT = "The cat sat on the mat; 17 dogs ran past, and a bird sang. "


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO)


@pytest.mark.asyncio
async def test_long_texts_are_encoded_in_a_worker_process_with_the_same_ids(tokenizer):
    enc = PromptEncoder(tokenizer, str(DEMO), inline_chars=100)
    try:
        short, long = TEXT[:97], TEXT * 37 + "ünïcode ✓"
        assert await enc.encode(short) == tokenizer.encode(short)
        assert enc._pool is None  # short: inline, no worker started
        assert await enc.encode(long) == tokenizer.encode(long)
        (worker,) = enc._pool._processes.values()
        assert worker.pid != os.getpid() and worker.is_alive()
        with pytest.raises(InvalidRequest, match="must be a str"):
            await enc.encode(b"bytes" * 40)
    finally:
        enc.close()
    assert enc._pool is None


@pytest.mark.asyncio
async def test_a_dead_worker_is_replaced_and_its_prompt_still_encoded(tokenizer):
    enc = PromptEncoder(tokenizer, str(DEMO), inline_chars=10)
    try:
        text = TEXT * 5
        assert await enc.encode(text) == tokenizer.encode(text)
        (worker,) = enc._pool._processes.values()
        worker.kill()
        worker.join(10)
        assert await enc.encode(text[3:]) == tokenizer.encode(text[3:])  # in a thread
        assert await enc.encode(text[5:]) == tokenizer.encode(text[5:])  # a new worker
        (again,) = enc._pool._processes.values()
        assert again.pid != worker.pid
    finally:
        enc.close()



@pytest.mark.asyncio
async def test_the_worker_outlives_ctrl_c(tokenizer):
    """Ctrl-C reaches every process of the terminal's group: the worker leaves it to the
    gateway (which closes it) instead of dying with a traceback of its own."""
    enc = PromptEncoder(tokenizer, str(DEMO), inline_chars=10)
    try:
        text = TEXT * 5
        assert await enc.encode(text) == tokenizer.encode(text)
        (worker,) = enc._pool._processes.values()
        os.kill(worker.pid, signal.SIGINT)
        worker.join(0.5)
        assert worker.is_alive()
        assert await enc.encode(text[2:]) == tokenizer.encode(text[2:])
        assert [w.pid for w in enc._pool._processes.values()] == [worker.pid]
    finally:
        enc.close()
