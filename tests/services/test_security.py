"""Security options, off by default, over real gRPC on 127.0.0.1: mutual TLS between verifier and
drafter (a verifier without a certificate the drafter's CA signed gets nothing from it), bearer
tokens (UNAUTHENTICATED without the right one; the scheme "Bearer" in any case, as RFC 7235 has
it; gRPC health stays open), reflection switched off,
the containers' health check under TLS.
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

from services.common.security import NONE, Security, bearer_ok
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
        for sent in (None, "Bearer wrong", "bearer wrong", "verifier-secret",
                     "Basic verifier-secret", "Bearer Verifier-secret"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(address, metadata=(("authorization", sent),) if sent else ())
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, sent
        good = await _generate(address, metadata=(("authorization", "Bearer verifier-secret"),))
        for scheme in ("bearer", "BEARER"):  # RFC 7235: the scheme is case-insensitive
            lower = await _generate(address, metadata=(("authorization",
                                                        f"{scheme} verifier-secret"),))
            assert [e.token_ids for e in lower] == [e.token_ids for e in good], scheme
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


@pytest.mark.parametrize("sent, ok", [
    ("Bearer s3cret", True), ("bearer s3cret", True), ("BeArEr s3cret", True),
    ("Bearer   s3cret", True),  # RFC 6750: one or more spaces after the scheme
    (b"bearer s3cret", True),
    ("bearer S3cret", False), ("Bearer s3cre", False), ("Bearer s3cret2", False),
    ("Bearers3cret", False), ("Basic s3cret", False), ("s3cret", False), ("bearer", False),
    ("", False), ("Bear s3cret", False),
])
def test_the_bearer_scheme_in_any_case_the_token_exactly(sent, ok):
    assert bearer_ok(sent, b"s3cret") is ok
    assert bearer_ok("Bearer ", b"") is False  # an empty token authenticates nothing


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


@aio
async def test_the_containers_health_check_under_tls(pki):
    """`python -m services.common.health ROLE` (docker-compose.yml's healthcheck) reads the
    service's own SPECSERVE_* variables: it finds a drafter under mutual TLS SERVING, as
    docker/compose.secure.yml sets it up, and one under one-way TLS with only a peer CA (as the
    gateway there); dialed in plaintext the first is never SERVING."""
    from services.common.health import check

    mutual = {"SPECSERVE_TLS_CERT": str(pki["drafter"]),
              "SPECSERVE_TLS_KEY": str(pki["drafter-key"]),
              "SPECSERVE_TLS_CLIENT_CA": str(pki["ca"])}
    drafter, port = await serve_drafter(DrafterConfig(
        port=0, security=Security.from_env(mutual)), core=DrafterCore())
    one_way = {"SPECSERVE_TLS_CERT": str(pki["verifier"]),
               "SPECSERVE_TLS_KEY": str(pki["verifier-key"]),
               "SPECSERVE_PEER_TLS_CA": str(pki["ca"])}
    other, oport = await serve_drafter(DrafterConfig(
        port=0, security=Security.from_env(one_way)), core=DrafterCore())
    try:
        runs = []
        for env in ({**mutual, "SPECSERVE_DRAFTER_PORT": str(port)},
                    {**one_way, "SPECSERVE_DRAFTER_PORT": str(oport)},
                    {"SPECSERVE_DRAFTER_PORT": str(port)}):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.common.health", "drafter",
                env={"PATH": "", **env}, stderr=asyncio.subprocess.PIPE)
            runs.append((await proc.wait(), (await proc.stderr.read()).decode()))
        with pytest.raises(ValueError, match="SPECSERVE_VERIFIER_PORT is not set"):
            check("verifier", environ=mutual)
    finally:
        await drafter.stop(0)
        await other.stop(0)
    assert runs[0] == (0, "") and runs[1] == (0, ""), runs
    assert runs[2][0] == 1 and "not SERVING after 5.0 s" in runs[2][1], runs[2]


def test_up_under_tls_from_the_environment(target, pki):
    """`specserve up` with SPECSERVE_TLS_* set (every service on TLS, each dialing its peer
    over TLS) waits for its children over TLS and serves `generate --tls-ca`; a TLS variable
    naming no file is a usage error before anything starts."""
    from tests.e2e.test_services import ENV, ROOT, _free_ports

    save_tokenizer(target, vocab_size=211)
    g, v, d = _free_ports(3)
    env = {**ENV, "SPECSERVE_TLS_CERT": str(pki["verifier"]),
           "SPECSERVE_TLS_KEY": str(pki["verifier-key"]), "SPECSERVE_PEER_TLS_CA": str(pki["ca"])}
    up = [sys.executable, "-m", "services.cli", "up", "--model", str(target), "--device", "cpu",
          "--gateway-port", str(g), "--verifier-port", str(v), "--drafter-port", str(d),
          "--no-drafter", "--startup-timeout-s", "60"]
    bad = subprocess.run(up, env={**env, "SPECSERVE_TLS_KEY": str(pki["ca"]) + ".missing"},
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "--tls-key: no such file" in bad.stderr, bad.stderr
    proc = subprocess.Popen(up, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("specserve up: ready") or proc.poll() is not None:
                break
        assert lines and lines[-1].startswith("specserve up: ready"), "".join(lines)
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", "generate", "--gateway", f"127.0.0.1:{g}",
             "--token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "9", "--ignore-eos",
             "--tls-ca", str(pki["ca"]), "--json"],
            capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 9
