"""How the gateway ends a request on a stop string, and what its text shows of special tokens.

A stop string that completes mid-step ends the text, the step's token ids and the usage at the
token that completed it (the verifier committed more); the gateway then calls the verifier's
`Stop` for that request before cancelling the call, so the verifier counts it finished. EOS's
text (`<|endoftext|>`) is left out of the text unless the request keeps special tokens.
Demo target's tokenizer: "The cat sat on the mat." is 2028 285 282 308 282 555 296 2056 14.
"""

from __future__ import annotations

import asyncio

import pytest

from services.gateway import convert
from services.gateway.convert import GatewayRequest, Step
from services.gateway.request_state import RequestState
from specserve.demo import default_pair
from specserve.tokenizer import Tokenizer
from specserve.types import FinishReason, SamplingParams
from specserve.v1 import common_pb2, gateway_pb2_grpc, verifier_pb2
from tests.services.test_gateway_service import (
    RPC_S,
    FakeVerifier,
    channel,
    running_gateway,
    start_verifier,
)

TARGET, _ = default_pair()
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(TARGET is None, reason="the demo pair is not checked out")]
SENTENCE = (2028, 285, 282, 308, 282, 555, 296, 2056, 14)
EOS = 0


def _state(stop=(), keep_special=False) -> RequestState:
    tok = Tokenizer.from_dir(TARGET)
    req = GatewayRequest("r", "x", None, SamplingParams(max_tokens=64, stop=tuple(stop)), None,
                         None, keep_special)
    return RequestState(tok, [2028], req)


def test_a_stop_string_mid_step_ends_text_tokens_and_usage_at_its_token():
    state = _state(stop=[" on"])
    text, step, stopped = state.push(Step(SENTENCE[:3], 1, 0))  # "The cat"
    assert (text, stopped, state.completion_tokens) == ("The cat", False, 3)
    text, step, stopped = state.push(Step(SENTENCE[3:], 6, 5))  # " sat on the mat."
    # " s" "at" " on": the stop completes at the step's third token of six
    assert (text, step.token_ids, step.commit_len, stopped) == (" sat", SENTENCE[3:6], 6, True)
    assert state.completion_tokens == 6
    assert state.final(FinishReason.STOP, None).completion_tokens == 6


def test_the_first_step_carries_the_prompt_when_its_logprobs_were_asked():
    tok = Tokenizer.from_dir(TARGET)
    for params, want in ((SamplingParams(prompt_logprobs=0), (2028,)), (SamplingParams(), ())):
        state = RequestState(tok, [2028], GatewayRequest("r", None, (2028,), params, None,
                                                         None))
        _, step, _ = state.push(Step(SENTENCE[1:2], 1, 0))  # a one-token prompt: no logprobs
        assert step.prompt_ids == want  # (echo still shows its token)
        assert state.push(Step(SENTENCE[2:3], 1, 0))[1].prompt_ids == ()


def test_without_a_stop_every_token_counts():
    state = _state(stop=["zebra"])
    text, step, stopped = state.push(Step(SENTENCE, 9, 8))
    assert (stopped, step.token_ids, state.completion_tokens) == (False, SENTENCE, 9)
    assert text + state.tail()[0] == "The cat sat on the mat."


@pytest.mark.parametrize("keep, want", [(False, "The cat"), (True, "The cat<|endoftext|>")])
def test_eos_text_is_left_out_unless_special_tokens_are_kept(keep, want):
    state = _state(keep_special=keep)
    text, _, _ = state.push(Step((*SENTENCE[:3], EOS), 4, 3))
    assert text + state.tail()[0] == want and state.completion_tokens == 4


class StoppableVerifier(FakeVerifier):
    """One step of the whole sentence, then waits (a long generation) until stopped."""

    def __init__(self, stop_s: float = 0.2) -> None:
        super().__init__(tokens=())
        self.stopped: list[str] = []
        self.stop_s = stop_s
        self.order: list[str] = []  # "stop" when a Stop arrives, "end" when a Generate ends
        self.stop_done = asyncio.Event()  # then its Generate ends (no handler left running)
        self.release: asyncio.Event | None = None  # set: Stop waits for it instead of stop_s

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        context.add_done_callback(lambda _ctx: self.order.append("end"))
        self.requests.append(request)
        self.stop_done.clear()  # (the tests send one request at a time)
        yield verifier_pb2.VerifyEvent(token_ids=SENTENCE, commit_len=len(SENTENCE))
        await asyncio.wait_for(self.stop_done.wait(), RPC_S)  # a long generation, until stopped

    async def Stop(self, request, context):  # noqa: N802
        self.order.append("stop")
        if self.release is not None:  # a verifier busy until the test says
            await self.release.wait()
        else:  # a busy verifier: the gateway stops it in the background
            await asyncio.sleep(self.stop_s)
        self.stopped.append(request.request_id)
        self.stop_done.set()
        return verifier_pb2.StopReply(stopped=True)


@pytest.mark.asyncio
async def test_the_gateway_stops_the_request_at_the_verifier(tmp_path, monkeypatch):
    import services.gateway.pipeline as pipeline

    monkeypatch.setattr(pipeline, "STOP_TIMEOUT_S", 10.0)
    fake = StoppableVerifier()
    fake.release = asyncio.Event()  # its Stop answers only once the client's call has ended
    server, port, _ = await start_verifier(fake)
    try:
        async with running_gateway(tmp_path, model=TARGET,
                                   verifier=f"127.0.0.1:{port}") as (address, _cfg):
            params = SamplingParams(max_tokens=64, stop=(" on",))
            async with channel(address) as ch:
                msgs = gateway_pb2_grpc.GatewayStub(ch).Generate(
                    convert.generate_request_to_pb("The", params), timeout=RPC_S)
                replies = [m async for m in msgs]  # ends without the verifier's Stop answer
            assert not fake.stopped  # the verifier's Stop had not answered
            fake.release.set()
            for _ in range(1000):  # the verifier call ends before the gateway does
                if "end" in fake.order:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the fake server's handler task winds down
    finally:
        await server.stop(None)
    assert fake.order == ["stop", "end"]  # and the verifier call was not cancelled before it

    final = replies[-1].final
    assert replies[0].chunk.text == "The cat sat" and list(replies[0].chunk.token_ids) == \
        list(SENTENCE[:6])
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert final.usage.completion_tokens == 6
    assert fake.stopped == [fake.requests[0].request_id] and fake.stopped[0]



@pytest.mark.asyncio
async def test_over_http_the_stop_is_waited_for_after_the_response(tmp_path):
    import http.client
    import json

    fake = StoppableVerifier()
    server, port, _ = await start_verifier(fake)
    port_file = tmp_path / "http.port"
    try:
        async with running_gateway(tmp_path, model=TARGET, verifier=f"127.0.0.1:{port}",
                                   http_port=0, http_port_file=str(port_file)):
            def post(stream: bool):
                conn = http.client.HTTPConnection("127.0.0.1", int(port_file.read_text()),
                                                  timeout=20)
                conn.request("POST", "/v1/completions", json.dumps(
                    {"prompt": "The", "max_tokens": 64, "stop": " on", "stream": stream}),
                    {"content-type": "application/json"})
                resp = conn.getresponse()
                if not stream:
                    return json.loads(resp.read())
                events = []
                while (line := resp.readline()) != b"data: [DONE]\n":  # then hang up, as
                    if line.startswith(b"data: {"):                     # openai's client does
                        events.append(json.loads(line[6:]))
                conn.close()
                return events

            body = await asyncio.to_thread(post, False)
            events = await asyncio.to_thread(post, True)
            for _ in range(50):
                if len(fake.stopped) == 2:
                    break
                await asyncio.sleep(0.02)
    finally:
        await server.stop(None)
    assert body["choices"][0]["text"] == "The cat sat" and body["usage"]["completion_tokens"] == 6
    assert "".join(e["choices"][0]["text"] for e in events) == "The cat sat"
    assert fake.stopped == [body["id"], events[0]["id"]]  # a response's id: one choice
