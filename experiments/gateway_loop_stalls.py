"""One request against the others, through the gateway's HTTP API: how long a streaming
request's chunks stop (its largest gap between chunks, and a `/health` call's time) while a
heavy request is handled — 10M prompt ids over the context, a 10M-id /detokenize, a 5 MB
/tokenize with token texts —; how long a 20k-character prompt waits after ten 2.7 MB prompts
whose clients left at once; and how often a gRPC request id cut at a stop string fails when
reused at once (of 30). `--deadline-only`: how long a 13.8 MB prompt takes to be answered
(start the stack with SPECSERVE_REQUEST_TIMEOUT_S=3: tokenizing counts against the deadline).

    specserve up --ports P --http-port H --metrics-ports M     # a stack on the demo pair
    PYTHONPATH=. python experiments/gateway_loop_stalls.py --http H --grpc P [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import grpc

from specserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


async def _post(port: int, path: str, body: bytes, wait: bool = True):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            b"%d\r\nConnection: close\r\n\r\n" % (path.encode(), len(body)) + body)
    await w.drain()
    if not wait:
        await asyncio.sleep(0.2)
        w.transport.abort()
        return None
    t0 = time.perf_counter()
    data = await r.read()
    w.close()
    return time.perf_counter() - t0, data.split(b"\r\n")[0].decode()


async def _stream_gaps(port: int, stop: asyncio.Event) -> float:
    body = json.dumps({"prompt": "The cat sat on the", "max_tokens": 4000, "ignore_eos": True,
                       "stream": True, "drafter": "none"}).encode()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await w.drain()
    last, worst = None, 0.0
    while not stop.is_set():
        line = await r.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            now = time.perf_counter()
            worst = max(worst, now - last) if last is not None else 0.0
            last = now
    w.transport.abort()
    return worst


async def _health_s(port: int) -> float:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await w.drain()
    await r.read()
    w.close()
    return time.perf_counter() - t0


async def stall(port: int, path: str, body: bytes) -> dict:
    stop = asyncio.Event()
    gaps = asyncio.ensure_future(_stream_gaps(port, stop))
    await asyncio.sleep(1.5)
    heavy = asyncio.ensure_future(_post(port, path, body))
    await asyncio.sleep(0.3)
    health = await _health_s(port)
    took, status = await heavy
    await asyncio.sleep(0.5)
    stop.set()
    return {"heavy_s": round(took, 2), "status": status, "health_s": round(health, 3),
            "stream_max_gap_s": round(await gaps, 3)}


async def abandoned(port: int, n: int = 10, chars: int = 3_000_000) -> dict:
    random.seed(1)
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "mat", "x1", "quux"]

    def body(k):
        return json.dumps({"prompt": " ".join(random.choice(words) for _ in range(k // 5))[:k],
                           "max_tokens": 3}).encode()
    probe = body(20_000)
    before = (await _post(port, "/v1/completions", probe))[0]
    await asyncio.gather(*(_post(port, "/v1/completions", body(chars), False) for _ in range(n)))
    after = (await _post(port, "/v1/completions", probe))[0]
    return {"probe_before_s": round(before, 2), "probe_after_s": round(after, 2)}


def reuse(port: int, rounds: int = 30) -> dict:
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    def gen(stop, max_tokens):
        sp = common_pb2.SamplingParams(max_tokens=max_tokens, stop=stop, ignore_eos=True)
        for _ in stub.Generate(gateway_pb2.GenerateRequest(
                request_id="reuse-A", text="The cat sat on the", sampling=sp), timeout=30):
            pass
    fails = 0
    for _ in range(rounds):
        try:
            gen(["is"], 200)
            gen([], 20)
        except grpc.RpcError:
            fails += 1
    return {"reuse_failures": fails, "rounds": rounds}


async def deadline(port: int) -> dict:
    body = json.dumps({"prompt": "The cat sat on the mat. " * 575_000, "max_tokens": 3}).encode()
    took, status = await _post(port, "/v1/completions", body)
    return {"prompt_mb": round(len(body) / 1e6, 1), "status": status, "answered_s": round(took, 2)}


async def main(args) -> dict:
    if args.deadline_only:
        out = {"deadline": await deadline(args.http)}
        print(out, flush=True)
        return out
    ids = json.dumps({"prompt": [5, 6, 7, 8, 9] * 2_000_000, "max_tokens": 1}).encode()
    detok = json.dumps({"tokens": [5, 6, 7, 8, 9] * 2_000_000}).encode()
    text = json.dumps({"prompt": "The cat sat on the mat. " * 210_000,
                       "return_token_strs": True}).encode()
    out = {}
    for name, path, body in (("ids_over_context", "/v1/completions", ids),
                             ("detokenize_10M", "/detokenize", detok),
                             ("tokenize_5MB_strs", "/tokenize", text)):
        out[name] = await stall(args.http, path, body)
        print(name, out[name], flush=True)
    out["abandoned"] = await abandoned(args.http)
    print("abandoned", out["abandoned"], flush=True)
    out["reuse"] = await asyncio.to_thread(reuse, args.grpc)
    print("reuse", out["reuse"], flush=True)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--http", type=int, required=True)
    p.add_argument("--grpc", type=int, required=True)
    p.add_argument("--json")
    p.add_argument("--deadline-only", action="store_true")
    a = p.parse_args()
    result = asyncio.run(main(a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
