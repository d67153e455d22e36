"""Prefill-chunk attention on the GPU: our tree-attention kernel vs torch SDPA's backends (issue 9).

One chunk of C new tokens (causal among themselves) over a paged prefix of P tokens, 32/8 heads,
head_dim 128, bf16, page 16, shuffled pages. Printed side by side with achieved TFLOP/s:
  ours        the Triton kernel (split-KV prefix + causal tail + combine);
  prefill backend  specserve.attention.prefill (what the engine runs on CUDA: cuDNN for chunks
              of >= MIN_FLOP, else the Triton kernel; per-shape cuDNN plans for regular chunks);
  prefill backend, ragged  the same with cuDNN's ragged plans only (DENSE_PLANS_MAX = 0);
  split:<be>  SDPA backend <be> in two calls — the chunk causal over itself, the chunk over the
              prefix gathered from the pages (gather timed and included) — merged by their LSEs;
  <be> alone  the two SDPA calls only (no gather, no merge): the backend's own rate.
Backends are called through torch's private ops that return the log-sum-exp (the public SDPA
does not); a backend that rejects a shape is reported, not fatal. Every result is checked
against our kernel (max |Δ| / max |ref|).

    python3 bench/diag_sdpa.py [--points "[(0, 8192), (24576, 8192)]"] [--out $OUT/diag_sdpa.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

import torch
import triton

from specserve.attention import prefill
from specserve.attention.base import AttnBatch
from specserve.attention.prefill import prefill_attention
from specserve.kernels.tree_attention.kernel import tree_attention_triton

HQ, HKV, D, PAGE = 32, 8, 128, 16
POINTS = [(0, 8192), (24576, 8192), (57344, 8192), (122880, 8192), (0, 32768), (30720, 2048),
          (3584, 512), (32256, 512)]


def _sdpa(backend, q, k, v, causal):
    """(out [1, H, L, D], lse [1, H, L] natural log) of one private SDPA op."""
    scale = D ** -0.5
    if backend == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
    elif backend == "flash":
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                scale=scale)
    elif backend == "efficient":
        r = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                    causal, scale=scale)
    else:
        raise ValueError(backend)
    lse = r[1].reshape(*r[1].shape[:3], -1)[..., 0] if r[1].dim() == 4 else r[1]
    return r[0], lse[..., : q.shape[2]].float()  # efficient pads L to a multiple of 32


def _merge(o1, l1, o2, l2):  # [1, H, L, D] / [1, H, L] -> [L, H, D]
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    o = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return o[0].transpose(0, 1).to(torch.bfloat16)


def _point(prefix, chunk, gen):
    need = -(-(prefix + chunk) // PAGE)
    pages = torch.randperm(need + 7, generator=gen)[:need].tolist()
    k_pool = torch.randn(need + 7, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    v_pool = torch.randn(need + 7, PAGE, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(chunk, HQ, D, generator=gen).to("cuda", torch.bfloat16)
    batch = AttnBatch.build([chunk], [prefix], [pages], list(range(prefix, prefix + chunk)),
                            PAGE, None, device="cuda")
    return q, k_pool, v_pool, batch, torch.tensor(pages, device="cuda")


def _split(backend, q, k_pool, v_pool, table, prefix, chunk, expand):
    """The chunk's attention via two SDPA calls over gathered K/V, merged by LSE."""
    k_all = k_pool[table].flatten(0, 1)[: prefix + chunk]  # [P + C, Hkv, D] gathered
    v_all = v_pool[table].flatten(0, 1)[: prefix + chunk]
    rep = HQ // HKV if expand else 1
    kt = k_all.transpose(0, 1).repeat_interleave(rep, 0)[None]  # [1, H, P + C, D]
    vt = v_all.transpose(0, 1).repeat_interleave(rep, 0)[None]
    qt = q.transpose(0, 1)[None].contiguous()  # [1, Hq, C, D]
    o1, l1 = _sdpa(backend, qt, kt[:, :, prefix:].contiguous(), vt[:, :, prefix:].contiguous(),
                   True)
    if prefix == 0:
        return o1[0].transpose(0, 1)
    o2, l2 = _sdpa(backend, qt, kt[:, :, :prefix].contiguous(), vt[:, :, :prefix].contiguous(),
                   False)
    return _merge(o1, l1, o2, l2)


def _alone(backend, q, k, v, prefix, chunk):
    """The two SDPA calls on ready contiguous inputs."""
    _sdpa(backend, q, k[:, :, prefix:], v[:, :, prefix:], True)
    if prefix:
        _sdpa(backend, q, k[:, :, :prefix], v[:, :, :prefix], False)


def _measure(prefix, chunk, gen) -> dict:
    q, k_pool, v_pool, batch, table = _point(prefix, chunk, gen)
    flop = 4 * HQ * D * (chunk * chunk / 2 + chunk * prefix)
    row = dict(prefix=prefix, chunk=chunk, tflop=flop / 1e12)

    def ours():
        return tree_attention_triton(q, k_pool, v_pool, batch, D ** -0.5)

    ref = ours().float()
    ms = triton.testing.do_bench(ours, return_mode="median")
    row["ours"] = dict(ms=ms, tflops=flop / ms / 1e9)
    backend = partial(prefill_attention, q, k_pool, v_pool, batch, D ** -0.5)
    err = float((backend().float() - ref).abs().max() / ref.abs().max())
    ms = triton.testing.do_bench(backend, return_mode="median")
    row["prefill backend"] = dict(ms=ms, tflops=flop / ms / 1e9, err=err,
                                  per_shape=(chunk, prefix) in prefill._per_shape)
    dense, cap = prefill._per_shape, prefill.DENSE_PLANS_MAX
    prefill._per_shape, prefill.DENSE_PLANS_MAX = set(), 0  # the same call, ragged plans only
    try:
        ms = triton.testing.do_bench(backend, return_mode="median")
        row["prefill backend, ragged"] = dict(ms=ms, tflops=flop / ms / 1e9)
    finally:
        prefill._per_shape, prefill.DENSE_PLANS_MAX = dense, cap
    for backend in ("cudnn", "flash", "efficient"):
        for expand in (False, True):
            name = f"split:{backend}" + (":expand" if expand else ":gqa")
            try:
                fn = partial(_split, backend, q, k_pool, v_pool, table, prefix, chunk, expand)
                err = float((fn().float() - ref).abs().max() / ref.abs().max())
                ms = triton.testing.do_bench(fn, return_mode="median")
                row[name] = dict(ms=ms, tflops=flop / ms / 1e9, err=err)
            except Exception as e:  # noqa: BLE001 — a backend may reject the shape
                row[name] = dict(error=f"{type(e).__name__}: {str(e)[:160]}")
        try:
            qt = q.transpose(0, 1)[None].contiguous()
            kt = torch.randn(1, HQ, prefix + chunk, D, generator=gen).to("cuda", torch.bfloat16)
            vt = torch.randn_like(kt)
            ms = triton.testing.do_bench(partial(_alone, backend, qt, kt, vt, prefix, chunk),
                                         return_mode="median")
            row[f"{backend} alone"] = dict(ms=ms, tflops=flop / ms / 1e9)
        except Exception as e:  # noqa: BLE001
            row[f"{backend} alone"] = dict(error=f"{type(e).__name__}: {str(e)[:160]}")
    return row


def first_calls(gen) -> list[dict]:
    """ms of the prefill backend's first call at a new (prefix, chunk) shape vs the same call
    repeated: cuDNN builds an execution plan per shape (cached by torch), and a serving
    workload brings new chunk and prefix lengths all the time."""
    out = []
    for prefix, chunk in [(10000, 3000), (10240, 3000), (10000, 3001), (20480, 4096),
                          (20480, 4095), (31000, 1777), (16384, 8192), (40960, 8192)]:
        q, k_pool, v_pool, batch, _ = _point(prefix, chunk, gen)
        fn = partial(prefill_attention, q, k_pool, v_pool, batch, D ** -0.5)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        again = triton.testing.do_bench(fn, return_mode="median")
        plan = "per-shape" if (chunk, prefix) in prefill._per_shape else "ragged"
        out.append(dict(prefix=prefix, chunk=chunk, plan=plan, first_ms=first, again_ms=again))
        print(f"first call prefix {prefix} chunk {chunk} ({plan}): {first:8.2f} ms, then "
              f"{again:.3f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=None, help="python literal [(prefix, chunk), ...]")
    ap.add_argument("--first-calls", action="store_true", help="only the first-call costs")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "diag_sdpa.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("times cuDNN / flash attention on a CUDA GPU (none here)")
    points = eval(args.points) if args.points else POINTS  # noqa: S307 — our CLI
    gen = torch.Generator().manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} cudnn "
          f"{torch.backends.cudnn.version()}", flush=True)
    if args.first_calls:
        points = []
    rows = [dict(first_calls=first_calls(gen))] if args.first_calls else []
    for prefix, chunk in points:
        row = _measure(prefix, chunk, gen)
        rows.append(row)
        print(f"\nprefix {prefix} chunk {chunk} ({row['tflop']:.2f} TFLOP)", flush=True)
        for name, r in row.items():
            if isinstance(r, dict):
                if "error" in r:
                    print(f"  {name:24} {r['error']}")
                else:
                    print(f"  {name:24} {r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s"
                          + (f"  err {r['err']:.1e}" if "err" in r else ""), flush=True)
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                              torch=torch.__version__, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
