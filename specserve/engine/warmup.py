"""Compile-ahead: run the shape classes a server will meet before it takes requests.

Triton compiles a kernel variant the first time a shape class reaches it (a rows bucket of the
launch-config table, causal or tree, windowed or not: most of a second each; BENCHMARKS.md,
"Figures formerly in source comments"). Without a warm-up the first requests pay that inside their
steps: on the H200 the commit probe's first request ran slow steps and hit the drafter deadline
(BENCHMARKS.md, "Commit probe on the H200 with the committed demo pair"). `warm_up_engine` runs one
throw-away request on the target (a prefill of a full chunk plus a remainder, verify steps with
chains of every size class up to `max_draft_tokens` — of every rows bucket, capturing their CUDA
graphs for one request, when the engine uses them — and an AR step; on CUDA also long prefill
chunks through `attention.prefill`'s cuDNN path (`attention.prefill_warmup`): one, every regular
chunk of a `max_model_len` prompt, whose per-shape plans it builds, one of every ragged plan
class — and, through `warm_up_causal_chunks`, a causal chunk of
every rows bucket over a short and over a long prefix, for each window of the model's layers: the
warm-up prompt's own chunks reach one rows bucket only, and on the H200 the demo probe's first 16k
prompt spent part of its prefill compiling the 128-row variant, the same section); its decode steps
are the cost model's first verify times (engine/cost.py; with adaptive speculation the request
runs twice and only the second pass is booked: the first one's steps timed graph captures and
compiles; then every batch bucket's graphs are captured for every rows bucket and a batch of
each runs the same chains, `_time_batches`); `warm_up_drafter` does the same for a DFlash
drafter (a context chunk, then blocks of every depth class; with CUDA graphs, of every depth).
Both leave no state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

import torch

from specserve.attention import prefill, prefill_warmup
from specserve.cudagraph import BATCH_BUCKETS, bucket_of
from specserve.drafters.base import Drafter, DraftRequest
from specserve.kernels import topk
from specserve.spec.tree import DraftTree, chain_tree
from specserve.types import SamplingParams

log = logging.getLogger(__name__)
WARMUP_ID = "__specserve_warmup__"
BATCH_PROMPT = 300  # tokens a prompt of the batches' pass: its steps stay in one context class


def size_classes(largest: int) -> list[int]:
    """1, 3, 7, 15, … below `largest`, then `largest`: one tree per power-of-two row bucket."""
    sizes, n = [], 1
    while n < largest:
        sizes.append(n)
        n = 2 * n + 1
    return sizes + [largest] if largest > 0 else []


def candidates(top: int) -> tuple[int, ...]:
    """A step's candidate rows per request under budget `top`: plain decoding, each size class."""
    return (1, *(k + 1 for k in size_classes(top)))


class _ChainDrafter(Drafter):
    """Proposes a chain of the next planned size per step (then none: AR steps). It asks for the
    same tap layers as the drafter it stands in for, so the forwards (and their CUDA graphs)
    are the ones serving will run."""

    def __init__(self, sizes: list[int], vocab: int, taps: tuple[int, ...] = (),
                 batch: int = 1) -> None:
        self.sizes, self.vocab, self.taps, self.batch = list(sizes), vocab, taps, batch
        self.needs_context = bool(taps)

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.taps

    def draft(self, requests):
        if len(requests) < self.batch:  # a batch still filling: plain steps
            return [DraftTree.empty() for _ in requests]
        n = self.sizes.pop(0) if self.sizes else 0
        return [chain_tree([(7 * i + 1) % self.vocab for i in range(min(n, r.max_depth))])
                if n else DraftTree.empty() for r in requests]


def warm_up_engine(engine, batch_rows: Seq[int] = ()) -> float:
    """Run the warm-up request on `engine` (no drafter needed; its own is restored); with CUDA
    graphs also trees of `batch_rows` rows in every batch bucket (`_warm_batches`; with
    adaptive speculation every rows bucket, and the batches' steps are timed:
    `_time_batches`). Seconds."""
    t0, cfg = time.perf_counter(), engine.config
    graphs = engine.runner.graphs  # with CUDA graphs: one tree per rows bucket (captures it)
    sizes = [r - 1 for r in graphs.rows if r > 1] if graphs is not None else \
        size_classes(cfg.max_draft_tokens)
    vocab, previous = engine.model_config.vocab_size, engine.drafter
    taps = tuple(previous.target_layer_ids) if getattr(previous, "needs_context", False) else ()
    adaptive = engine.adaptive is not None  # it may choose any tree at any batch bucket
    try:
        prompt_len = _time_one(engine, sizes, vocab, taps)
        captured = 0
        if graphs is not None:  # captured outside any step: the next step is not a capture's
            captured = _warm_batches(graphs, cfg.max_num_seqs, taps,
                                     None if adaptive else batch_rows)
            engine.cost.graph_builds = graphs.builds
        timed = _time_batches(engine, sizes, vocab, taps) if adaptive else 0
    finally:
        engine.set_drafter(previous)
        engine.cost.clear(verify=False)  # the stand-in drafter's times say nothing of the real one
    if engine.runner.device.type == "cuda":  # long prefill chunks: cuDNN + the merge kernel
        mc = engine.model_config
        prefill_warmup.warm_up(mc.num_heads, mc.num_kv_heads, mc.head_dim, engine.runner.dtype,
                               engine.runner.device, engine.blocks.page_size,
                               chunk=cfg.max_num_batched_tokens, max_len=engine.max_model_len)
        warm_up_causal_chunks(mc, engine.runner.dtype, engine.runner.device,
                              engine.blocks.page_size)
    seconds = time.perf_counter() - t0
    log.info("warm-up: prompt %d, trees %s, %d more graphs, %d batch buckets timed, %.1f s",
             prompt_len, sizes, captured, timed, seconds)
    return seconds


def _time_one(engine, sizes: list[int], vocab: int, taps: tuple[int, ...]) -> int:
    """The one-request pass (twice with adaptive speculation: the first one's steps timed
    first launches); returns its prompt's length (a chunk and a remainder where it fits)."""
    cfg = engine.config
    max_tokens = sum(sizes) + len(sizes) + 2
    room = (engine.blocks.num_unreserved_pages - 1) * engine.blocks.page_size - max_tokens \
        - cfg.max_draft_tokens - 1  # what the pool can take beside the generated tokens
    prompt_len = max(1, min(cfg.max_num_batched_tokens + 37, room,
                            engine.max_model_len - max_tokens - 1))
    max_tokens = min(max_tokens, engine.max_model_len - prompt_len)  # a tiny context: fit it
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0))
    for _ in range(2 if engine.adaptive is not None else 1):
        engine.set_drafter(_ChainDrafter(sizes, vocab, taps))
        engine.cost.clear()
        _run_requests(engine, [prompt.tolist()],
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return prompt_len


def _run_requests(engine, prompts: list[list[int]], params: SamplingParams,
                  more=lambda: True) -> None:
    """Add `prompts` at once, step while any is unfinished and `more()`, then abort them all."""
    ids = [WARMUP_ID if len(prompts) == 1 else f"{WARMUP_ID}{i}" for i in range(len(prompts))]
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, params, budget=engine.config.max_draft_tokens)
        while engine.has_unfinished and more():
            engine.step()
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.cost.book_pending()  # the last step's times (the engine books them late)


def _batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch buckets above one request a server of `max_num_seqs` reaches."""
    top = bucket_of(min(max_num_seqs, BATCH_BUCKETS[-1]), BATCH_BUCKETS)
    return [b for b in BATCH_BUCKETS if 1 < b <= top]


def _warm_batches(graphs, max_num_seqs: int, taps: tuple[int, ...],
                  rows: Seq[int] | None) -> int:
    """Graphs captured: the other context class of one request's, then the trees of `rows`
    rows (None: of every rows bucket) for every batch bucket up to `max_num_seqs` (else the
    first step of 8 requests at once captured its graph inside them: BENCHMARKS.md, "A burst
    of requests")."""
    captured = graphs.warm(1, taps)
    if rows is None or rows:
        for bb in _batch_buckets(max_num_seqs):
            captured += graphs.warm(bb, taps, rows)
    return captured


def _time_batches(engine, sizes: list[int], vocab: int, taps: tuple[int, ...]) -> int:
    """With adaptive speculation, the cost model's verify times of batches: for each batch
    bucket above one, that many requests at once verify a chain of every size of `sizes`,
    then plain steps, booked as serving books them (a shape never measured is estimated from
    others, and a batch's only measured shape was the one its requests chose). The prompts
    are BATCH_PROMPT tokens (one context class throughout). Stops at the first bucket whose
    pages do not fit; returns the buckets timed."""
    cfg, page, timed = engine.config, engine.blocks.page_size, 0
    room = (engine.blocks.num_unreserved_pages - 1) * page
    gen = torch.Generator().manual_seed(1)
    for bb in _batch_buckets(cfg.max_num_seqs):
        bb = min(bb, cfg.max_num_seqs)  # the bucket's largest batch this server runs
        filling = -(-bb * BATCH_PROMPT // cfg.max_num_batched_tokens)  # plain steps meanwhile
        # room for every chain: a request's drafts are cut to its tokens left
        params = SamplingParams(max_tokens=filling + sum(sizes) + len(sizes) + 3,
                                ignore_eos=True)
        need = BATCH_PROMPT + params.max_tokens + cfg.max_draft_tokens + 1
        if need > engine.max_model_len or bb * -(-need // page) * page > room:
            break
        drafter = _ChainDrafter(sizes, vocab, taps, batch=bb)
        engine.set_drafter(drafter)
        prompts = [torch.randint(0, vocab, (BATCH_PROMPT,), generator=gen).tolist()
                   for _ in range(bb)]
        _run_requests(engine, prompts, params, _plain_steps_after(drafter, 2))
        timed += 1
    return timed


def _plain_steps_after(drafter: _ChainDrafter, plain: int):
    """A `more()` for `_run_requests`: true until `plain` steps have run after the step that
    verified the drafter's last chain."""
    left = [plain + 1]

    def more() -> bool:
        left[0] -= not drafter.sizes
        return left[0] > 0
    return more


def causal_chunk_shapes(mc) -> list[tuple[int, int, int | None]]:
    """(new tokens, prefix, window) of the chunks `warm_up_causal_chunks` runs: per rows bucket
    of the launch-config table the most tokens whose packed rows (tokens · GQA group) fit it, over
    an empty prefix and over one just past `configs.SHORT_CONTEXT` (the two context classes of
    `configs.pick_config`), for every distinct window of the model's layers (None: full)."""
    from specserve.kernels.tree_attention.configs import ROW_BUCKETS, SHORT_CONTEXT

    group = mc.num_heads // mc.num_kv_heads
    tokens = sorted({max(1, bucket // group) for bucket in ROW_BUCKETS})
    windows = sorted({mc.window(i) for i in range(mc.num_layers)}, key=lambda w: w or 0)
    return [(n, ctx, w) for ctx in (0, SHORT_CONTEXT + 1) for n in tokens for w in windows]


def warm_up_causal_chunks(mc, dtype: torch.dtype, device: torch.device, page_size: int) -> int:
    """Run `causal_chunk_shapes(mc)` through the attention backend on random K/V (not the
    model's pool), so each causal kernel variant a prompt can reach is compiled. Calls made."""
    shapes = causal_chunk_shapes(mc)
    chunks = prefill_warmup.random_chunks([(n, ctx) for n, ctx, _ in shapes], mc.num_heads,
                                          mc.num_kv_heads, mc.head_dim, dtype, device, page_size)
    for (_, _, window), (q, k, v, batch) in zip(shapes, chunks, strict=True):
        prefill.prefill_attention(q, k, v, batch, mc.head_dim ** -0.5, window)
    return len(shapes)


def warm_up_drafter(drafter, context_rows: int = 300, max_batch: int = 64) -> float:
    """Warm a DFlash drafter (`DFlashDrafter`): a context chunk, then a draft per depth class
    (eager) or one full-block draft (with its CUDA graphs); then the graphs of every batch
    bucket up to `max_batch` requests and every block length (`DraftGraphs.warm`: a batch's
    last steps before max_tokens shrink its longest block a token a step, and a graph
    captured lazily was a slow step on the H200: BENCHMARKS.md, "DFlash decode: the steps
    before max_tokens, and the fused-layer drafter"), and the trees' top-k kernel where a
    large batch would run it (`kernels.topk.warm_up`)."""
    t0, cfg = time.perf_counter(), drafter.model.config
    weight = drafter.model.fc.weight
    gen = torch.Generator().manual_seed(0)
    width = cfg.num_taps * cfg.hidden_size
    context = torch.randn(context_rows, width, generator=gen).to(weight.device, weight.dtype)
    start = context_rows
    try:
        graphed = drafter.graphs is not None  # graphs.warm builds every length below
        for depth in (cfg.block_size - 1,) if graphed else size_classes(cfg.block_size - 1):
            drafter.draft([DraftRequest(WARMUP_ID, 1, start, 16, depth, context)])
            context = None
    finally:
        drafter.release(WARMUP_ID)
    if drafter.graphs is not None:
        drafter.graphs.warm(max_batch)
    topk.warm_up(cfg.vocab_size, weight.device)  # the trees' top-k kernel of large batches
    seconds = time.perf_counter() - t0
    log.info("drafter warm-up: %d context rows, %.1f s", context_rows, seconds)
    return seconds
