"""The drafter service over real gRPC (loopback, port 0) with a tiny random target + DFlash drafter.

Trees served over the Draft stream must equal an in-process `DFlashDrafter` fed the same batches;
bad entries fail alone; every way a request ends (a release in its stream, the stream closed or
cancelled) frees its context cache pages; a request belongs to the stream that drafted it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import pytest_asyncio
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.convert import tensor_to_pb
from services.common.server import channel
from services.drafter.core import DrafterCore, Entry
from services.drafter.server import SERVICE_NAME, DrafterConfig, serve
from specserve.drafters.base import DraftRequest
from specserve.drafters.dflash import DFlashDrafter
from specserve.drafters.ngram import find_ngram_continuation
from specserve.models.dflash import load_dflash
from specserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from tests.helpers import hf_config

VOCAB, TARGET_LAYERS, WIDTH = 211, 4, 2 * 96  # 2 tapped layers x hidden 96
PAGES, PAGE = 64, 16
DFLASH, NGRAM = common_pb2.DRAFTER_KIND_DFLASH, common_pb2.DRAFTER_KIND_NGRAM
RPC_S = 30.0
aio = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny random Qwen3 target and a DFlash drafter, both saved with save_pretrained."""
    import transformers
    from dflash.model import DFlashDraftModel

    torch.manual_seed(7)
    target = transformers.Qwen3ForCausalLM(hf_config(
        "qwen3-gqa4-yarn", num_hidden_layers=TARGET_LAYERS, initializer_range=0.2))
    tdir = tmp_path_factory.mktemp("drafter-svc-target")
    target.save_pretrained(tdir)
    cfg = hf_config("qwen3-gqa4-yarn", num_hidden_layers=2, initializer_range=0.2)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size, cfg.num_target_layers = 16, TARGET_LAYERS
    cfg.dflash_config = {"target_layer_ids": [0, 2], "mask_token_id": VOCAB - 1}
    torch.manual_seed(8)
    ddir = tmp_path_factory.mktemp("drafter-svc-draft")
    DFlashDraftModel(cfg).save_pretrained(ddir)
    return tdir, ddir


def _dflash(checkpoints, num_pages: int = PAGES) -> DFlashDrafter:
    tdir, ddir = checkpoints
    return DFlashDrafter(load_dflash(ddir, tdir), num_pages=num_pages, page_size=PAGE,
                         poison=True)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def svc(checkpoints):
    core = DrafterCore(dflash=_dflash(checkpoints))
    tdir, ddir = checkpoints
    config = DrafterConfig(port=0, model=str(tdir), draft_model=str(ddir), device="cpu",
                           dtype="float32", page_size=PAGE, num_pages=PAGES)
    server, port = await serve(config, core=core)
    async with channel(f"127.0.0.1:{port}") as ch:
        yield SimpleNamespace(core=core, channel=ch, stub=drafter_pb2_grpc.DrafterStub(ch))
    await server.stop(0)


def _entry(rid: str, bonus: int, start: int, ctx: torch.Tensor | None = None, *,
           budget: int = 8, max_depth: int = 15, kind: int = DFLASH, history=()):
    msg = drafter_pb2.DraftEntry(request_id=rid, drafter=kind, bonus_token=bonus, start=start,
                                 budget=budget, max_depth=max_depth, new_history=list(history))
    if ctx is not None:
        msg.context.CopyFrom(tensor_to_pb(ctx))
    return msg


async def _step(call, step_id: int, entries, release=()) -> drafter_pb2.TreeBatch:
    await call.write(drafter_pb2.DraftBatch(step_id=step_id, entries=entries, release=release))
    reply = await call.read()
    assert reply.step_id == step_id and len(reply.trees) == len(entries)
    assert [t.request_id for t in reply.trees] == [e.request_id for e in entries]
    return reply


async def _close(call) -> None:
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


def _pages_free(core: DrafterCore) -> list[int]:
    cache = core.dflash.cache
    return [cache.num_free_pages(layer) for layer in range(core.dflash.model.config.num_layers)]


def _tree(t) -> tuple[list[int], list[int], list[int]]:
    return list(t.token_ids), list(t.parents), list(t.depths)


# (request, context rows this step, budget, max_depth) per step; None = not in this step's batch
SCHEDULE = [
    [("a", 7, 8, 15), ("b", 20, 16, 15)],
    [("a", 1, 8, 15), ("b", 5, 16, 15), ("c", 13, 4, 15)],
    [("c", 2, 4, 15), ("a", 3, 8, 15)],
    [("b", 1, 16, 3), ("a", 1, 1, 15), ("c", 1, 4, 15)],
]


@aio
async def test_draft_stream_equals_in_process_dflash(svc, checkpoints):
    ref = _dflash(checkpoints)
    g = torch.Generator().manual_seed(0)
    held: dict[str, int] = {}
    call = svc.stub.Draft(timeout=RPC_S)
    for step_id, batch in enumerate(SCHEDULE, start=100):
        entries, requests = [], []
        for rid, rows, budget, depth in batch:
            ctx = torch.randn(rows, WIDTH, generator=g)
            bonus = int(torch.randint(0, VOCAB - 1, (1,), generator=g))
            held[rid] = start = held.get(rid, 0) + rows
            entries.append(_entry(rid, bonus, start, ctx, budget=budget, max_depth=depth))
            requests.append(DraftRequest(rid, bonus, start, budget, depth, context=ctx))
        reply = await _step(call, step_id, entries)
        expected = ref.draft(requests)
        for tree, want, (_, _, budget, depth) in zip(reply.trees, expected, batch, strict=True):
            assert tree.error == ""
            assert _tree(tree) == (want.token_ids.tolist(), want.parents.tolist(),
                                   want.depths.tolist())
            assert 0 < len(tree.token_ids) <= budget and max(tree.depths) <= depth
        assert reply.forward_s > 0 and reply.tree_build_s > 0
    assert {r: svc.core.dflash.cache.length(r) for r in held} == held
    await _close(call)
    assert all(svc.core.dflash.cache.length(r) == 0 for r in held)  # the closed stream released


@aio
async def test_ngram_uses_accumulated_history_and_kinds_resolve(svc):
    first = [1, 2, 3, 4, 5, 1, 2, 3]
    call = svc.stub.Draft(timeout=RPC_S)
    reply = await _step(call, 1, [
        _entry("ng", 3, 8, budget=4, kind=NGRAM, history=first),
        _entry("plain", 9, 0, budget=8, kind=common_pb2.DRAFTER_KIND_NONE, history=[9]),
        _entry("default", 5, 6, torch.randn(6, WIDTH), kind=common_pb2.DRAFTER_KIND_UNSPECIFIED),
    ])
    ng, plain, default = reply.trees
    assert _tree(ng) == ([4, 5, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4])  # after the earlier "1 2 3"
    assert (plain.error, len(plain.token_ids)) == ("", 0)
    assert default.error == "" and len(default.token_ids) == 8
    assert svc.core.dflash.cache.length("default") == 6  # unspecified = dflash when loaded
    reply = await _step(call, 2, [_entry("ng", 5, 10, budget=6, kind=NGRAM, history=[4, 5])])
    history = first + [4, 5]
    assert svc.core.history("ng") == history
    (ng,) = reply.trees
    assert list(ng.token_ids) == find_ngram_continuation(history, num_tokens=6) == [1, 2, 3, 4, 5]
    assert list(ng.depths) == [1, 2, 3, 4, 5]
    await _close(call)
    assert svc.core.history("ng") == []


@aio
async def test_bad_entries_fail_alone_and_the_stream_goes_on(svc):
    call = svc.stub.Draft(timeout=RPC_S)
    bad_tensor = _entry("e-tensor", 4, 3)
    bad_tensor.context.CopyFrom(common_pb2.Tensor(data=b"\0" * 12, dtype="float32", shape=[3, 2]))
    reply = await _step(call, 7, [
        _entry("e-ok", 4, 5, torch.randn(5, WIDTH)),
        _entry("e-gap", 4, 10, torch.randn(4, WIDTH)),  # rows [6, 10) but nothing held yet
        _entry("e-kind", 4, 5, torch.randn(5, WIDTH), kind=42),
        bad_tensor,
        _entry("e-root", 4, 5, torch.randn(5, WIDTH), history=[1, 2]),  # must end with 4
    ])
    ok, gap, kind, tensor, root = reply.trees
    assert ok.error == "" and len(ok.token_ids) == 8
    assert "must continue at 0" in gap.error and len(gap.token_ids) == 0
    assert "'DrafterKind 42' is not loaded" in kind.error
    assert tensor.error.startswith("INVALID_ARGUMENT:") and "shape [3, 2]" in tensor.error
    assert "must end with the root" in root.error
    assert svc.core.dflash.cache.length("e-gap") == 0  # the rejected entry left no state
    reply = await _step(call, 8, [_entry("e-gap", 4, 4, torch.randn(4, WIDTH)),
                                  _entry("e-ok", 6, 6, torch.randn(1, WIDTH))])
    assert [t.error for t in reply.trees] == ["", ""]
    assert all(len(t.token_ids) == 8 for t in reply.trees)
    await _close(call)


@aio
async def test_the_lane_answers_as_the_stream_and_releases_on_close(svc):
    """The same batch on the same-host lane (found by Attach) and on the stream: the same
    trees, a bad entry failing alone; a RELEASE frame and the lane's close free the cache."""
    from services.common import lane

    attach = await svc.stub.Attach(drafter_pb2.AttachRequest(), timeout=RPC_S)
    assert attach.lane_path and attach.lane_token and not attach.ring_attached
    rows = torch.randn(5, WIDTH)

    def batch(step_id, prefix):
        bad = _entry(f"{prefix}-bad", 4, 3)
        bad.context.CopyFrom(common_pb2.Tensor(data=b"\0" * 12, dtype="float32", shape=[3, 2]))
        return drafter_pb2.DraftBatch(step_id=step_id, entries=[
            _entry(f"{prefix}-ok", 4, 5, rows), bad,
            _entry(f"{prefix}-ng", 3, 8, budget=4, kind=NGRAM, history=[1, 2, 3, 4, 5, 1, 2, 3])])

    call = svc.stub.Draft(timeout=RPC_S)
    await call.write(batch(4, "s"))
    streamed = await call.read()

    def on_the_lane():
        client = lane.LaneClient(attach.lane_path, attach.lane_token, 5.0)
        try:
            client.send(lane.BATCH, batch(4, "l").SerializeToString())
            kind, payload = client.recv(RPC_S)
            held = svc.core.dflash.cache.length("l-ok")
            client.send(lane.RELEASE, drafter_pb2.ReleaseRequest(
                request_ids=["l-ng"]).SerializeToString())
            return kind, drafter_pb2.TreeBatch.FromString(payload), held
        finally:
            client.close()

    kind, laned, held = await asyncio.to_thread(on_the_lane)
    assert kind == lane.TREES and laned.step_id == streamed.step_id == 4
    assert [t.request_id for t in laned.trees] == ["l-ok", "l-bad", "l-ng"]
    for a, b in zip(laned.trees, streamed.trees, strict=True):
        assert (_tree(a), a.error.replace("l-", "s-")) == (_tree(b), b.error)
    assert laned.trees[1].error.startswith("INVALID_ARGUMENT:") and held == 5
    await _close(call)
    for _ in range(100):  # the lane's thread releases what it drafted once it sees the close
        if svc.core.dflash.cache.length("l-ok") == 0:
            break
        await asyncio.sleep(0.02)
    assert svc.core.dflash.cache.length("l-ok") == 0 and svc.core.history("l-ng") == []
    assert _pages_free(svc.core) == [PAGES, PAGES]


def test_core_isolates_a_failing_drafter_and_an_unloaded_one(checkpoints, caplog):
    small = DrafterCore(dflash=_dflash(checkpoints, num_pages=2))  # 32 slots: 40 rows can't fit
    big = DraftRequest("big", 3, 40, 4, 15, context=torch.randn(40, WIDTH))
    small_one = DraftRequest("small", 3, 4, 4, 15, context=torch.randn(4, WIDTH))
    ngram = DraftRequest("ng", 2, 3, 4, 15)
    with caplog.at_level(logging.WARNING):
        results = small.draft([Entry(big, "dflash"), Entry(small_one, "dflash"),
                               Entry(ngram, "ngram", (1, 2, 1, 2))])
    # the whole dflash call failed, as a full cache: a capacity error, no traceback
    assert all(r.startswith("RESOURCE_EXHAUSTED: dflash drafter: drafter context cache")
               for r in results[:2]), results[:2]
    assert [(r.levelno, r.exc_info) for r in caplog.records] == [(logging.WARNING, None)]
    assert results[2].token_ids.tolist() == [1, 2]
    assert small.dflash.cache.length("small") == 0
    no_dflash = DrafterCore()
    other = DraftRequest("ng2", 2, 3, 4, 15)
    results = no_dflash.draft([Entry(ngram, "dflash", (1, 2, 1, 2)),
                               Entry(other, None, (1, 2, 1, 2)),
                               "INVALID_ARGUMENT: passed through"])
    assert "'dflash' is not loaded" in results[0]
    assert results[1].token_ids.tolist() == [1, 2]  # unspecified = ngram without dflash
    assert results[2] == "INVALID_ARGUMENT: passed through"


@aio
async def test_release_frees_the_context_cache(svc):
    assert _pages_free(svc.core) == [PAGES, PAGES]
    call = svc.stub.Draft(timeout=RPC_S)
    await _step(call, 1, [_entry("r1", 1, 40, torch.randn(40, WIDTH)),
                          _entry("r2", 2, 3, torch.randn(3, WIDTH))])
    r2_pages = -(-(3 + 16) // PAGE)  # context + block scratch
    assert _pages_free(svc.core) == [PAGES - r2_pages - 4] * 2  # r1: 40 + 16 slots = 4 pages
    await _step(call, 2, [], release=["r1", "nobody"])  # in the stream, before its entries
    assert svc.core.dflash.cache.length("r1") == 0
    assert _pages_free(svc.core) == [PAGES - r2_pages] * 2
    await _close(call)
    assert _pages_free(svc.core) == [PAGES, PAGES]


@aio
async def test_two_streams_with_one_id_each_draft_their_own_request(svc):
    """Two verifiers sharing the drafter may use the same request id: stream B's request of
    A's id is B's own — drafted on B's context and history (never A's), released by B alone —
    and A's state is untouched by it."""
    a, b = svc.stub.Draft(timeout=RPC_S), svc.stub.Draft(timeout=RPC_S)
    secret = [17, 29, 41, 17, 29, 41, 17, 29]  # A's prompt: an n-gram request would echo it
    await _step(a, 1, [_entry("own1", 3, 37, torch.randn(37, WIDTH)),
                       _entry("own2", 29, 7, kind=NGRAM, history=secret)])
    held_a = _pages_free(svc.core)
    got = await _step(b, 1, [_entry("own1", 3, 5, torch.randn(5, WIDTH)),
                             _entry("own2", 29, 8, kind=NGRAM, history=[5, 29]),
                             _entry("own1-b", 4, 5, torch.randn(5, WIDTH))])
    assert not any(t.error for t in got.trees), [t.error for t in got.trees]
    assert 41 not in got.trees[1].token_ids  # A's history is not B's
    assert svc.core.history("own2") == secret  # A's, untouched
    await _step(b, 2, [], release=["own1", "own2"])  # B's own: A's stay
    assert svc.core.dflash.cache.length("own1") == 37 and svc.core.history("own2")
    await _close(b)
    assert _pages_free(svc.core) == held_a  # B's pages all back, A's held
    await _close(a)
    assert _pages_free(svc.core) == [PAGES, PAGES]


@aio
async def test_a_stream_holds_at_most_its_share_of_the_cache(checkpoints):
    """max_share 0.5: a stream that holds half the context pages gets RESOURCE_EXHAUSTED for
    more context while another stream still drafts."""
    core = DrafterCore(dflash=_dflash(checkpoints), max_share=0.5)
    tdir, ddir = checkpoints
    server, port = await serve(DrafterConfig(port=0, model=str(tdir), draft_model=str(ddir),
                                             device="cpu", dtype="float32", page_size=PAGE,
                                             num_pages=PAGES), core=core)
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = drafter_pb2_grpc.DrafterStub(ch)
            greedy, other = stub.Draft(timeout=RPC_S), stub.Draft(timeout=RPC_S)
            for i in range(6):  # 6 requests × (250 + 16) rows = 17 pages each per group
                got = await _step(greedy, i + 1, [_entry(f"g{i}", 1, 250,
                                                         torch.randn(250, WIDTH))])
                if got.trees[0].error:
                    break
            assert i >= 1 and got.trees[0].error.startswith("RESOURCE_EXHAUSTED")
            held = 2 * PAGES - sum(_pages_free(core))
            assert PAGES <= held <= PAGES + 2 * 17  # at or just past its share of 2 × 64
            ok = await _step(other, 1, [_entry("o1", 2, 20, torch.randn(20, WIDTH))])
            assert not ok.trees[0].error
            await _close(greedy)
            await _close(other)
    finally:
        await server.stop(0)


@aio
async def test_cancelled_stream_releases_its_requests(svc):
    call = svc.stub.Draft(timeout=RPC_S)
    await _step(call, 1, [_entry("c1", 1, 9, torch.randn(9, WIDTH)),
                          _entry("c2", 2, 30, torch.randn(30, WIDTH), kind=NGRAM, history=[2])])
    assert svc.core.dflash.cache.length("c1") == 9 and svc.core.history("c2") == [2]
    call.cancel()
    assert await call.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 10
    while _pages_free(svc.core) != [PAGES, PAGES] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert _pages_free(svc.core) == [PAGES, PAGES]
    assert svc.core.dflash.cache.length("c1") == 0 and svc.core.history("c2") == []


@aio
async def test_health_and_reflection(svc):
    health = health_pb2_grpc.HealthStub(svc.channel)
    for name in ("", SERVICE_NAME):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=RPC_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(svc.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=RPC_S)]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


@aio
async def test_main_serves_until_sigterm(checkpoints, tmp_path):
    tdir, ddir = checkpoints
    port_file = tmp_path / "port"
    env = {**os.environ, "SPECSERVE_DRAFTER_PORT": "0", "SPECSERVE_DEVICE": "cpu",
           "GRPC_VERBOSITY": "ERROR"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.drafter", "--model", str(tdir), "--draft-model",
         str(ddir), "--drafter-pages", "8", "--port-file", str(port_file)],
        cwd=Path(__file__).resolve().parents[2], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 40
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        port = int(port_file.read_text())
        async with channel(f"127.0.0.1:{port}") as ch:
            reply = await drafter_pb2_grpc.DrafterStub(ch).Draft(iter([drafter_pb2.DraftBatch(
                step_id=3, entries=[_entry("m", 1, 2, torch.randn(2, WIDTH))])]),
                timeout=RPC_S).read()
            assert reply.step_id == 3 and len(reply.trees[0].token_ids) == 8
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert out.strip() == f"specserve drafter listening on 127.0.0.1:{port}"


def test_cuda_graphs_switch_reaches_the_config():
    from services.drafter.__main__ import build_parser, config_from_args

    args = build_parser().parse_args(["--cuda-graphs", "off"])
    assert config_from_args(args).cuda_graphs == "off"
    assert config_from_args(build_parser().parse_args([])).cuda_graphs == "auto"
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        DrafterConfig(cuda_graphs="sometimes")


def test_the_drafter_takes_no_peer_flags_and_its_threads_help_is_its_own(capsys):
    """The drafter dials nobody: a --peer-* flag is a usage error there, not silently unused;
    its --threads auto is its own rule, not the verifier's."""
    from services.drafter.__main__ import build_parser
    from services.verifier.__main__ import build_parser as verifier_parser

    for flag in ("--peer-token", "--peer-tls-ca"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([flag, "x"])
        assert e.value.code == 2
        assert f"unrecognized arguments: {flag} x" in capsys.readouterr().err
    verifier = verifier_parser().parse_args(["--peer-token", "t"])
    assert verifier.peer_token == "t"
    text = " ".join(build_parser().format_help().split())  # argparse wraps its lines
    assert "the verifier beside it has the other half" in text
    assert "steps that carry prompt tokens" not in text


@aio
async def test_cache_gauges_are_set_before_the_first_batch(checkpoints):
    from services.common.metrics import DrafterMetrics

    tdir, ddir = checkpoints
    metrics, core = DrafterMetrics(), DrafterCore(dflash=_dflash(checkpoints))
    config = DrafterConfig(port=0, model=str(tdir), draft_model=str(ddir), device="cpu",
                           dtype="float32", page_size=PAGE, num_pages=PAGES)
    server, _ = await serve(config, core=core, metrics=metrics)
    try:
        free = {s.labels["group"]: s.value for s in metrics.cache_pages.collect()[0].samples
                if s.labels["state"] == "free"}
        assert free and all(v == PAGES for v in free.values()), free
    finally:
        await server.stop(0)
