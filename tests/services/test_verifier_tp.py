"""The verifier served with --tensor-parallel 2 on the CPU (gloo): this process is rank 0 and
drives one spawned worker; a target with one kv head (replicated on both ranks). Streams equal
the in-process TP=1 engine's greedy output, concurrently, and Stats reports the pool."""

from __future__ import annotations

import asyncio

import pytest

from services.common.server import channel
from services.verifier.server import VerifierConfig, serve
from specserve.parallel import stop_workers, workers
from specserve.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.helpers import random_prompts

pytestmark = pytest.mark.timeout(120)


async def _tokens(stub, prompt, max_tokens: int) -> list[int]:
    request = verifier_pb2.VerifyRequest(
        prompt_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                              ignore_eos=True))
    return [t async for e in stub.Generate(request, timeout=60) for t in e.token_ids]


def test_tensor_parallel_verifier_streams_equal_the_tp1_engine(target, expected):
    config = VerifierConfig(model=str(target), port=0, device="cpu", dtype="float32",
                            kv_memory_gb=0.0015, grace_s=0.2, tensor_parallel=2)
    prompts = random_prompts(3, 211, [7, 12, 18], seed=11)

    async def main():
        server, port = await serve(config)
        assert workers.leader().tp.world == 2  # the engine's runner started its worker
        try:
            async with channel(f"127.0.0.1:{port}") as ch:
                stub = verifier_pb2_grpc.VerifierStub(ch)
                got = await asyncio.gather(*(_tokens(stub, p, 20) for p in prompts))
                stats = await stub.Stats(verifier_pb2.StatsRequest(), timeout=10)
        finally:
            await server.stop(0)
        return got, stats

    try:
        got, stats = asyncio.run(main())
    finally:
        stop_workers()
    assert got == [expected(p, 20) for p in prompts]
    assert stats.kv_pages_total > 0 and stats.kv_pages_used == 0
