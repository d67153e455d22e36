"""A/B of tree-kernel variants at fixed shapes: KV layout, launcher options, split count, config
(H200 diagnostic, issues 5 and 9).

The pool is [P, page, Hkv, D] (NHD: one page of one KV head is `page` rows of D at a stride of
Hkv·D). The kernel takes any strides, so the same values stored head-major, [P, Hkv, page, D]
(HND: one page of one KV head is one contiguous page·D block) and passed as a permuted view of
the same shape, run the same code over a different DRAM access pattern. For each shape and
variant (layout, launcher options such as {'pdl': False} or {'combine_rows': 0}, split count,
optionally a Config), in one run next to each other: the KV-read floor, our call in a CUDA graph
of 36 calls (bench_kernel.py's harness: pools rotate beyond L2), the GPU time of the attention
and combine kernels (torch.profiler; with PDL on, each includes its wait), the max |diff| vs the
default variant (HND at the defaults: the same arithmetic, must be 0; other configs or split
counts differ by rounding), the error relative to an fp32 reference, and the max |diff| vs the
variant's own first result after the graph replays (must be 0). The launcher's contiguity check
is bypassed here only (it accepts NHD pools).

    PYTHONPATH=.:bench python experiments/diag_layout.py [--out PATH] [--shapes "[(32768, 16)]"]
        [--variants "[...]"]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

VARIANTS = ("[('nhd', {}, None), ('hnd', {}, None), ('nhd', {'combine_rows': 0}, None), "
            "('nhd', {'pdl': False}, None), ('hnd', {}, 16), ('hnd', {}, 64)]")


def _hnd(x):  # same values, head-major storage, NHD-shaped view
    return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="[(32768, 1), (32768, 16), (131072, 16), (32768, 64)]")
    ap.add_argument("--variants", default=VARIANTS,
                    help="[(layout 'nhd'|'hnd', launcher options, num_splits or None"
                         "[, (block_m, block_n, num_warps, num_stages)]), ...]")
    args = ap.parse_args()

    import numpy as np
    import torch
    import triton
    from bench_kernel import _copy_bw, _point
    from diag_kernel import _graph_us, _kernel_times

    import specserve.kernels.tree_attention.kernel as kmod
    from specserve.kernels.tree_attention.configs import Config
    from specserve.kernels.tree_attention.ref import tree_attention_ref

    kmod.check_inputs = lambda *a, **k: None  # HND views are not contiguous (see docstring)
    hq, hkv, d, page = 32, 8, 128, 16
    copy_bw = _copy_bw(torch, triton)
    print(f"# {torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s")
    print("| ctx | N | layout | options | S | floor µs | graph×36 µs | % floor | attn µs | "
          "combine µs | max diff vs default | rel err vs fp32 | same after graphs | regs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for ctx, n in eval(args.shapes):  # noqa: S307 — our own CLI
        nhd = _point(ctx, n, hq, hkv, page, True, 7, torch, np)
        hnd = [(_hnd(k), _hnd(v), b) for k, v, b in nhd]
        qs = [torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16) for _ in nhd]
        want = kmod.tree_attention_triton(qs[0], *nhd[0], d**-0.5)
        ref = tree_attention_ref(qs[0], *nhd[0], d**-0.5).float()  # fp32 math on the GPU
        for layout, opts, splits, *cfg in eval(args.variants):  # noqa: S307
            config = Config(*cfg[0]) if cfg else None
            sets = hnd if layout == "hnd" else nhd
            calls = [lambda q=q, s=s, ns=splits, o=opts, c=config: kmod.tree_attention_triton(
                q, *s, d**-0.5, num_splits=ns, config=c, options=o)
                for q, s in zip(qs, sets, strict=True)]
            try:
                got = calls[0]()
            except Exception as e:  # noqa: BLE001 — a variant that does not build: say so, go on
                print(f"| {ctx} | {n} | {layout} | {opts}{cfg or ''} | failed: {e!r:.300} |")
                rows.append(dict(ctx=ctx, n=n, layout=layout, options=opts, splits=splits,
                                 config=cfg, error=repr(e)[:2000]))
                continue
            diff = float((got.float() - want.float()).abs().max())
            err = float((got.float() - ref).abs().max() / ref.abs().max())
            g36 = _graph_us(calls, 12, torch)  # then: still right after ≥ 1000 graph calls?
            poisoned = torch.full_like(got, float("nan"))
            kmod.tree_attention_triton(qs[0], *sets[0], d**-0.5, num_splits=splits, config=config,
                                       options=opts, out=poisoned)
            after = float((poisoned.float() - got.float()).abs().max())
            kern = kmod.LAST_LAUNCH["attn"]
            regs = dict(n_regs=getattr(kern, "n_regs", None), n_spills=getattr(kern, "n_spills",
                                                                               None))
            floor = 2 * ctx * hkv * d * 2 / copy_bw * 1e6
            kt = _kernel_times(calls, torch)
            attn = sum(v for k, v in kt.items() if "tree_attn" in k)
            comb = sum(v for k, v in kt.items() if "combine" in k)
            row = dict(ctx=ctx, n=n, layout=layout, options=opts, splits=splits, config=cfg,
                       floor_us=floor, graph36_us=g36, pct_floor=100 * floor / g36, attn_us=attn,
                       combine_us=comb, max_diff=diff, rel_err=err, diff_after_graphs=after,
                       **regs)
            rows.append(row)
            print(f"| {ctx} | {n} | {layout} | {opts}{cfg or ''} | {splits or 'auto'} | "
                  f"{floor:.1f} | {g36:.1f} | {row['pct_floor']:.0f}% | {attn:.1f} | {comb:.1f} | "
                  f"{diff:.1e} | {err:.1e} | {after:.1e} | {regs} |", flush=True)
        del nhd, hnd, qs, calls
        torch.cuda.empty_cache()
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "diag_layout.json")
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_GBps=copy_bw / 1e9,
                                   rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
