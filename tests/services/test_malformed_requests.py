"""Request bytes that do not parse, sent to each service over real gRPC (loopback, port 0).

Corrupt wire format and invalid UTF-8 in a proto3 string field (upb rejects it at parse time)
must end the call with INVALID_ARGUMENT "malformed request: not a valid specserve.v1.X" — no
Python class name, no traceback — on gateway Generate, verifier Generate / Stats and drafter
Draft / Attach, and the same server must answer a valid call afterwards. One stack:
drafter (n-gram only), verifier (tiny random target, no drafter), gateway in front of it.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
import pytest_asyncio

from services.common.server import channel
from services.drafter.core import DrafterCore
from services.drafter.server import DrafterConfig
from services.drafter.server import serve as serve_drafter
from services.gateway.server import GatewayConfig
from services.gateway.server import serve as serve_gateway
from services.verifier.server import VerifierConfig
from services.verifier.server import serve as serve_verifier
from specserve.v1 import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2
from tests.helpers import make_checkpoint

VOCAB, RPC_S = 287, 30.0
SPOIL, BAD_UTF8 = b"\x01SPOIL", b"\xc3(\xfe\xff\x80A"  # same length: the framing stays valid
CORRUPT = b"\xff\xff\xff\x0f"  # a tag of field 0: never valid protobuf
PROMPT = [17, 203, 5, 88, 41, 17, 203]
aio = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen3 target beside a byte-level BPE tokenizer.json of its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.unit.test_tokenizer import CORPUS

    root, _ = make_checkpoint(tmp_path_factory.mktemp("malformed"), "qwen3-gqa1-tied",
                              seed=3, vocab_size=VOCAB)
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
        vocab_size=VOCAB, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.add_tokens([f"<extra_{i}>" for i in range(VOCAB - hf.get_vocab_size())])
    hf.save(str(root / "tokenizer.json"))
    return root


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model_dir, tmp_path_factory):
    core = DrafterCore()
    drafter, dport = await serve_drafter(DrafterConfig(port=0, lane="off"), core=core)
    verifier, vport = await serve_verifier(VerifierConfig(
        model=str(model_dir), port=0, device="cpu", dtype="float32", kv_memory_gb=0.0015,
        max_draft_tokens=16, default_budget=8, grace_s=0.5))
    port_file, stop = tmp_path_factory.mktemp("gw") / "port", asyncio.Event()
    gateway = asyncio.create_task(serve_gateway(GatewayConfig(
        model=str(model_dir), verifier=f"127.0.0.1:{vport}", port=0, port_file=str(port_file),
        http_port=None, grace_s=0.5), stop))
    while not port_file.exists():
        assert not gateway.done(), gateway.exception()
        await asyncio.sleep(0.05)
    channels = [channel(f"127.0.0.1:{p}") for p in (int(port_file.read_text()), vport, dport)]
    yield SimpleNamespace(core=core, gateway=channels[0], verifier=channels[1],
                          drafter=channels[2])
    for ch in channels:
        await ch.close()
    stop.set()
    await gateway
    await verifier.stop(0)
    await drafter.stop(0)


def _spoiled(msg) -> bytes:
    """`msg` serialized with its one SPOIL string made invalid UTF-8."""
    raw = msg.SerializeToString()
    assert raw.count(SPOIL) == 1
    return raw.replace(SPOIL, BAD_UTF8)


async def _rejected(call, message_type: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    error = failure.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert error.details() == f"malformed request: not a valid specserve.v1.{message_type}"


async def _read_all(call) -> list[bytes]:
    return [reply async for reply in call]


SPOIL_TEXT = SPOIL.decode()
SAMPLING = common_pb2.SamplingParams(max_tokens=6, ignore_eos=True)


@aio
async def test_gateway_generate(stack):
    generate = stack.gateway.unary_stream("/specserve.v1.Gateway/Generate")
    spoiled = _spoiled(gateway_pb2.GenerateRequest(request_id=SPOIL_TEXT, text="a b c",
                                                   sampling=SAMPLING))
    for raw in (CORRUPT, spoiled):
        await _rejected(_read_all(generate(raw, timeout=RPC_S)), "GenerateRequest")
    valid = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT),
                                        sampling=SAMPLING)
    replies = [gateway_pb2.GenerateResponse.FromString(r)
               for r in await _read_all(generate(valid.SerializeToString(), timeout=RPC_S))]
    tokens = [t for r in replies if r.HasField("chunk") for t in r.chunk.token_ids]
    assert len(tokens) == 6 and replies[-1].final.usage.completion_tokens == 6
    events = await _read_all(stack.verifier.unary_stream("/specserve.v1.Verifier/Generate")(
        verifier_pb2.VerifyRequest(prompt_ids=PROMPT, sampling=SAMPLING).SerializeToString(),
        timeout=RPC_S))
    assert [t for e in events for t in verifier_pb2.VerifyEvent.FromString(e).token_ids] == tokens


@aio
async def test_verifier_generate_and_stats(stack):
    generate = stack.verifier.unary_stream("/specserve.v1.Verifier/Generate")
    spoiled = _spoiled(verifier_pb2.VerifyRequest(request_id=SPOIL_TEXT, prompt_ids=PROMPT,
                                                  sampling=SAMPLING))
    for raw in (CORRUPT, spoiled):
        await _rejected(_read_all(generate(raw, timeout=RPC_S)), "VerifyRequest")
    stats = stack.verifier.unary_unary("/specserve.v1.Verifier/Stats")
    await _rejected(stats(CORRUPT, timeout=RPC_S), "StatsRequest")
    events = [verifier_pb2.VerifyEvent.FromString(e) for e in await _read_all(generate(
        verifier_pb2.VerifyRequest(prompt_ids=PROMPT[:5], sampling=SAMPLING).SerializeToString(),
        timeout=RPC_S))]
    assert sum(len(e.token_ids) for e in events) == 6 and events[-1].HasField("final")
    reply = verifier_pb2.StatsReply.FromString(await stats(b"", timeout=RPC_S))
    assert reply.kv_pages_used == 0 and reply.kv_pages_free > 0


def _batch(step_id: int, rid: str, history: list[int]) -> bytes:
    entry = drafter_pb2.DraftEntry(request_id=rid, drafter=common_pb2.DRAFTER_KIND_NGRAM,
                                   bonus_token=history[-1], start=len(history) - 1, budget=3,
                                   max_depth=9, new_history=history)
    return drafter_pb2.DraftBatch(step_id=step_id, entries=[entry]).SerializeToString()


async def _released(core: DrafterCore, rid: str) -> None:
    deadline = time.monotonic() + 10  # the status goes out before the stream's release runs
    while core.history(rid) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert core.history(rid) == []


@aio
async def test_drafter_draft_and_attach(stack):
    draft = stack.drafter.stream_stream("/specserve.v1.Drafter/Draft")
    history = [4, 9, 2, 6, 4, 9]
    bad_batch = drafter_pb2.DraftBatch(step_id=2, entries=[drafter_pb2.DraftEntry(
        request_id=SPOIL_TEXT)])
    for raw in (CORRUPT, _spoiled(bad_batch)):
        call = draft(timeout=RPC_S)
        await call.write(_batch(1, "d1", history))  # a good batch first, then the bad one
        assert list(drafter_pb2.TreeBatch.FromString(await call.read()).trees[0].token_ids) == \
            [2, 6, 4]
        await call.write(raw)
        await _rejected(call.read(), "DraftBatch")
        await _released(stack.core, "d1")  # the aborted stream releases its requests
    attach = stack.drafter.unary_unary("/specserve.v1.Drafter/Attach")
    await _rejected(attach(CORRUPT, timeout=RPC_S), "AttachRequest")
    await _rejected(attach(_spoiled(drafter_pb2.AttachRequest(ring=drafter_pb2.RingSpec(
        dtype=SPOIL_TEXT))), timeout=RPC_S), "AttachRequest")
    call = draft(timeout=RPC_S)
    await call.write(_batch(3, "d2", [7, 1, 7]))
    assert list(drafter_pb2.TreeBatch.FromString(await call.read()).trees[0].token_ids) == [1, 7]
    assert stack.core.history("d2") == [7, 1, 7]
    await call.write(drafter_pb2.DraftBatch(release=["d2"]).SerializeToString())  # in-stream
    await call.read()
    assert stack.core.history("d2") == []
    reply = drafter_pb2.AttachReply.FromString(await attach(b"", timeout=RPC_S))
    assert not reply.ring_attached and reply.lane_path == ""
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
