"""A gateway gRPC request with a very long client-chosen request id, beside normal requests:
each line is (status, tokens, seconds[, details]). Before ids were bounded, a 1M-character id
blocked the verifier-drafter lane and every request after it timed out; now it is refused.

    specserve up --ports 64051 --http-port 64054 --metrics-ports 64055 --device cpu
    PYTHONPATH=. python experiments/long_request_id.py 1000000 127.0.0.1:64051
"""

from __future__ import annotations

import asyncio
import sys
import time

import grpc

from specserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


async def gen(stub, rid: str, n: int = 200, timeout: float = 20):
    t0, k = time.perf_counter(), 0
    req = gateway_pb2.GenerateRequest(request_id=rid, text="The cat sat on the",
                                      sampling=common_pb2.SamplingParams(
                                          max_tokens=n, temperature=0, ignore_eos=True))
    try:
        async for ev in stub.Generate(req, timeout=timeout):
            if ev.HasField("chunk"):
                k += len(ev.chunk.token_ids)
            else:
                return "OK", k, round(time.perf_counter() - t0, 2)
    except grpc.aio.AioRpcError as e:
        return e.code().name, k, round(time.perf_counter() - t0, 2), e.details()[:100]


async def main(size: int, gateway: str) -> None:
    stub = gateway_pb2_grpc.GatewayStub(grpc.aio.insecure_channel(
        gateway, options=[("grpc.max_send_message_length", 64 << 20)]))
    print("before       ", await gen(stub, "normal-0"))
    print("both at once ", await asyncio.gather(gen(stub, "normal-1"), gen(stub, "B" * size)))
    print("after        ", await gen(stub, "normal-2"))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1:64051"))
