"""Gateway replica choice (services/gateway/replicas.py) against in-process fake verifiers that
answer gRPC health and Stats with loads the test sets."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.gateway.replicas import VERIFIER_SERVICE, Replicas, parse_addresses
from specserve.v1 import verifier_pb2, verifier_pb2_grpc


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, active: int, waiting: int, used: int, total: int = 100,
                 max_model_len: int = 0) -> None:
        self.reply = verifier_pb2.StatsReply(active_requests=active, waiting_requests=waiting,
                                             kv_pages_used=used, kv_pages_total=total,
                                             max_model_len=max_model_len)

    async def Stats(self, request, context):  # noqa: N802
        return self.reply


async def _serve(fake: FakeVerifier, serving: bool = True):
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(fake, server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    status = "SERVING" if serving else "NOT_SERVING"
    await checker.set(VERIFIER_SERVICE, health_pb2.HealthCheckResponse.ServingStatus.Value(status))
    return server, f"127.0.0.1:{port}"


async def _replicas(*fakes, serving=None):
    servers, addresses = [], []
    for i, fake in enumerate(fakes):
        server, address = await _serve(fake, True if serving is None else serving[i])
        servers.append(server)
        addresses.append(address)
    reps = Replicas({a: grpc.aio.insecure_channel(a) for a in addresses})
    await asyncio.gather(*(reps.poll(r, 2.0) for r in reps.replicas))
    return servers, reps


def test_addresses_parse_from_lists_and_commas_and_bad_ones_are_refused():
    assert parse_addresses("a:1, b:2") == ("a:1", "b:2")
    assert parse_addresses(["a:1", "b:2,c:3"]) == ("a:1", "b:2", "c:3")
    for bad in ("", "a", "a:x", ":5", "a:1,a:1"):
        with pytest.raises(ValueError):
            parse_addresses(bad)


def test_the_least_loaded_healthy_replica_is_picked_and_open_calls_count():
    async def main():
        servers, reps = await _replicas(FakeVerifier(3, 2, 10, max_model_len=4096),
                                        FakeVerifier(1, 0, 90, max_model_len=32768),
                                        FakeVerifier(0, 0, 0), serving=[True, True, False])
        busy, light, down = reps.replicas
        assert (busy.healthy, light.healthy, down.healthy) == (True, True, False)
        # the longest context of any replica (one without Stats yet tells nothing)
        assert (busy.max_model_len, down.max_model_len, reps.max_model_len) == (4096, None,
                                                                                32768)
        assert (busy.queue, light.queue, light.kv_fill) == (5, 1, 0.9)
        got = [reps.pick() for _ in range(6)]
        # light: queue 1 → open 1..: it takes requests until its open count passes busy's 5
        assert [r is light for r in got] == [True] * 5 + [False]
        assert light.open == 5 and busy.open == 1 and down.open == 0
        for r in got:
            reps.release(r)
        assert light.open == busy.open == 0
        await reps.close()
        for s in servers:
            await s.stop(0)

    asyncio.run(main())


def test_a_replica_that_goes_down_is_skipped_until_its_health_check_passes():
    async def main():
        servers, reps = await _replicas(FakeVerifier(0, 0, 5), FakeVerifier(0, 0, 50))
        first, second = reps.replicas

        def pick():  # one request picked and done
            replica = reps.pick()
            reps.release(replica)
            return replica
        assert pick() is first  # equal queues: the lower KV fill
        reps.mark_down(first, "UNAVAILABLE")
        assert pick() is second
        await servers[1].stop(0)
        changed = await reps.poll(second, 0.5)
        assert changed and not second.healthy
        assert await reps.poll(first, 2.0) and first.healthy  # its health check passes again
        assert pick() is first
        reps.mark_down(first, "UNAVAILABLE")
        assert not reps.any_healthy
        assert pick() is first  # none healthy: the least loaded (its call fails fast)
        seen, changed = [], asyncio.Event()
        task = asyncio.create_task(reps.follow(0.05, 0.5, lambda up: (seen.append(up),
                                                                     changed.set())))
        await asyncio.wait_for(changed.wait(), 10)
        task.cancel()
        assert seen[0] is True  # `first` serves again after its next check
        await reps.close()
        await servers[0].stop(0)

    asyncio.run(main())


def test_the_probe_table_names_the_replica_when_there_are_several():
    from dataclasses import replace

    from specserve import probe

    row = probe.ProbeRow(text="code", context=1024, new_tokens=32, steps=9, commit_len=3.6,
                         depth=2.6, drafts=15.0, wall_s=0.4, prefill_s=0.1, ttft_s=0.12,
                         step_ms=31.0, first_step_ms=40.0, steady_step_ms=29.5, fallbacks=0,
                         stream_commit_len=3.6, verifier="10.0.0.1:50052")
    one = probe.table([row, replace(row, text="prose")])
    assert "verifier" not in one and "10.0.0.1" not in one
    two = probe.table([row, replace(row, verifier="10.0.0.2:50052")])
    head, rule, *lines = two.splitlines()
    assert head.endswith("| verifier |") and rule.count("---") == 15
    assert [ln.rsplit("|", 2)[1].strip() for ln in lines] == ["10.0.0.1:50052",
                                                               "10.0.0.2:50052"]
    assert probe.rows_as_json([row])[0]["verifier"] == "10.0.0.1:50052"
