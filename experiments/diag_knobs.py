"""A/B of module-level knobs on the verify step, on the GPU (issue 9).

A knob is a module attribute that a forward reads at launch time (e.g.
`specserve.models.fused_layer.LT_DOWN_ROWS`). Each variant sets some knobs. Per (ctx, rows),
the verify step (random Qwen3-8B-shape target, bf16, page 16, one random tree; forward + logits
+ argmax in one CUDA graph, captured per variant) is timed for every variant, the variants
alternated over rounds (shared machines drift); logits are compared bitwise with the first
variant's; per-kernel GPU µs come from torch.profiler over graph replays (kernel names matching
--kernels).

    PYTHONPATH=.:bench python3 experiments/diag_knobs.py --variants "{'lt': {}, 'default': {
        'specserve.models.fused_layer.LT_DOWN_ROWS': range(0)}}" [--ctxs 1024,32768,131072]
        [--rows 17,65] [--rounds 3] [--kernels REGEX] [--out $OUT/diag_knobs.json]

(Values are Python literals, `range(a, b)` included.) Run 1 (raw
`experiments/results/diag_knobs_h200_run1_fused_pdl.json`) A/B'd a PDL knob of the fused layer
kernels that commit 532d230 had and the next one removed.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from _e2e_common import ceilings
from _e2e_verify import random_tree
from diag_kernel import _kernel_times
from diag_step import graph_ms
from profile_step import build_target, make_runner

from specserve.attention.base import AttnBatch
from specserve.spec.tree import verify_layout

_LITERAL_NODES = (ast.Expression, ast.Dict, ast.Tuple, ast.List, ast.Set, ast.Constant, ast.Load,
                  ast.UnaryOp, ast.USub)


def _literal(text: str):
    """A Python literal, where `range(a[, b])` may stand for a value."""
    tree = ast.parse(text, mode="eval")
    for node in ast.walk(tree):
        ok = isinstance(node, _LITERAL_NODES) or (isinstance(node, ast.Name)
                                                  and node.id == "range")
        if isinstance(node, ast.Call):
            ok = isinstance(node.func, ast.Name) and node.func.id == "range"
        if not ok:
            raise ValueError(f"only literals and range(...) in --variants: {ast.unparse(node)}")
    return eval(compile(tree, "<variants>", "eval"), {"__builtins__": {"range": range}})


def set_knobs(knobs: dict) -> dict:
    """Set each 'module.attr' to its value; returns the previous values."""
    old = {}
    for path, value in knobs.items():
        mod, attr = path.rsplit(".", 1)
        m = importlib.import_module(mod)
        if not hasattr(m, attr):
            raise ValueError(f"{mod} has no knob {attr!r}")
        old[path] = getattr(m, attr)
        setattr(m, attr, value)
    return old


def point(model, kv, table, ctx, rows, variants, rounds, kernels) -> dict:
    vocab = model.config.vocab_size
    rng = np.random.default_rng(ctx + rows)
    lay = verify_layout(random_tree(rows - 1, vocab, rng), int(rng.integers(vocab)), ctx)
    batch = AttnBatch.build([rows], [ctx], [table], lay.positions, 16, [lay.mask], "cuda")
    ids = torch.as_tensor(lay.token_ids, device="cuda")
    step = lambda: model.logits(model(ids, batch, kv)[0]).argmax(-1)  # noqa: E731
    res: dict = dict(ctx=ctx, rows=rows, ms={v: [] for v in variants}, kernels_us={})
    logits = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, knobs in variants.items():
                old = set_knobs(knobs)
                try:
                    res["ms"][name].append(graph_ms(step))
                    logits[name] = model.logits(model(ids, batch, kv)[0]).float().cpu()
                finally:
                    set_knobs(old)
        for name, knobs in variants.items():
            old = set_knobs(knobs)
            try:
                kt = _kernel_times([lambda: model.logits(model(ids, batch, kv)[0])], torch)
            finally:
                set_knobs(old)
            res["kernels_us"][name] = {k: round(t, 2) for k, t in kt.items()
                                       if re.search(kernels, k)}
    first = next(iter(variants))
    res["bitwise_equal"] = {v: bool(torch.equal(logits[v], logits[first])) for v in variants}
    res["median_ms"] = {v: float(np.median(t)) for v, t in res["ms"].items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", required=True, help="{name: {'module.attr': value}} literal")
    ap.add_argument("--ctxs", default="1024,32768,131072")
    ap.add_argument("--rows", default="17,65")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", default=".", help="regex of kernel names to report")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "diag_knobs.json"))
    args = ap.parse_args()
    variants = _literal(args.variants)
    for knobs in variants.values():
        set_knobs(set_knobs(knobs))  # every knob exists (ValueError now, not mid-run)
    a = argparse.Namespace(tiny=False, layers=None, device="cuda", std=0.02, page_size=16,
                           chunk=8192)
    ctxs, rows_list = [int(c) for c in args.ctxs.split(",")], [int(r) for r in args.rows.split(",")]
    res = dict(device=torch.cuda.get_device_name(), variants={k: {p: repr(v) for p, v in kn.items()}
               for k, kn in variants.items()},
               copy_GBps=ceilings("cuda", False)["copy_GBps"], steps=[])
    model, _ = build_target(a, torch.bfloat16)
    top = max(ctxs) + max(rows_list) + 1
    runner = make_runner(a, model, "bfloat16", top)
    runner.blocks.reserve("d", top)
    runner.blocks.ensure("d", top)
    table = runner.blocks.page_table("d")
    for ctx in ctxs:
        for rows in rows_list:
            r = point(model, runner.kv, table, ctx, rows, variants, args.rounds, args.kernels)
            res["steps"].append(r)
            print(f"ctx {ctx} rows {rows}: " + ", ".join(
                f"{k} {v:.3f} ms" for k, v in r["median_ms"].items())
                + f" | bitwise {r['bitwise_equal']}", flush=True)
            for v, kt in r["kernels_us"].items():
                print(f"    {v}: " + ", ".join(f"{k} {t}" for k, t in sorted(kt.items())))
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
