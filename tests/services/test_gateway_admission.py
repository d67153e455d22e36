"""What the gateway settles before a request reaches a verifier, and right after one ends.

A prompt no verifier could take (longer than the `max_model_len` the verifiers report in
`Stats`) is refused with INVALID_ARGUMENT naming the prompt or max_tokens, and never sent; a
request id whose last request was cut at a stop string can be reused at once (the new request
waits for the old one's `Stop`); a prompt text being encoded is encoded once for every request
waiting on it, dropped when the last of them leaves, and a wait past the deadline is
DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.gateway.prompt_encoder import PromptEncoder
from specserve.errors import DeadlineExceeded
from specserve.tokenizer import Tokenizer
from specserve.v1 import verifier_pb2
from tests.services.test_gateway_service import (
    SERVING,
    FakeVerifier,
    generate,
    model_dir,  # noqa: F401 (fixture)
    running_gateway,
    start_verifier,
    until_status,
)

pytestmark = pytest.mark.timeout(60)


class ContextVerifier(FakeVerifier):
    """Reports a context of `max_model_len` tokens; refuses an id still live, as the verifier
    does; its Stop frees an id after `stop_s`."""

    def __init__(self, max_model_len: int = 24, stop_s: float = 0.0) -> None:
        super().__init__()
        self.max_model_len, self.stop_s, self.live = max_model_len, stop_s, set()

    async def Stats(self, request, context):  # noqa: N802
        return verifier_pb2.StatsReply(max_model_len=self.max_model_len)

    async def Stop(self, request, context):  # noqa: N802
        await asyncio.sleep(self.stop_s)
        self.live.discard(request.request_id)
        return verifier_pb2.StopReply(stopped=True)

    async def Generate(self, request, context):  # noqa: N802
        if request.request_id in self.live:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request id {request.request_id!r} is already in use")
        self.live.add(request.request_id)
        try:
            async for event in super().Generate(request, context):
                yield event
        finally:
            self.live.discard(request.request_id)


@pytest.mark.asyncio
async def test_a_prompt_no_verifier_can_take_is_refused_before_it_is_sent(model_dir,  # noqa: F811
                                                                         tmp_path):
    fake = ContextVerifier(max_model_len=24)
    server, vport, _ = await start_verifier(fake)
    try:
        async with running_gateway(tmp_path, model=str(model_dir), health_period_s=0.1,
                                   verifier=f"127.0.0.1:{vport}") as (addr, _):
            await until_status(addr, SERVING, within_s=5.0)
            for prompt, words in (
                    (list(range(3, 30)), "is 24 tokens. However, the prompt has 27 tokens"),
                    (list(range(3, 19)), "is 24 tokens. However, you requested 25 tokens (16 "
                                         "in the prompt, 9 in max_tokens)"),
                    ("ab " * 40, "This model's maximum context length is 24 tokens")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(addr, prompt)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert words in err.value.details(), err.value.details()
            assert fake.requests == []  # none reached the verifier
            assert len(await generate(addr, list(range(3, 18)))) > 1  # 15 + 9 fit
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_a_request_id_cut_at_a_stop_string_can_be_reused_at_once(model_dir,  # noqa: F811
                                                                       tmp_path):
    fake = ContextVerifier(max_model_len=4096, stop_s=0.3)
    stop = Tokenizer.from_dir(model_dir).decode([fake.tokens[0]])
    assert stop.strip(), "the first streamed token has text to stop at"
    server, vport, _ = await start_verifier(fake)
    try:
        async with running_gateway(tmp_path, model=str(model_dir), health_period_s=0.1,
                                   verifier=f"127.0.0.1:{vport}") as (addr, _):
            await until_status(addr, SERVING, within_s=5.0)
            for _ in range(3):
                out = await generate(addr, [5, 9, 14], stop=[stop], request_id="same-id")
                assert out[-1].finish_reason.name == "STOP"
            assert [r.request_id for r in fake.requests] == ["same-id"] * 3
            while fake.live:  # the last Stop, before the gateway stops
                await asyncio.sleep(0.02)
    finally:
        await server.stop(0)


def test_a_shared_encoding_is_dropped_when_its_last_waiter_leaves():
    async def main():
        started, release = [], asyncio.Event()

        class Slow(PromptEncoder):
            async def encode(self, text, add_special_tokens=False):
                started.append(text)
                await release.wait()
                return [len(text)]

        enc = Slow(None, None)
        a1 = asyncio.ensure_future(enc.shared("a" * 5, 10.0))
        a2 = asyncio.ensure_future(enc.shared("a" * 5, 10.0))  # the same text: one encoding
        b = asyncio.ensure_future(enc.shared("b" * 7, 10.0))
        await asyncio.sleep(0.05)
        task_a, task_b = enc._shared["a" * 5, False][0], enc._shared["b" * 7, False][0]
        a1.cancel()  # one of two waiters leaves: the encoding goes on
        b.cancel()  # its only waiter leaves: dropped
        await asyncio.sleep(0.05)
        assert not task_a.cancelled() and task_b.cancelled() and "b" * 7 not in enc._shared
        release.set()
        assert await a2 == [5] and started == ["a" * 5, "b" * 7]
        with pytest.raises(DeadlineExceeded, match="deadline passed while its prompt"):
            release.clear()
            await enc.shared("c" * 3, 0.05)
        assert enc._shared == {}  # the timed-out one's encoding is dropped too

    asyncio.run(main())
