"""A port already in use: no service shares it (gRPC's SO_REUSEPORT is off).

A second `start_server` on a bound port raises OSError "could not bind HOST:PORT (in use)"; each
`python -m services.NAME` on it exits non-zero with that message; `specserve up` refuses before
starting anything; a metrics port in use is the same error (another process's /metrics there
would be scraped as this one's), found before the models load.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from services.common import telemetry
from services.common.server import mark_serving, start_server
from tests.helpers import make_checkpoint, save_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "GRPC_VERBOSITY": "ERROR", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "SPECSERVE_GATEWAY_HTTP_PORT": "0"}
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny target checkpoint with a tokenizer.json beside it (each service can start on it)."""
    root, _ = make_checkpoint(tmp_path_factory.mktemp("ports-model"), "qwen3-gqa1-tied")
    return save_tokenizer(root)


@pytest.mark.asyncio
async def test_a_second_server_on_a_used_port_raises():
    first, port, _ = await start_server([], ["specserve.v1.Gateway"])
    try:
        with pytest.raises(OSError, match=rf"could not bind 127\.0\.0\.1:{port} \(in use\)"):
            second, _, _ = await start_server([], ["specserve.v1.Gateway"], port=port)
            await second.stop(0)  # (it shared the port)
    finally:
        await first.stop(0)
    again, bound, _ = await start_server([], [], port=port)  # free again: it binds
    await again.stop(0)
    assert bound == port


def _serve(service: str, port: int, model: Path, metrics_port: int = 0
           ) -> subprocess.CompletedProcess:
    flags = {"gateway": ["--verifier", "127.0.0.1:9"],
             "verifier": ["--device", "cpu", "--dtype", "float32", "--kv-memory-gb", "0.01"],
             "drafter": ["--device", "cpu", "--dtype", "float32", "--drafter-pages", "64"]}
    return subprocess.run(
        [sys.executable, "-m", f"services.{service}", "--host", "127.0.0.1", "--port", str(port),
         "--model", str(model), "--metrics-port", str(metrics_port), *flags[service]],
        capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)


@pytest.mark.asyncio
@pytest.mark.parametrize("service", ["gateway", "verifier", "drafter"])
async def test_a_service_on_a_used_port_exits_with_the_reason(model_dir, service):
    name = f"specserve.v1.{service.capitalize()}"
    holder, port, health = await start_server([], [name])
    await mark_serving(health, [name])  # another instance, serving
    try:
        out = await asyncio.to_thread(_serve, service, port, model_dir)
    finally:
        await holder.stop(0)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"specserve {service}: error: could not bind 127.0.0.1:{port} (in use)" \
        in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.asyncio
async def test_up_refuses_a_used_port_before_starting_anything(model_dir):
    holder, port, health = await start_server([], ["specserve.v1.Gateway"])
    await mark_serving(health, ["specserve.v1.Gateway"])  # a gateway already there
    free = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free.append(s.getsockname()[1])
    try:
        out = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), "--device",
            "cpu", "--gateway-port", str(port), "--verifier-port", str(free[0]),
            "--drafter-port", str(free[1])], capture_output=True, text=True, env=ENV,
            cwd=ROOT, timeout=60)
    finally:
        await holder.stop(0)
    assert out.returncode == 2, out.stdout + out.stderr  # as each service: a usage error
    assert f"specserve up: error: could not bind 127.0.0.1:{port} (in use)" in out.stderr
    assert "SERVING on" not in out.stdout and "(pid " not in out.stdout  # nothing started


@pytest.mark.parametrize("service", ["gateway", "verifier", "drafter"])
def test_a_service_whose_metrics_port_is_in_use_exits_with_the_reason(model_dir, service):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = _serve(service, 0, model_dir, metrics_port=port)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"specserve {service}: error: could not bind 127.0.0.1:{port} for /metrics " \
        "(in use)" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_metrics_port_in_use_raises_and_is_not_shared():
    registry = CollectorRegistry()
    Counter("specserve_probe_hits", "a metric", registry=registry).inc(3)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(OSError, match=rf"could not bind 127\.0\.0\.1:{port} for /metrics"):
            telemetry.start_metrics_server(registry, "127.0.0.1", port)
    server = telemetry.start_metrics_server(registry, "127.0.0.1", port)  # free now: it starts
    try:
        assert server is not None
    finally:
        telemetry.stop_metrics_server(server)


def test_a_bind_problem_is_told_in_words():
    """A port held elsewhere, an address no interface of this machine has (TEST-NET-1), and a
    host that is no address at all each say which; a free port none."""
    from services.common.server import bind_problem

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        assert bind_problem("127.0.0.1", holder.getsockname()[1]) == "in use"
    assert bind_problem("192.0.2.1", 0) == "not an address of this machine"
    assert bind_problem("999.1.1.1", 0).startswith("the host is not an address")
    assert bind_problem("127.0.0.1", 0) is None
