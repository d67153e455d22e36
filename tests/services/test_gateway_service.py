"""The gateway in process (`serve`, loopback, port 0) in front of a fake verifier.

Its health follows the verifier's (NOT_SERVING while the verifier is down or not serving,
SERVING again when it is back) and its watcher task ends with it; a request whose deadline
expires is counted as DEADLINE_EXCEEDED; an unreachable verifier's address stays in the log,
out of the client's message; a stop list over the configured limits fails with
INVALID_ARGUMENT before the verifier is called.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.server import channel, mark_serving, start_server
from services.gateway import convert
from services.gateway.server import GatewayConfig, serve
from specserve.types import SamplingParams
from specserve.v1 import common_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.helpers import save_tokenizer

VERIFIER = "specserve.v1.Verifier"
GATEWAY = "specserve.v1.Gateway"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
RPC_S = 20.0
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A directory holding only a small tokenizer.json (all the gateway reads)."""
    return save_tokenizer(tmp_path_factory.mktemp("gateway-model"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Streams `tokens` one event each (after `delay_s`), then a LENGTH final; keeps requests."""

    def __init__(self, tokens=(71, 104, 33), delay_s: float = 0.0) -> None:
        self.tokens, self.delay_s, self.requests = tokens, delay_s, []

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        self.requests.append(request)
        for t in self.tokens:
            await asyncio.sleep(self.delay_s)
            yield verifier_pb2.VerifyEvent(token_ids=[t], commit_len=1)
        yield verifier_pb2.VerifyEvent(final=verifier_pb2.VerifyFinal(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_ids),
                                   completion_tokens=len(self.tokens))))


async def start_verifier(fake: FakeVerifier, port: int = 0):
    """A gRPC server with the fake on it, health SERVING for the verifier's service name."""
    server, port, health = await start_server(
        [(verifier_pb2_grpc.add_VerifierServicer_to_server, fake)], [VERIFIER], port=port)
    await mark_serving(health, [VERIFIER])
    return server, port, health


@asynccontextmanager
async def running_gateway(tmp_path: Path, **config):
    """`serve` as a task until the block ends; yields (address, config). Afterwards no task of
    the gateway is left behind."""
    port_file = tmp_path / f"gateway-{time.monotonic_ns()}.port"
    cfg = GatewayConfig(**{"http_port": None, **config}, port=0, port_file=str(port_file),
                        grace_s=0.2)
    before = asyncio.all_tasks()
    stop = asyncio.Event()
    task = asyncio.ensure_future(serve(cfg, stop))
    deadline = time.monotonic() + RPC_S
    while not port_file.exists():
        assert not task.done(), task.exception()
        assert time.monotonic() < deadline, "gateway not up"
        await asyncio.sleep(0.02)
    try:
        yield f"127.0.0.1:{int(port_file.read_text())}", cfg
    finally:
        stop.set()
        await asyncio.wait_for(task, RPC_S)
        await asyncio.sleep(0)  # let cancelled tasks finish

        def left() -> list:
            return [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()
                    and not t.done()
                    and not t.get_coro().__qualname__.startswith("AioServer.")]  # the fakes'

        if left():  # a cancelled call's status may take a moment on a loaded host
            await asyncio.wait(left(), timeout=2.0)
        assert not left(), f"tasks left behind: {left()}"


async def gateway_status(address: str) -> int:
    async with channel(address) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=GATEWAY), timeout=2.0)
        except grpc.aio.AioRpcError:
            return -1
        return reply.status


async def until_status(address: str, want: int, within_s: float) -> float:
    """Seconds until the gateway reports `want` (fails after `within_s`)."""
    t0 = time.monotonic()
    while (status := await gateway_status(address)) != want:
        assert time.monotonic() - t0 < within_s, f"status {status}, expected {want}"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def generate(address: str, prompt, stop=(), timeout: float = RPC_S,
                   request_id: str = "") -> list:
    params = SamplingParams(max_tokens=9, ignore_eos=True, stop=tuple(stop))
    async with channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        msgs = stub.Generate(convert.generate_request_to_pb(prompt, params, request_id=request_id),
                             timeout=timeout)
        return [convert.response_from_pb(m) async for m in msgs]


# ---- health follows the verifier -------------------------------------------------------------
@pytest.mark.asyncio
async def test_health_follows_the_verifier(model_dir, tmp_path):
    server, vport, vhealth = await start_verifier(FakeVerifier())
    try:
        async with running_gateway(tmp_path, model=str(model_dir),
                                   verifier=f"127.0.0.1:{vport}", health_period_s=0.1) as (addr, _):
            await until_status(addr, SERVING, within_s=2.0)
            await server.stop(0)
            assert await until_status(addr, NOT_SERVING, within_s=2.0) < 2.0
            server, _, vhealth = await start_verifier(FakeVerifier(), port=vport)
            assert await until_status(addr, SERVING, within_s=2.0) < 2.0
            assert len(await generate(addr, [5, 17, 3])) == 4  # three chunks and the final
            await vhealth.set(VERIFIER, NOT_SERVING)  # up but not serving (loading, draining)
            await until_status(addr, NOT_SERVING, within_s=2.0)
            await vhealth.set(VERIFIER, SERVING)
            await until_status(addr, SERVING, within_s=2.0)
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_health_is_not_serving_when_the_verifier_never_came_up(model_dir, tmp_path):
    async with running_gateway(tmp_path, model=str(model_dir),
                               verifier=f"127.0.0.1:{free_port()}",
                               health_period_s=0.1) as (addr, _):
        await until_status(addr, NOT_SERVING, within_s=2.0)
        await asyncio.sleep(0.35)  # several periods: it stays so
        assert await gateway_status(addr) == NOT_SERVING


def test_health_period_is_validated(model_dir):
    for bad in (0.0, -0.5):
        with pytest.raises(ValueError, match="health_period_s"):
            GatewayConfig(model=str(model_dir), health_period_s=bad)


# ---- deadlines and the error messages --------------------------------------------------------
def _requests_by_code(metrics_port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    return {m[1]: float(m[2]) for m in re.finditer(
        r'^specserve_gateway_requests_total\{api="grpc",code="(\w+)"\} (\S+)$', body.decode(),
        re.M)}


async def _counted(metrics_port: int, n: int) -> dict[str, float]:
    """The request counts by code once `n` requests are counted (5 s at most)."""
    deadline = time.monotonic() + 5
    while sum((counts := await asyncio.to_thread(_requests_by_code, metrics_port)).values()) < n:
        assert time.monotonic() < deadline, f"{n} requests never counted: {counts}"
        await asyncio.sleep(0.05)
    return counts


@pytest.mark.asyncio
async def test_an_expired_deadline_is_counted_as_deadline_exceeded(model_dir, tmp_path):
    server, vport, _ = await start_verifier(FakeVerifier(delay_s=1.7))
    metrics_port = free_port()
    try:
        async with running_gateway(tmp_path, model=str(model_dir), metrics_port=metrics_port,
                                   verifier=f"127.0.0.1:{vport}") as (addr, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(addr, [9, 40, 2, 77], timeout=0.35)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await _counted(metrics_port, 1) == {"DEADLINE_EXCEEDED": 1.0}
            async with channel(addr) as ch:  # a client cancel, no deadline: CANCELLED
                call = gateway_pb2_grpc.GatewayStub(ch).Generate(
                    convert.generate_request_to_pb([3, 8], SamplingParams(max_tokens=5)))
                await asyncio.sleep(0.25)
                call.cancel()
            assert await _counted(metrics_port, 2) == {"DEADLINE_EXCEEDED": 1.0,
                                                       "CANCELLED": 1.0}
    finally:
        await server.stop(0)


@pytest.mark.asyncio
async def test_unreachable_verifier_message_names_no_address(model_dir, tmp_path, caplog):
    port = free_port()
    caplog.set_level(logging.INFO, logger="specserve.gateway")
    async with running_gateway(tmp_path, model=str(model_dir),
                               verifier=f"127.0.0.1:{port}") as (addr, _):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(addr, "The quick brown fox")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    details = err.value.details()
    assert details == "verifier unavailable"
    assert str(port) not in details and "127.0.0.1" not in details
    logged = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert any(f"127.0.0.1:{port}" in m for m in logged), logged


# ---- the stop list is bounded -----------------------------------------------------------------
STOP_CASES = {  # with max_stop_strings 5 and max_stop_bytes 37
    "6 strings": (["a", "bc", "d", "ef", "g", "h"], "6 stop strings", "at most 5",
                  "--max-stop-strings"),
    "38 bytes": (["élan vital", "我们今天学习", "fox jumps"], "38 bytes", "at most 37",
                 "--max-stop-bytes"),
    "60 ASCII chars": (["ab" * 30], "at least 60 bytes", "at most 37", "--max-stop-bytes"),
}


@pytest.mark.asyncio
async def test_a_stop_list_over_the_limits_is_invalid_argument(model_dir, tmp_path):
    fake = FakeVerifier()
    server, vport, _ = await start_verifier(fake)
    try:
        async with running_gateway(tmp_path, model=str(model_dir), max_stop_strings=5,
                                   max_stop_bytes=37, verifier=f"127.0.0.1:{vport}") as (addr, _):
            for case, (stop, *words) in STOP_CASES.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(addr, [12, 6, 250], stop=stop)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
                for w in words:
                    assert w in err.value.details(), (case, err.value.details())
            assert fake.requests == []  # refused before any verifier call
            # exactly at both limits: 5 strings, 37 bytes
            at_limit = ["élan vital", "我们今天", "fox!", "zqxy", "ü ~ 3"]
            assert sum(len(s.encode()) for s in at_limit) == 37
            assert len(await generate(addr, [12, 6, 250], stop=at_limit)) >= 2
            assert len(fake.requests) == 1
    finally:
        await server.stop(0)


def test_stop_limits_are_validated_and_default(model_dir):
    cfg = GatewayConfig(model=str(model_dir))
    assert (cfg.max_stop_strings, cfg.max_stop_bytes) == (16, 4096)
    for bad in (dict(max_stop_strings=-1), dict(max_stop_bytes=-3)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GatewayConfig(model=str(model_dir), **bad)


def test_stop_limit_flags_and_environment(monkeypatch, model_dir):
    from services.gateway.__main__ import build_parser, config_from_args

    monkeypatch.setenv("SPECSERVE_MAX_STOP_STRINGS", "7")
    monkeypatch.setenv("SPECSERVE_MAX_STOP_BYTES", "1234")
    cfg = config_from_args(build_parser().parse_args(["--model", str(model_dir)]))
    assert (cfg.max_stop_strings, cfg.max_stop_bytes) == (7, 1234)
    cfg = config_from_args(build_parser().parse_args(
        ["--model", str(model_dir), "--max-stop-strings", "3", "--max-stop-bytes", "99"]))
    assert (cfg.max_stop_strings, cfg.max_stop_bytes) == (3, 99)


@pytest.mark.asyncio
async def test_a_budget_outside_the_core_bound_is_refused_at_the_edge(model_dir, tmp_path):
    from services.gateway import openai_api
    from specserve.spec.tree import MAX_BUDGET

    fake = FakeVerifier()
    server, vport, _ = await start_verifier(fake)
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    try:
        async with running_gateway(tmp_path, model=str(model_dir),
                                   verifier=f"127.0.0.1:{vport}") as (addr, _):
            async with channel(addr) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                for bad in (-1, MAX_BUDGET + 1):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in stub.Generate(convert.generate_request_to_pb(
                                [12, 6], params, budget=bad), timeout=RPC_S):
                            pass
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert f"budget must be in [0, {MAX_BUDGET}], got {bad}" in \
                        err.value.details()
                assert fake.requests == []  # refused before any verifier call
                async for _ in stub.Generate(convert.generate_request_to_pb(
                        [12, 6], params, budget=MAX_BUDGET), timeout=RPC_S):
                    pass
            assert fake.requests[0].spec.budget == MAX_BUDGET  # the verifier caps it
    finally:
        await server.stop(0)
    with pytest.raises(openai_api.ApiError) as err:  # the HTTP front: the same check
        openai_api.parse({"prompt": "x", "budget": MAX_BUDGET + 1}, False, "m", None)
    assert (err.value.status, err.value.param) == (400, "budget")
    assert f"budget must be in [0, {MAX_BUDGET}]" in err.value.message
