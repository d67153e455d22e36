"""The DFlash drafter's static block forward (drafters/dflash_graphs.py) vs its dynamic path.

On the CPU the static path runs eagerly (`capture=False`): the same padded buffers, dummy
requests on a trash page and per-step metadata copy a CUDA graph replays on a GPU. Its draft
logits must equal the dynamic path's over a batched multi-call scenario — requests joining late,
a bucket of 4 holding 3 real requests plus a dummy, blocks shrinking near max_depth (a call with
mixed block lengths replays one graph, the shorter blocks padded and masked to their length), a
sliding-window causal layer and a full bidirectional one,
4-token pages interleaved between requests and poisoned with NaN.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from specserve.drafters.base import DraftRequest
from specserve.drafters.dflash import DFlashDrafter
from tests.unit.test_dflash_cache import BLOCK, HIDDEN, WINDOW, tiny_model

# (request, new context rows, bonus, max_depth) per call
CALLS = [[("a", 23, 5, 99)], [("a", 4, 7, 99), ("b", 9, 11, 3)],
         [("b", 2, 2, 99), ("a", 1, 30, 2)], [("a", 3, 1, 99), ("b", 1, 4, 99)],
         [("c", 7, 9, 99), ("a", 2, 3, 99), ("b", 1, 8, 99)], [("c", 1, 6, 99)]]


def batches(device: str = "cpu", asks: dict[str, tuple[int, bool]] | None = None):
    """CALLS as request batches, each request asking for `asks[rid]` (budget, chain) or 8."""
    starts, seed = {}, 10
    for call in CALLS:
        batch = []
        for rid, n_new, bonus, depth in call:
            starts[rid] = starts.get(rid, 0) + n_new
            seed += 1
            ctx = torch.randn(n_new, 2 * HIDDEN, generator=torch.Generator().manual_seed(seed))
            budget, chain = (asks or {}).get(rid, (8, False))
            batch.append(DraftRequest(rid, bonus, starts[rid], budget=budget, max_depth=depth,
                                      context=ctx.to(device), chain=chain))
        yield batch


def run_calls(drafter: DFlashDrafter, device: str = "cpu") -> list[torch.Tensor]:
    return [lg for batch in batches(device) for lg in drafter.draft_logits(batch)]


def scaled(model):  # a checkpoint that scales its input embeddings (both paths must)
    model.config = dataclasses.replace(model.config, input_embedding_scale=1.7)
    return model


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused_layers"])
def test_static_block_forward_equals_dynamic(fused):
    """fused_layers: the block forward as the target's fused layers (their torch twins on the
    CPU: q|k|v and gate|up GEMMs, add + norm, q/k norm + RoPE + the block K/V write)."""
    want = run_calls(DFlashDrafter(scaled(tiny_model()), num_pages=60, page_size=4,
                                   poison=True))
    drafter = DFlashDrafter(scaled(tiny_model()), num_pages=60, page_size=4, poison=True,
                            graphs=True, capture=False, fused_layers=fused)
    assert drafter.graphs.fused == fused
    got = run_calls(drafter)
    # calls 2 and 3 mix a full block with one of depth 3 / 2: one replay of the full length
    assert sorted(drafter.graphs._graphs) == [(1, BLOCK), (2, BLOCK), (4, BLOCK)]
    assert [g.shape for g in got] == [w.shape for w in want] and len(got) == 11
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton interpreter on the CPU (CI sets TRITON_INTERPRET=1)")
def test_fused_layers_through_the_triton_kernels_equal_their_torch_twins(monkeypatch):
    """The fused block forward with the Triton kernels themselves (interpreted: add + norm, q/k
    norm + RoPE + the block K/V write into the drafter's paged groups, silu · up) gives the
    torch twins' logits over the same scenario."""
    import specserve.kernels.fused
    import specserve.models.dflash as dflash_model

    def drafter():
        return DFlashDrafter(scaled(tiny_model()), num_pages=60, page_size=4, poison=True,
                             graphs=True, capture=False, fused_layers=True)

    want = run_calls(drafter())
    monkeypatch.setattr(dflash_model, "fused_ops",
                        lambda impl, device: specserve.kernels.fused.fused_ops("triton", device))
    got = run_calls(drafter())
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_warm_up_builds_a_graph_per_batch_bucket_and_block_length():
    """The services' drafter warm-up builds the graph of every batch bucket up to `max_batch`
    and every block length, so the shrinking blocks of requests near max_tokens and the groups
    of mixed calls replay without building one inside a request; it leaves no request behind,
    and the graphs built ahead (a bucket's graphs share its context rows) draft as the others."""
    from specserve.engine.warmup import WARMUP_ID, warm_up_drafter

    want = run_calls(DFlashDrafter(tiny_model(), num_pages=60, page_size=4, poison=True))
    drafter = DFlashDrafter(tiny_model(), num_pages=60, page_size=4, poison=True, graphs=True,
                            capture=False)
    warm_up_drafter(drafter, context_rows=9, max_batch=3)
    warmed = set(drafter.graphs._graphs)
    assert warmed == {(bb, n) for bb in (1, 2, 4) for n in range(2, BLOCK + 1)}
    assert drafter.graphs.warm(4) == 0 and drafter.graphs.warm(5) == BLOCK - 1
    assert drafter.cache.length(WARMUP_ID) == 0
    got = run_calls(drafter)
    assert set(drafter.graphs._graphs) == warmed | {(8, n) for n in range(2, BLOCK + 1)}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_trash_pages_are_never_handed_out():
    drafter = DFlashDrafter(tiny_model(), num_pages=60, page_size=4, graphs=True, capture=False)
    run_calls(drafter)
    for name, group in drafter.cache.groups.items():
        trash = drafter.graphs.trash[name]
        assert trash not in group.free
        for entry in drafter.cache._requests.values():
            assert trash not in entry.pages[name].live


@pytest.mark.skipif(not torch.cuda.is_available() or bool(os.environ.get("TRITON_INTERPRET")),
                    reason="needs a CUDA device (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused_layers"])
def test_captured_block_forward_equals_dynamic_on_gpu(fused):
    """The same scenario with the block forwards captured as CUDA graphs and replayed (head_dim
    16: the Triton kernel's smallest); fused_layers: through the fused layer kernels."""
    model = tiny_model(head_dim=16).cuda()
    want = run_calls(DFlashDrafter(model, num_pages=60, page_size=4, poison=True), "cuda")
    drafter = DFlashDrafter(model, num_pages=60, page_size=4, poison=True, graphs=True,
                            fused_layers=fused)
    got = run_calls(drafter, "cuda")
    assert drafter.graphs.fused == fused
    assert all(st.graph is not None for st in drafter.graphs._graphs.values())
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_decode_context_rows_written_inside_the_graph():
    """Calls whose every request has a block and ≤ block-size new context rows have the graph
    write those rows (no eager context write); with a sliding window of 3 < the rows of a call,
    the rows below it go to the trash page. Logits equal the dynamic path's, call after call."""
    from specserve.models.dflash import DFlashDraftModel
    from specserve.models.dflash_config import DFlashConfig

    def model():
        base = tiny_model()
        cfg = DFlashConfig(**{**vars(base.config), "sliding_window": 3})
        m = DFlashDraftModel(cfg).eval()
        m.load_state_dict(base.state_dict())
        return m

    calls = [[("a", 13, 5), ("b", 9, 3)], [("a", 5, 7), ("b", 6, 2)], [("b", 2, 8), ("a", 1, 4)],
             [("a", 6, 1), ("b", 4, 9)], [("c", 3, 2), ("a", 2, 6), ("b", 1, 1)]]

    def run(drafter):
        starts, out, seed = {}, [], 40
        for call in calls:
            batch = []
            for rid, n_new, bonus in call:
                starts[rid] = starts.get(rid, 0) + n_new
                seed += 1
                ctx = torch.randn(n_new, 2 * HIDDEN, generator=torch.Generator().manual_seed(seed))
                batch.append(DraftRequest(rid, bonus, starts[rid], budget=8, max_depth=99,
                                          context=ctx))
            out += drafter.draft_logits(batch)
        return out

    want = run(DFlashDrafter(model(), num_pages=60, page_size=4, poison=True))
    drafter = DFlashDrafter(model(), num_pages=60, page_size=4, poison=True, graphs=True,
                            capture=False)
    eager_writes = []
    write = drafter._write_context
    drafter._write_context = lambda step, ctxs: (eager_writes.append(len(ctxs)), write(step, ctxs))
    got = run(drafter)
    assert eager_writes == [2]  # the first call's 13 / 9 rows; the later ones in the graph
    assert drafter.model.config.sliding_window < 6 == drafter.graphs.context_rows
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_context_slots_pad_rows_below_the_window_and_past_each_request():
    """`CacheStep.context_slots`: request-major rows of `rows` each; a request's new rows at
    their own slots in the full group; in the sliding group (window 12) the rows below the
    window and the padding keep `pad`'s slot."""
    import numpy as np

    from specserve.drafters.dflash_cache import FULL, SLIDING, DFlashContextCache, StepItem

    cache = DFlashContextCache(tiny_model().config, 40, page_size=4)
    cache.begin([StepItem("a", 10, 0), StepItem("b", 3, 0)])
    step = cache.begin([StepItem("a", 5, 6), StepItem("b", 15, 6)])  # a: 10..14, b: 3..17
    rows, pad = 16, np.arange(32, dtype=np.int64) + 1000
    pos, full = step.context_slots(FULL, rows, pad)
    assert pos[:5].tolist() == list(range(10, 15)) and pos[16:31].tolist() == list(range(3, 18))
    assert (full[5:16] == pad[5:16]).all() and (full[31:] == pad[31:]).all()
    for i, rid, first in ((0, "a", 10), (16, "b", 3)):
        n = 5 if rid == "a" else 15
        want = cache._requests[rid].pages[FULL].slots(np.arange(first, first + n), 4)
        assert full[i : i + n].tolist() == want.tolist()
    _, sliding = step.context_slots(SLIDING, rows, pad)
    keep_b = 18 - WINDOW + 1  # b holds 18 positions: the window keeps 7..17
    assert (sliding[16 : 16 + keep_b - 3] == pad[16 : 16 + keep_b - 3]).all()
    assert (sliding[16 + keep_b - 3 : 31] < 1000).all() and (sliding[:5] < 1000).all()


def test_page_arrays_follow_the_pages_through_allocate_free_release():
    """The cached arrays of a request's drafter pages (table_array, slots) are rebuilt after
    every change: allocation, pages leaving a sliding window, release."""
    import numpy as np

    from specserve.drafters.dflash_cache import SLIDING, DFlashContextCache, StepItem

    cache = DFlashContextCache(tiny_model().config, 40, page_size=4)
    for new, block in ((10, 0), (6, 6), (9, 6), (1, 6)):  # the window (12) drops pages
        cache.begin([StepItem("a", new, block)])
        pages = cache._requests["a"].pages[SLIDING]
        assert pages.table_array().tolist() == pages.table()
        held = np.arange(pages.dead * 4, (pages.dead + len(pages.live)) * 4)
        want = [pages.live[p // 4 - pages.dead] * 4 + p % 4 for p in held]
        assert pages.slots(held, 4).tolist() == want
    assert pages.dead > 0  # the window dropped leading pages
    cache.release("a")
    assert pages.table_array().tolist() == [] and pages.table() == []


def lockstep(static: DFlashDrafter, asks: dict[str, tuple[int, bool]],
             dynamic: DFlashDrafter | None = None):
    """CALLS through `static.draft` and, with the same requests, another drafter's raw logits
    (the CPU's tiny model, dynamic, unless given): [(request, its tree, its logits [L, V])] per
    request drafted."""
    dynamic = dynamic or DFlashDrafter(tiny_model(), num_pages=60, page_size=4, poison=True)
    out = []
    for batch in batches(dynamic.cache.device.type, asks):
        out += zip(batch, static.draft(batch),
                   (lg.cpu() for lg in dynamic.draft_logits(batch)), strict=True)
    return out


def assert_oracle_tree(r: DraftRequest, tree, logits: torch.Tensor) -> None:
    """`tree` is what torch's tables of `logits` give: the DDTree of r's budget, or for a chain
    ask the argmax path scored with its log-softmax, summed."""
    import numpy as np

    from specserve.spec.ddtree import build_ddtree, topk_logprobs

    if not r.chain:
        want = build_ddtree(*topk_logprobs(logits, r.budget), r.budget, logits.shape[0])
        for field in ("token_ids", "parents", "depths"):
            assert np.array_equal(getattr(tree, field), getattr(want, field)), field
        np.testing.assert_allclose(tree.scores, want.scores, rtol=1e-5, atol=1e-5)
        return
    best, ids = torch.log_softmax(logits.double(), dim=-1).max(dim=-1)  # [L] each
    n = min(r.budget, logits.shape[0])
    assert tree.token_ids.tolist() == ids[:n].tolist()
    np.testing.assert_allclose(tree.scores, best.cumsum(0)[:n].numpy(), rtol=1e-5, atol=1e-5)


def test_trees_come_from_the_tables_the_replay_computed(monkeypatch):
    """With graphs, a call's trees and chain asks are built from the top-k tables the replay
    computed and copied (no top-k after it: the eager `_topk_tables` is never called) and equal what
    torch's tables of the dynamic path's logits give — over CALLS (a bucket of 4 holding 3
    requests, blocks cut short by max_depth), budgets 8 / 3 / 5, "b" asking for chains."""
    import specserve.drafters.dflash as dflash

    eager = []
    monkeypatch.setattr(dflash, "_topk_tables", lambda *a: eager.append(a) or [])
    drafter = DFlashDrafter(tiny_model(), num_pages=60, page_size=4, poison=True, graphs=True,
                            capture=False)
    assert drafter.graphs.tables == tiny_model().config.vocab_size  # 37 < GRAPH_K
    got = lockstep(drafter, {"a": (8, False), "b": (3, True), "c": (5, False)})
    assert len(got) == 11 and not eager
    for r, tree, logits in got:
        assert tree.n == min(r.budget, logits.shape[0]) if r.chain else r.budget
        assert_oracle_tree(r, tree, logits)
    chains = DFlashDrafter(tiny_model(), num_pages=60, page_size=4, graphs=True, capture=False,
                           tree=False)
    assert chains.graphs.tables == 1
    for _, path, logits in lockstep(chains, {rid: (4, False) for rid in "abc"}):
        assert path.token_ids.tolist() == logits.argmax(-1)[:4].tolist()


def test_a_budget_wider_than_the_replays_tables_takes_the_eager_top_k(monkeypatch):
    """A graph computing the top 4 per row: a call asking for 8-node trees builds them from one
    top-k after the replay (the trees torch's tables give), one asking for 3 from the graph's."""
    import specserve.drafters.dflash as dflash

    monkeypatch.setattr(dflash, "graph_k", lambda vocab: 4)
    eager, tables = [], dflash._topk_tables
    monkeypatch.setattr(dflash, "_topk_tables", lambda *a: eager.append(a[2]) or tables(*a))
    drafter = DFlashDrafter(tiny_model(), num_pages=60, page_size=4, poison=True, graphs=True,
                            capture=False)
    got = lockstep(drafter, {"a": (8, False), "b": (3, False), "c": (3, False)})
    assert eager == [8] * 5  # the five calls with "a" in them; "c" alone from the graph
    for r, tree, logits in got:
        assert_oracle_tree(r, tree, logits)


@pytest.mark.skipif(not torch.cuda.is_available() or bool(os.environ.get("TRITON_INTERPRET")),
                    reason="needs a CUDA device (and TRITON_INTERPRET unset)")
def test_captured_tables_give_the_trees_on_gpu():
    """The tables computed inside the captured graphs and copied to pinned memory give the
    trees torch's tables of the same graphs' logits give (another drafter's replays: bitwise
    the same logits; scenario and asks as above)."""
    model = tiny_model(head_dim=16).cuda()
    drafter, twin = (DFlashDrafter(model, num_pages=60, page_size=4, poison=True, graphs=True)
                     for _ in range(2))
    got = lockstep(drafter, {"a": (8, False), "b": (3, True), "c": (5, False)}, twin)
    assert all(st.graph is not None and st.packed is not None
               for st in drafter.graphs._graphs.values())
    for r, tree, logits in got:
        assert_oracle_tree(r, tree, logits)
