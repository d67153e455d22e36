"""Security options, off by default, over real gRPC on 127.0.0.1: mutual TLS between verifier and
drafter (a verifier without a certificate the drafter's CA signed gets nothing from it), bearer
tokens (UNAUTHENTICATED without the right one; gRPC health stays open), reflection switched off.
Speculation still works through all of it (the drafter's n-gram trees are accepted)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from services.common.security import NONE, Security
from services.common.server import channel
from services.drafter.core import DrafterCore
from services.drafter.server import DrafterConfig
from services.drafter.server import serve as serve_drafter
from services.gateway.server import GatewayConfig
from services.gateway.server import serve as serve_gateway
from services.verifier.server import VerifierConfig
from services.verifier.server import serve as serve_verifier
from specserve.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.helpers import make_checkpoint, save_tokenizer
from tests.tls import make_pki

aio = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.timeout(90)
PROMPT = [5, 6, 7, 8, 9, 10, 11] * 4
NGRAM = common_pb2.DRAFTER_KIND_NGRAM


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("security"), "qwen3-gqa1-tied")[0]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ("drafter", "verifier", "client"))


async def _stack(target, drafter_security: Security, verifier_security: Security):
    drafter, dport = await serve_drafter(DrafterConfig(port=0, security=drafter_security),
                                         core=DrafterCore())
    drafter.port = dport
    return (drafter, *await _verifier(target, dport, verifier_security))


async def _verifier(target, dport: int, security: Security):
    server, port = await serve_verifier(VerifierConfig(
        model=str(target), port=0, device="cpu", dtype="float32", kv_memory_gb=0.002,
        drafter=f"127.0.0.1:{dport}", drafter_timeout_s=1.0, security=security))
    return server, port


async def _generate(address: str, security: Security = NONE, metadata=()):
    async with channel(address, security) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        req = verifier_pb2.VerifyRequest(
            prompt_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=30, ignore_eos=True),
            spec=common_pb2.SpecOptions(drafter=NGRAM, budget=6))
        return [e async for e in stub.Generate(req, timeout=60, metadata=metadata)]


def _speculated(events) -> bool:
    steps = events[1:]
    return not any(e.fallback for e in steps) and max(e.commit_len for e in steps) > 1


@aio
async def test_mutual_tls_between_verifier_and_drafter(target, pki):
    drafter_side = Security(tls_cert=str(pki["drafter"]), tls_key=str(pki["drafter-key"]),
                            tls_client_ca=str(pki["ca"]))
    verifier_side = Security(tls_cert=str(pki["verifier"]), tls_key=str(pki["verifier-key"]),
                             peer_tls_ca=str(pki["ca"]))
    client = Security(peer_tls_ca=str(pki["ca"]))  # the test dials the verifier over TLS
    drafter, verifier, vport = await _stack(target, drafter_side, verifier_side)
    try:
        good = await _generate(f"127.0.0.1:{vport}", client)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # plaintext to a TLS port
            await _generate(f"127.0.0.1:{vport}")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await verifier.stop(0)
    # a verifier that trusts the drafter but has no certificate of the drafter's CA
    stranger, sport = await _verifier(target, drafter.port, Security(peer_tls_ca=str(pki["ca"])))
    try:
        refused = await _generate(f"127.0.0.1:{sport}")
    finally:
        await stranger.stop(0)
        await drafter.stop(0)
    assert _speculated(good)
    assert [t for e in refused for t in e.token_ids] == [t for e in good for t in e.token_ids]
    assert all(e.commit_len == 1 and e.fallback for e in refused[1:])


@aio
async def test_bearer_tokens_and_open_health(target):
    drafter, verifier, vport = await _stack(
        target, Security(token="drafter-secret"),
        Security(token="verifier-secret", peer_token="drafter-secret"))
    address = f"127.0.0.1:{vport}"
    try:
        for metadata in ((), (("authorization", "Bearer wrong"),),
                         (("authorization", "verifier-secret"),)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(address, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = await _generate(address, metadata=(("authorization", "Bearer verifier-secret"),))
        async with channel(address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10)
    finally:
        await verifier.stop(0)
    wrong, wport = await _verifier(target, drafter.port, Security(peer_token="guess"))
    try:
        refused = await _generate(f"127.0.0.1:{wport}")
    finally:
        await wrong.stop(0)
        await drafter.stop(0)
    assert _speculated(good) and health.status == health_pb2.HealthCheckResponse.SERVING
    assert all(e.commit_len == 1 and e.fallback for e in refused[1:])


@aio
async def test_reflection_can_be_switched_off(target):
    drafter, verifier, vport = await _stack(target, Security(reflection=False),
                                            Security(reflection=False))
    try:
        async with channel(f"127.0.0.1:{vport}") as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            # the call alone, no request written: a request racing the server's immediate
            # UNIMPLEMENTED failed the client's send with INTERNAL now and then (CI)
            call = stub.ServerReflectionInfo(timeout=10)
            assert await call.code() == grpc.StatusCode.UNIMPLEMENTED
        assert _speculated(await _generate(f"127.0.0.1:{vport}"))
    finally:
        await verifier.stop(0)
        await drafter.stop(0)


@aio
async def test_gateway_tls_and_token_with_the_cli(target, pki, tmp_path):
    """The whole chain secured: `specserve generate --tls-ca --token` gets tokens; without the
    token the gateway says UNAUTHENTICATED (exit 2)."""
    save_tokenizer(target, vocab_size=211)
    drafter, verifier, vport = await _stack(
        target, Security(token="d"), Security(tls_cert=str(pki["verifier"]),
                                              tls_key=str(pki["verifier-key"]),
                                              token="v", peer_token="d"))
    port_file, stop = tmp_path / "gateway.port", asyncio.Event()
    gateway = asyncio.ensure_future(serve_gateway(GatewayConfig(
        model=str(target), verifier=f"127.0.0.1:{vport}", port=0, port_file=str(port_file),
        http_port=None, grace_s=0.1, security=Security(tls_cert=str(pki["drafter"]),
                                       tls_key=str(pki["drafter-key"]), token="g",
                                       peer_tls_ca=str(pki["ca"]), peer_token="v")), stop))
    try:
        while not port_file.exists():
            await asyncio.sleep(0.02)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        cli = [sys.executable, "-m", "services.cli", "generate", "--gateway", address,
               "--token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "12",
               "--tls-ca", str(pki["ca"]), "--json"]
        ok, denied = [await asyncio.to_thread(subprocess.run, cmd, capture_output=True,
                                              text=True, timeout=60)
                      for cmd in (cli + ["--token", "g"], cli)]
    finally:
        stop.set()
        await gateway
        await verifier.stop(0)
        await drafter.stop(0)
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["token_ids"]) == 12
    assert denied.returncode == 2 and "UNAUTHENTICATED" in denied.stderr
