"""One gateway in front of two verifier replicas (fakes, then real ones on a tiny target):
requests spread by load, the final names the replica that served it, and a replica that goes
down is drained — its in-flight request fails UNAVAILABLE and new ones go to the other."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.gateway.convert import GatewayFinal
from tests.helpers import save_tokenizer
from tests.services.test_gateway_service import (
    SERVING,
    FakeVerifier,
    generate,
    running_gateway,
    start_verifier,
    until_status,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("replicas-model"))  # all the gateway reads


def _served(events) -> tuple[str, list[int]]:
    final = events[-1]
    assert isinstance(final, GatewayFinal)
    return final.verifier, [t for e in events[:-1] for t in e[1].token_ids]


@pytest.mark.asyncio
async def test_requests_spread_over_replicas_and_a_dead_one_is_drained(model_dir, tmp_path):
    fakes = {"a": FakeVerifier((71, 104, 33), delay_s=0.15), "b": FakeVerifier((72, 105, 34),
                                                                               delay_s=0.15)}
    started = {k: await start_verifier(f) for k, f in fakes.items()}
    addr_of = {k: f"127.0.0.1:{port}" for k, (_, port, _) in started.items()}
    name_of = {a: k for k, a in addr_of.items()}
    try:
        async with running_gateway(tmp_path, model=str(model_dir), health_period_s=0.1,
                                   verifier=f"{addr_of['a']},{addr_of['b']}") as (addr, _):
            await until_status(addr, SERVING, 5.0)
            results = await asyncio.gather(*(generate(addr, f"prompt {i}") for i in range(6)))
            served = [_served(r) for r in results]
            assert sorted(name_of[v] for v, _ in served) == ["a"] * 3 + ["b"] * 3
            for v, tokens in served:  # each stream is the replica's own
                assert tokens == list(fakes[name_of[v]].tokens)
            # `a` goes down while it serves one of two concurrent requests
            flight = [asyncio.ensure_future(generate(addr, f"late {i}")) for i in range(2)]
            await asyncio.sleep(0.05)
            await started["a"][0].stop(0)
            done = await asyncio.gather(*flight, return_exceptions=True)
            errors = [d for d in done if isinstance(d, BaseException)]
            assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.UNAVAILABLE, done
            after = await asyncio.gather(*(generate(addr, f"after {i}") for i in range(3)))
            assert {name_of[_served(r)[0]] for r in after} == {"b"}
    finally:
        for server, *_ in started.values():
            await server.stop(0)


@pytest.mark.asyncio
async def test_two_real_verifiers_behind_one_gateway_serve_the_engine_tokens(
        model_dir, tmp_path, target, expected):
    from services.verifier.server import VerifierConfig, serve
    from tests.helpers import random_prompts

    config = VerifierConfig(model=str(target), port=0, device="cpu", dtype="float32",
                            kv_memory_gb=0.0015, grace_s=0.2)
    (s1, p1), (s2, p2) = await serve(config), await serve(config)
    addresses = {f"127.0.0.1:{p1}": s1, f"127.0.0.1:{p2}": s2}
    prompts = random_prompts(6, 211, [5, 8, 11], seed=21)
    try:
        async with running_gateway(tmp_path, model=str(model_dir), health_period_s=0.1,
                                   verifier=",".join(addresses)) as (addr, _):
            await until_status(addr, SERVING, 10.0)
            served = [_served(r) for r in await asyncio.gather(*(generate(addr, p)
                                                                 for p in prompts))]
            assert [tokens for _, tokens in served] == [expected(p, 9) for p in prompts]
            assert {v for v, _ in served} == set(addresses)  # both took requests
            gone, left = list(addresses)
            await addresses[gone].stop(0)
            after = []
            for i, p in enumerate(prompts[:3]):
                try:
                    after.append(_served(await generate(addr, p)))
                except grpc.aio.AioRpcError as e:  # only one that went there before it was seen
                    assert i == 0 and e.code() == grpc.StatusCode.UNAVAILABLE, e
            assert [tokens for _, tokens in after[-2:]] == [expected(p, 9) for p in prompts[1:3]]
            assert {v for v, _ in after} == {left}  # drained: new requests go elsewhere
    finally:
        await asyncio.gather(*(s.stop(0) for s in addresses.values()))
