"""The CUDA-graph step path's padding (engine/graphs.py), run eagerly on the CPU (its twin).

On a GPU the same padded static buffers are captured and replayed; here the test proves the
padding itself is invisible: greedy outputs equal transformers' for every drafter shape, logits
of a mixed batch equal the unpadded forward's, and pad rows and dummy requests write nothing a
real request reads (poisoned pool, NaN would surface).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from specserve.cudagraph import BATCH_BUCKETS, bucket_of
from specserve.engine.graphs import row_buckets
from specserve.engine.runner import ForwardInput
from specserve.spec.tree import DraftTree, verify_layout
from specserve.types import SamplingParams
from tests.fakes import RandomDDTreeDrafter, RandomTreeDrafter
from tests.helpers import hf_greedy, random_prompts
from tests.unit.test_speculative import LENGTHS


def test_switches():
    """auto / on / off: GPU-only features (CUDA graphs, warm-up) are on for CUDA under auto."""
    from specserve.config import EngineConfig, switched_on

    assert switched_on("auto", "cuda:1") and not switched_on("auto", "cpu")
    assert switched_on("on", "cpu") and not switched_on("off", "cuda")
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        EngineConfig("m", cuda_graphs="yes")


def test_buckets():
    assert row_buckets(65) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65]
    assert row_buckets(17)[-3:] == [9, 16, 17] and row_buckets(1) == [1]
    assert bucket_of(18, row_buckets(65)) == 32 and bucket_of(66, row_buckets(65)) is None
    assert bucket_of(3, BATCH_BUCKETS) == 4


def test_padded_path_is_lossless(checkpoint_cache, make_engine):
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    prompts = random_prompts(5, hf.config.vocab_size, LENGTHS[:5], seed=8)
    expected = [hf_greedy(hf, p, 40) for p in prompts]
    for drafter, budget in ((RandomTreeDrafter(hf.config.vocab_size, seed=2), 20),
                            (RandomDDTreeDrafter(hf.config.vocab_size, depth=5, seed=1), 12),
                            (None, 0)):
        engine = make_engine(path, page_size=4, max_draft_tokens=20, cuda_graphs="on",
                             max_num_batched_tokens=48)
        assert engine.runner.graphs is not None and not engine.runner.graphs.capture
        engine.set_drafter(drafter)
        out = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), budget)
        assert out == expected
        assert engine.runner.graphs._graphs  # the padded path really ran


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or bool(os.environ.get("TRITON_INTERPRET")),
    reason="needs a CUDA device (and TRITON_INTERPRET unset)"))])
def test_a_small_budgets_pad_rows_past_its_reservation_go_to_the_trash_page(checkpoint_cache,
                                                                            make_engine, device):
    """Plain decoding reserves no scratch, a tree its own budget's rows: beside a budget-20
    tree, the padded path's rows bucket runs past a budget-0 or budget-2 request's pages, onto
    the trash page — every output is still transformers' greedy (on a GPU, with captured
    graphs: the eager engine's tokens)."""
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    prompts = random_prompts(4, hf.config.vocab_size, [37, 5, 61, 18], seed=3)
    cfg = dict(page_size=4, max_draft_tokens=20, max_num_batched_tokens=48, device=device)
    expected = [hf_greedy(hf, p, 30) for p in prompts] if device == "cpu" else \
        make_engine(path, cuda_graphs="off", **cfg).generate(
            prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    engine = make_engine(path, cuda_graphs="on", **cfg)
    engine.set_drafter(RandomTreeDrafter(hf.config.vocab_size, seed=5))
    budgets = (0, 20, 2, 20)
    for i, (p, b) in enumerate(zip(prompts, budgets, strict=True)):
        engine.add_request(f"m{i}", p, SamplingParams(max_tokens=30, ignore_eos=True), b)
    got, reserved = {f"m{i}": [] for i in range(4)}, {}
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        for i in (0, 2):  # reserved at the step's start: at most its tokens now + its scratch
            if (seq := engine.requests.get(f"m{i}")) is not None and not seq.in_prefill:
                scratch = budgets[i] + 1 if budgets[i] else 0
                reserved.setdefault(i, []).append(
                    engine.blocks.reserved(seq.request_id) <= -(-(seq.num_tokens + scratch) // 4))
    assert [got[f"m{i}"] for i in range(4)] == expected
    assert len(reserved) == 2 and all(all(ok) for ok in reserved.values()), reserved
    assert engine.runner.graphs._graphs


def _trees_step(engines, hf, prompts, sizes, rng, tag):
    """Prefill `prompts` in every engine, then one step of trees of `sizes` nodes: the inputs
    and their rows (the same for every engine)."""
    inputs, rows = [], []
    for engine in engines:
        for i, p in enumerate(prompts):  # prefill (eager in both), then pages for the trees
            rid = f"{tag}{i}"
            engine.blocks.reserve(rid, len(p) + 40)
            engine.blocks.ensure(rid, len(p) + 32)
            engine.runner.forward([ForwardInput(rid, p, range(len(p)), 0,
                                               pages=engine.blocks.page_table(rid))],
                                  [len(p) - 1])
    for i, (p, n) in enumerate(zip(prompts, sizes, strict=True)):
        parents = np.array([rng.integers(0, j + 1) for j in range(n)], dtype=np.int32)
        depths = np.zeros(n, dtype=np.int32)
        for j, par in enumerate(parents):
            depths[j] = 1 if par == 0 else depths[par - 1] + 1
        tree = DraftTree(rng.choice(hf.config.vocab_size, n, replace=False).astype(np.int64),
                         parents, depths)
        lay = verify_layout(tree, int(rng.integers(hf.config.vocab_size)), len(p))
        pages = engines[0].blocks.page_table(f"{tag}{i}")  # the same in every engine
        inputs.append(ForwardInput(f"{tag}{i}", lay.token_ids, lay.positions, len(p), lay.mask,
                                   pages=pages))
        end = sum(len(x.token_ids) for x in inputs)
        rows += list(range(end - len(lay.token_ids), end))
    return inputs, rows


def _padded_vs_unpadded(checkpoint_cache, make_engine, device, dtype, graphs, tol):
    """3 requests (batch bucket 4: one dummy), trees of 1, 6 and 11 rows (rows bucket 16); then
    the same bucket again at contexts 20× longer, past the short-context class (set to 100
    tokens here): a second graph, planned for max_model_len and captured at dummy contexts,
    replays long."""
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    rng = np.random.default_rng(4)
    cfg = dict(page_size=4, max_draft_tokens=20, num_pages=1024, device=device, dtype=dtype)
    eager = make_engine(path, cuda_graphs="off", **cfg)
    padded = make_engine(path, cuda_graphs=graphs, **cfg)
    padded.runner.graphs.short_context = 100
    for tag, lengths in (("a", [9, 14, 6]), ("b", [180, 290, 230])):
        prompts = random_prompts(3, hf.config.vocab_size, lengths, seed=len(tag))
        inputs, rows = _trees_step((eager, padded), hf, prompts, (0, 5, 10), rng, tag)
        got_e, feat_e = eager.runner.forward(inputs, rows, taps=False)
        got_p, feat_p = padded.runner.forward(inputs, rows, taps=False)
        assert feat_e is None and feat_p is None and torch.isfinite(got_p).all()
        torch.testing.assert_close(got_p, got_e, rtol=tol, atol=tol)
        for engine in (eager, padded):
            for i in range(3):
                engine.blocks.free(f"{tag}{i}")
    keys = list(padded.runner.graphs._graphs)  # one bucket, a graph per context class
    assert keys == [(4, 16, (), 100), (4, 16, (), padded.runner.graphs.max_model_len)]
    return padded


def test_padded_logits_equal_unpadded(checkpoint_cache, make_engine):
    _padded_vs_unpadded(checkpoint_cache, make_engine, "cpu", "float32", "on", 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or bool(os.environ.get("TRITON_INTERPRET")),
                    reason="needs a CUDA device (and TRITON_INTERPRET unset)")
def test_captured_graphs_equal_eager_on_gpu(checkpoint_cache, make_engine):
    padded = _padded_vs_unpadded(checkpoint_cache, make_engine, "cuda", "float32", "auto", 2e-3)
    assert next(iter(padded.runner.graphs._graphs.values())).graph is not None  # captured


def test_warm_up_visits_every_rows_bucket(checkpoint_cache, make_engine):
    """With graphs, the services' warm-up runs one tree per rows bucket (so each bucket's graph
    is captured before the first request), then an AR step; it leaves no pages behind."""
    from specserve.engine.warmup import warm_up_engine

    path, _ = checkpoint_cache("qwen3-gqa4-yarn")
    engine = make_engine(path, max_draft_tokens=20, max_num_batched_tokens=40, cuda_graphs="on")
    sizes = []
    engine.on_step = lambda rid, s: sizes.append(s.tree_size)
    warm_up_engine(engine)
    want = [r - 1 for r in row_buckets(21) if r > 1]
    assert sizes[: len(want) + 1] == want + [0]
    assert sorted(k[1] for k in engine.runner.graphs._graphs) == row_buckets(21)


def test_warm_up_captures_the_served_trees_of_every_batch_bucket(checkpoint_cache,
                                                                 make_engine):
    """Given the rows of the trees it will serve, the warm-up also builds their graphs (AR and
    that tree's rows bucket, both context classes) for every batch bucket up to max_num_seqs,
    and nothing beyond: a burst's first step then replays instead of capturing."""
    from specserve.engine.warmup import warm_up_engine

    path, _ = checkpoint_cache("qwen3-gqa4-yarn")
    engine = make_engine(path, max_draft_tokens=20, max_num_batched_tokens=40, cuda_graphs="on",
                         max_num_seqs=6)
    graphs = engine.runner.graphs
    graphs.short_context = 64
    warm_up_engine(engine, (1, 7))  # 7 rows: the rows bucket 8
    keys = set(graphs._graphs)
    classes = {64, graphs.max_model_len}
    assert {(k[0], k[1]) for k in keys if k[0] > 1} == {(bb, nb) for bb in (2, 4, 8)
                                                        for nb in (1, 8)}
    assert {k[3] for k in keys if k[0] > 1} == classes
    assert sorted(k[1] for k in keys if k[0] == 1 and k[3] == 64) == row_buckets(21)
    assert graphs.warm(8, keys.pop()[2], (1, 7)) == 0  # all there already


def test_warm_captures_both_context_classes(checkpoint_cache, make_engine):
    """`StepGraphs.warm` builds every rows bucket of a batch bucket for the short-context class
    and the max_model_len class, once; the short class exists only below max_model_len."""
    path, _ = checkpoint_cache("qwen3-gqa4-yarn")
    engine = make_engine(path, max_draft_tokens=20, max_num_batched_tokens=40, cuda_graphs="on")
    graphs = engine.runner.graphs
    graphs.short_context = 64
    assert graphs.context_class(64) == 64 and graphs.context_class(65) == graphs.max_model_len
    assert graphs.warm(1, ()) == 2 * len(row_buckets(21)) and graphs.warm(1, ()) == 0
    assert sorted({k[3] for k in graphs._graphs}) == [64, graphs.max_model_len]
    graphs.short_context = graphs.max_model_len  # no class below the longest context
    assert graphs.context_class(5) == graphs.max_model_len


@pytest.mark.skipif(not torch.cuda.is_available() or bool(os.environ.get("TRITON_INTERPRET")),
                    reason="needs a CUDA device (and TRITON_INTERPRET unset)")
def test_warm_up_on_gpu_runs_the_prefill_path(checkpoint_cache, make_engine, monkeypatch):
    """On CUDA the warm-up also sends long chunks through attention.prefill (cuDNN), planned
    for the engine's prefill chunk and longest context."""
    from specserve.attention import prefill_warmup
    from specserve.engine.warmup import warm_up_engine

    real, ran = prefill_warmup.warm_up, []

    def spy(*args, **kwargs):
        ran.append((real(*args, **kwargs), kwargs))
        return ran[-1][0]

    monkeypatch.setattr(prefill_warmup, "warm_up", spy)
    path, _ = checkpoint_cache("qwen3-gqa4-yarn")
    engine = make_engine(path, max_draft_tokens=4, max_num_batched_tokens=40, device="cuda",
                         dtype="bfloat16", num_pages=256)
    warm_up_engine(engine)
    assert ran == [(True, dict(chunk=40, max_len=engine.max_model_len))]


def test_planned_for_plans_the_backend_and_restores_it():
    """Both graph classes capture with `planned_for` (capture needs a GPU): inside, the backend
    gets max_ctx_len; after — also after an error — the owner has its own backend back."""
    from types import SimpleNamespace

    from specserve.cudagraph import planned_for

    def backend(*args, **kwargs):
        return kwargs

    owner = SimpleNamespace(attn_backend=backend)
    with planned_for(owner, 4096):
        assert owner.attn_backend(1, 2) == {"max_ctx_len": 4096}
    assert owner.attn_backend is backend
    with pytest.raises(RuntimeError), planned_for(owner, 7):
        raise RuntimeError("capture failed")
    assert owner.attn_backend is backend
