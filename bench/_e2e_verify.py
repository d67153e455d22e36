"""Section `verify` of bench/bench_e2e.py: one target forward over a draft tree of B + 1 rows.

Per (context, batch, budget): the model's forward over the tree rows with their ancestor masks
(the same `DecoderModel.forward` + `AttnBatch` + attention backend the engine uses; the Triton
kernel on CUDA), then logits of every row and their argmax (what the acceptance walk needs).
The prefix K/V are random values written straight into a paged pool (no 128k prefill); pages
are randomly permuted, page_size from the CLI. Timed with CUDA events: median of `--reps` after
warm-up. Next to it: the attention kernel alone (layer 0's pool × layers; L2-warm at short
contexts, so only indicative there) and two floors from this run's ceilings: issue 9's
max((all weight bytes + KV bytes) / copy BW, FLOPs / matmul rate), and the dependent-op floor
max(weight bytes / copy BW, GEMM FLOPs / matmul rate) + max(KV bytes / copy BW, attention FLOPs
/ matmul rate) — each layer's GEMMs (memory-bound at these row counts) and its attention
(compute-bound for big trees at long context) run one after the other, so their times add.
"""

from __future__ import annotations

import traceback

import numpy as np
import torch
from _e2e_common import kv_shape, median, time_ms

from specserve.attention.base import AttnBatch
from specserve.engine.graphs import StepGraphs
from specserve.engine.runner import ForwardInput
from specserve.kvcache.block_manager import pages_for
from specserve.kvcache.pool import KVPool, num_pages_for_budget
from specserve.spec.tree import DraftTree, verify_layout


def random_tree(n: int, vocab: int, rng: np.random.Generator) -> DraftTree:
    """A bushy random tree of `n` nodes (each node's parent among the 4 rows before it)."""
    if n == 0:
        return DraftTree.empty()
    parents = np.array([rng.integers(max(0, i - 3), i + 1) for i in range(n)], dtype=np.int32)
    depths = np.zeros(n, dtype=np.int32)
    for i, p in enumerate(parents):
        depths[i] = 1 if p == 0 else depths[p - 1] + 1
    tokens = rng.choice(vocab, size=n, replace=False).astype(np.int64)
    return DraftTree(tokens, parents, depths)


def kv_budget_bytes(b) -> int:
    """The KV pool's memory budget: --kv-gb, else free memory minus --reserve-gb (--tiny: room
    for 6 requests at the longest context, so batch 8 there is skipped as on the H200)."""
    a = b.args
    if a.kv_gb:
        return int(a.kv_gb * 2**30)
    if a.tiny:
        return 6 * (max(a.ctxs) + max(a.budgets) + 1 + a.page_size) * b.bytes_per_token()
    b.free()  # cached blocks of earlier work count as free
    return max(b.free_bytes() - int(a.reserve_gb * 2**30), 1 << 20)


def run_verify(b) -> None:
    a, sec = b.args, b.results["verify"]
    model, page, dev = b.target, a.page_size, b.device
    shape = kv_shape(model, b.dtype)
    bpt = shape.bytes_per_token()
    budget = kv_budget_bytes(b)
    cap = num_pages_for_budget(shape, page, budget)
    points = [(c, bs, n) for c in a.ctxs for bs in a.batches for n in a.budgets]
    need = {p: p[1] * pages_for(p[0] + p[2] + 1, page) for p in points}
    fits = [p for p in points if need[p] <= cap]
    top = max(a.ctxs)
    sec["kv_pool"] = dict(budget_GiB=budget / 2**30, bytes_per_token=bpt, page_size=page,
                          pages_in_budget=cap,
                          max_batch_at_max_ctx=cap // pages_for(top + max(a.budgets) + 1, page),
                          max_ctx=top)
    if not fits:
        raise RuntimeError(f"no verify point fits the KV budget of {budget / 2**30:.1f} GiB")
    num_pages = max(need[p] for p in fits)
    b.log(f"verify: KV budget {budget / 2**30:.3g} GiB holds {cap} pages; allocating "
          f"{num_pages} ({num_pages * page * bpt / 2**30:.3g} GiB); batch ≤ "
          f"{sec['kv_pool']['max_batch_at_max_ctx']} fits at {top} tokens")
    kv = KVPool(shape, num_pages + 1, page, dev)  # + the graphs' trash page (never in tables)
    graphs = StepGraphs(model, kv, page, top + max(a.budgets) + 1, max(a.budgets) + 1,
                        trash_page=num_pages) if dev.type == "cuda" and a.graphs else None
    gen = torch.Generator(device=dev).manual_seed(7)
    for t in kv.k + kv.v:
        t.normal_(0.0, 1.0, generator=gen)
    perm = np.random.default_rng(3).permutation(num_pages)
    try:
        for p in points:
            row = dict(ctx=p[0], batch=p[1], budget=p[2], rows=p[1] * (p[2] + 1))
            if p not in fits:
                row["skipped"] = (f"KV {need[p] * page * bpt / 2**30:.3g} GiB > budget "
                                  f"{budget / 2**30:.3g} GiB")
            elif b.out_of_time(5):
                row["skipped"] = "time budget"
            else:
                try:
                    row.update(_measure(b, kv, perm, *p, bpt, graphs))
                except Exception as e:  # e.g. CUDA OOM: record, free, go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc()
                    b.free()
            sec["rows"].append(row)
            b.log("verify " + _line(row))
            b.save()
    finally:
        del kv
        b.free()
    sec["growth"] = growth(sec["rows"], min(a.ctxs), top)


def _measure(b, kv, perm, ctx, batch, budget, bpt, graphs=None) -> dict:
    a, model, dev = b.args, b.target, b.device
    rng = np.random.default_rng(ctx * 1000 + budget)
    tree = random_tree(budget, model.config.vocab_size, rng)
    layout = verify_layout(tree, int(rng.integers(model.config.vocab_size)), ctx)
    per = pages_for(ctx + budget + 1, a.page_size)
    tables = [perm[i * per : (i + 1) * per].tolist() for i in range(batch)]

    def build() -> AttnBatch:
        return AttnBatch.build([budget + 1] * batch, [ctx] * batch, tables,
                               np.tile(layout.positions, batch), a.page_size,
                               [layout.mask] * batch, dev)

    host_ms = median(time_ms(build, 3, 0, "cpu"))
    batch_meta = build()
    ids = torch.as_tensor(np.tile(layout.token_ids, batch), device=dev)

    def step() -> torch.Tensor:
        hidden, _ = model(ids, batch_meta, kv)
        return model.logits(hidden).argmax(dim=-1)

    with torch.inference_mode():
        ms = median(time_ms(step, a.reps, a.warmup, dev))
        c = model.config
        q = torch.randn(len(ids), c.num_heads, c.head_dim, device=dev, dtype=b.dtype)
        attn_ms = median(time_ms(lambda: model.attn_backend(
            q, kv.k[0], kv.v[0], batch_meta, c.head_dim**-0.5), a.reps, a.warmup, dev))
        graph_ms = median(time_ms(_graph_step(graphs, layout, ctx, tables), a.reps, a.warmup,
                                  dev)) if graphs is not None else None
    rows = batch * (budget + 1)
    kv_bytes = batch * (ctx + budget + 1) * bpt
    dense = 2 * (b.counts["total"] - b.counts["embed"]) * rows
    attn = b.attn_flops_per_pair() * batch * ((budget + 1) * ctx + (budget + 1) ** 2 / 2)
    floor, kind = b.floor_s(b.weight_bytes() + kv_bytes, dense + attn)
    # the dependent-op floor: a layer's GEMMs and its attention run one after the other, so
    # each class meets its own bound (weights or their FLOPs; KV or attention FLOPs), summed
    dep = b.floor_s(b.weight_bytes(), dense)[0] + b.floor_s(kv_bytes, attn)[0]
    best = graph_ms if graph_ms is not None else ms  # what the engine's decode step costs
    return dict(ms=ms, graph_ms=graph_ms, step_ms=best, attn_ms=attn_ms * c.num_layers,
                host_build_ms=host_ms, floor_ms=floor * 1e3, bound=kind,
                x_floor=best / (floor * 1e3), x_floor_eager=ms / (floor * 1e3),
                floor_dep_ms=dep * 1e3, x_floor_dep=best / (dep * 1e3),
                weight_GB=b.weight_bytes() / 1e9, kv_GB=batch * ctx * bpt / 1e9,
                TFLOP=(dense + attn) / 1e12, attn_TFLOP=attn / 1e12)


def _graph_step(graphs, layout, ctx, tables):
    """The engine's CUDA-graph step (engine/graphs.py): padded metadata to the device, replay,
    logits of every row, argmax — host work included."""
    inputs = [ForwardInput(f"r{i}", layout.token_ids, layout.positions, ctx, layout.mask,
                           pages=table) for i, table in enumerate(tables)]
    rows = list(range(len(tables) * len(layout.token_ids)))
    return lambda: graphs.run(inputs, tables, rows, ())[0].argmax(dim=-1)


def growth(rows: list[dict], lo: int, hi: int) -> list[dict]:
    """Step-time growth from the shortest to the longest context per (batch, budget)."""
    got = {(r["ctx"], r["batch"], r["budget"]): r for r in rows if "ms" in r}
    out = []
    for (ctx, batch, budget), r in got.items():
        if ctx == lo and (hi, batch, budget) in got:
            h = got[(hi, batch, budget)]
            out.append(dict(batch=batch, budget=budget, from_ctx=lo, to_ctx=hi,
                            growth=h["step_ms"] / r["step_ms"],
                            floor_growth=h["floor_ms"] / r["floor_ms"]))
    return out


def _line(r: dict) -> str:
    head = f"ctx={r['ctx']} batch={r['batch']} budget={r['budget']}: "
    if "ms" not in r:
        return head + str(r.get("skipped") or r.get("error"))
    return head + (f"{r['ms']:.2f} ms eager, {_f(r.get('graph_ms'))} graph (attn "
                   f"{r['attn_ms']:.2f}, floor {r['floor_ms']:.2f} {r['bound']}, "
                   f"×{r['x_floor']:.2f})")


def _f(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def table(sec: dict) -> str:
    growth_of = {(g["batch"], g["budget"]): g["growth"] for g in sec.get("growth", [])}
    top = sec.get("kv_pool", {}).get("max_ctx")
    lines = ["| ctx | batch | budget | rows | eager step ms | graph step ms | attn ms (all "
             "layers) | floor ms | bound | × floor | dep. floor ms | × dep. floor | growth "
             "×(max/min ctx) |", "|" + "---|" * 13]
    for r in sec.get("rows", []):
        lead = f"| {r['ctx']} | {r['batch']} | {r['budget']} | {r['rows']} "
        if "ms" not in r:
            lines.append(lead + f"| {r.get('skipped') or r.get('error')} | | | | | | | | |")
            continue
        g = growth_of.get((r["batch"], r["budget"])) if r["ctx"] == top else None
        lines.append(lead + f"| {r['ms']:.2f} | {_f(r.get('graph_ms'))} | {r['attn_ms']:.2f} | "
                     f"{r['floor_ms']:.2f} | "
                     f"{r['bound']} | {r['x_floor']:.2f} | {_f(r.get('floor_dep_ms'))} | "
                     f"{_f(r.get('x_floor_dep'))} | {'' if g is None else f'×{g:.2f}'} |")
    return "\n".join(lines)
