"""Triton tree-verify attention vs a float64 reference (CPU interpreter; GPU classes when present).

Small irregular shapes: ragged batches (random trees, a causal chunk, empty contexts), page sizes
1/16 with shuffled page tables, GQA 1 and 4, sliding windows, split counts 1/2/5. Pool pages no
request owns — and, under a window, prefix slots below it — hold NaN: any stray read shows up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # CPU: the Triton interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specserve.attention.base import AttnBatch  # noqa: E402
from specserve.attention.torch_ref import first_key  # noqa: E402
from specserve.kernels.tree_attention import tree_attention  # noqa: E402
from specserve.kernels.tree_attention.configs import Config  # noqa: E402
from specserve.kernels.tree_attention.kernel import tree_attention_triton  # noqa: E402
from specserve.kernels.tree_attention.ref import tree_attention_ref  # noqa: E402
from specserve.spec.tree import num_mask_words, verify_layout  # noqa: E402
from tests.helpers import random_tree  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEV = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def causal_bits(n: int) -> np.ndarray:  # [n, W] uint32 lower-triangular ancestor bits
    mask = np.zeros((n, num_mask_words(n)), dtype=np.uint32)
    for i in range(n):
        for j in range(i + 1):
            mask[i, j // 32] |= np.uint32(1 << (j % 32))
    return mask


def make_case(seed, ctx_lens, nodes, page_size, hq, hkv, d, dtype, window=None, trees=True,
              device=DEV):
    """Batch + tensors. nodes[b] > 0: random tree of that many nodes; < 0: causal chunk of −n."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    q_lens, positions, masks = [], [], []
    for ctx, n in zip(ctx_lens, nodes, strict=True):
        if n > 0 and trees:
            lay = verify_layout(random_tree(rng, n), 1, ctx)
            q_lens.append(lay.num_rows)
            positions.append(lay.positions)
            masks.append(lay.mask)
        else:
            q_lens.append(abs(n))
            positions.append(np.arange(ctx, ctx + abs(n)))
            masks.append(causal_bits(abs(n)))
    need = [-(-(c + n) // page_size) for c, n in zip(ctx_lens, q_lens, strict=True)]
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages).tolist()
    tables = [[perm.pop() for _ in range(k)] for k in need]
    batch = AttnBatch.build(q_lens, ctx_lens, tables, np.concatenate(positions), page_size,
                            masks if trees else None, device=device)
    shape = (num_pages, page_size, hkv, d)
    k_pool = torch.full(shape, float("nan"))
    v_pool = torch.full(shape, float("nan"))
    for b, table in enumerate(tables):
        k0 = first_key(batch, b, window)
        for pos in range(k0, ctx_lens[b] + q_lens[b]):
            page, slot = table[pos // page_size], pos % page_size
            k_pool[page, slot] = torch.randn(hkv, d, generator=g)
            v_pool[page, slot] = torch.randn(hkv, d, generator=g)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    cast = [x.to(dtype).to(device) for x in (q, k_pool, v_pool)]
    return (*cast, batch)


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


CASES = [  # page_size, hq, hkv, d, dtype, window, config
    (16, 4, 1, 16, torch.bfloat16, None, None),
    (1, 2, 2, 16, torch.float32, None, None),
    (16, 8, 2, 32, torch.float32, 24, None),
    (1, 4, 1, 16, torch.bfloat16, 24, None),
    (16, 4, 1, 16, torch.float32, None, Config(32, 32, 4, 1)),  # BLOCK_N > page: gather path
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"p{c[0]}-g{c[1] // c[2]}-d{c[3]}-"
                         f"{str(c[4])[6:]}-w{c[5]}-{'cfg' if c[6] else 'auto'}")
def test_ragged_trees_match_fp64_for_every_split_count(case):
    page, hq, hkv, d, dtype, window, config = case
    q, k, v, batch = make_case(7, [37, 0, 150], [6, -5, 9], page, hq, hkv, d, dtype, window)
    ref = tree_attention_ref(q, k, v, batch, 0.25, window, fp64=True)
    for splits in (1, 2, 5):
        out = torch.full_like(q, float("nan"))
        tree_attention_triton(q, k, v, batch, 0.25, window, num_splits=splits, config=config,
                              out=out)
        check(out, ref, dtype)


@pytest.mark.parametrize("row_words", [True, False])  # both ways of reading the tail's mask
def test_wide_tree_two_mask_words_and_causal_none_mask(row_words):
    q, k, v, batch = make_case(3, [20, 45], [40, 3], 16, 2, 1, 16, torch.float32)
    ref = tree_attention_ref(q, k, v, batch, 0.3, None, fp64=True)
    assert batch.tree_mask.shape[1] == 2
    check(tree_attention_triton(q, k, v, batch, 0.3, num_splits=2,
                                options={"row_words": row_words}), ref, torch.float32)
    q, k, v, batch = make_case(4, [33, 0], [-7, -18], 1, 4, 2, 16, torch.bfloat16, 9,
                               trees=False)
    assert batch.tree_mask is None
    ref = tree_attention_ref(q, k, v, batch, 0.3, 9, fp64=True)
    check(tree_attention(q, k, v, batch, 0.3, 9, impl="triton", num_splits=5), ref,
          torch.bfloat16)


@pytest.mark.parametrize("page,config", [(16, None), (1, None), (64, None),
                                         (16, Config(16, 32, 4, 1))])
def test_causal_chunks_without_mask_match_fp64(page, config):
    """Prefill chunks (no tree mask, no window) at unaligned contexts, over several blocks."""
    q, k, v, batch = make_case(8, [37, 0, 5], [-41, -23, -30], page, 4, 1, 16, torch.bfloat16,
                               trees=False)
    ref = tree_attention_ref(q, k, v, batch, 0.3, None, fp64=True)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        tree_attention_triton(q, k, v, batch, 0.3, num_splits=splits, config=config, out=out)
        check(out, ref, torch.bfloat16)


def test_naive_baseline_matches():
    from specserve.kernels.tree_attention.naive import tree_attention_naive

    q, k, v, batch = make_case(5, [37, 0, 70], [6, -5, 9], 16, 4, 2, 16, torch.float32)
    ref = tree_attention_ref(q, k, v, batch, 0.25, None, fp64=True)
    check(tree_attention_naive(q, k, v, batch, 0.25), ref, torch.float32)


def test_dispatch_ref_and_bad_impl():
    q, k, v, batch = make_case(1, [5], [3], 16, 2, 1, 16, torch.float32)
    ref = tree_attention_ref(q, k, v, batch, 0.5, None, fp64=True)
    check(tree_attention(q, k, v, batch, 0.5, impl="ref"), ref, torch.float32)
    with pytest.raises(ValueError, match="impl"):
        tree_attention(q, k, v, batch, 0.5, impl="cuda")


def test_launcher_validation():
    q, k, v, batch = make_case(2, [10], [4], 16, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        tree_attention_triton(q.double(), k, v, batch, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        tree_attention_triton(q, k.half(), v, batch, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        tree_attention_triton(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, batch, 1.0)
    with pytest.raises(ValueError, match="head"):
        tree_attention_triton(q[:, :3].contiguous(), k, v, batch, 1.0)
    with pytest.raises(ValueError, match="rows"):
        tree_attention_triton(q[:-1].contiguous(), k, v, batch, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        tree_attention_triton(q, k, v, batch, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="num_splits"):
        tree_attention_triton(q, k, v, batch, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="unknown tree-attention options"):  # a typo, not a no-op
        tree_attention_triton(q, k, v, batch, 1.0, options={"combine_row": 4})


def test_sm120_configs_compile_and_fit(tmp_path):
    """Cross-compiles every config the launcher can pick on sm_120 (no GPU needed) in a process
    without the interpreter — attention kernel in bf16 / fp16 / fp32, pages 16 / 64 / 1 +
    sliding window, the combine kernel and the prefill merge kernel: shared memory ≤ 101,376 B
    and no spills."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[2] / "bench" / "bench_kernel.py"
    out = tmp_path / "sm120.json"
    proc = subprocess.run([sys.executable, str(script), "--sm120-check", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    if "no triton CUDA backend" in proc.stderr:
        pytest.skip("triton has no CUDA backend / Blackwell ptxas here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())["sm120"]
    assert report and all(r["shared"] <= 101_376 and r["spills"] == 0 for r in report)
    from specserve.kernels.tree_attention.configs import all_configs
    assert len([r for r in report if r["kernel"] == "_tree_attn_kernel"]) == 3 * sum(
        2 if elem == 2 else 1 for _, _, elem in all_configs(120))  # every variant compiled
    assert len([r for r in report if r["kernel"] == "_merge_pair_kernel"]) == 4  # D 64/128


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (and TRITON_INTERPRET unset)")
class TestGPU:
    @pytest.mark.parametrize("page", [1, 16, 64])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (28, 4, 128), (16, 2, 256), (8, 8, 64)])
    def test_large(self, page, dtype, hq, hkv, d):
        q, k, v, batch = make_case(11, [4000, 0, 1500, 777], [63, -17, 15, 120], page, hq, hkv,
                                   d, dtype)
        ref = tree_attention_ref(q, k, v, batch, d**-0.5, None, fp64=True)
        for splits in (None, 1, 7, 32):
            check(tree_attention_triton(q, k, v, batch, d**-0.5, num_splits=splits), ref, dtype)
        ref = tree_attention_ref(q, k, v, batch, d**-0.5, 300, fp64=True)
        check(tree_attention_triton(q, k, v, batch, d**-0.5, 300), ref, dtype)

    @pytest.mark.parametrize("page", [1, 16, 64])
    def test_large_causal_prefill_chunks(self, page):
        q, k, v, batch = make_case(13, [3001, 0, 77], [-700, -333, -129], page, 32, 8, 128,
                                   torch.bfloat16, trees=False)
        ref = tree_attention_ref(q, k, v, batch, 0.1, None, fp64=True)
        for splits in (None, 1, 5):
            check(tree_attention_triton(q, k, v, batch, 0.1, num_splits=splits), ref,
                  torch.bfloat16)

    @pytest.mark.parametrize("ctx,one_cta", [(20000, True), (70000, False)])
    def test_measured_plans_in_a_graph(self, ctx, one_cta):
        """A 16-node tree of the 8B shape: at 16k-64k the one-CTA plan with the one-round
        combine (4 rows a program), beyond it the table plan with that combine at 2 rows; both
        trigger the next kernel before their wait, so three calls back to back in one CUDA graph
        (each one's combine beside the next one's attention) must each give the fp64 answer."""
        from specserve.kernels.tree_attention.configs import ONE_CTA_CONFIG

        cases = [make_case(20 + i, [ctx], [15], 16, 32, 8, 128, torch.bfloat16) for i in range(3)]
        refs = [tree_attention_ref(*c, 0.1, None, fp64=True) for c in cases]
        outs = [torch.full_like(c[0], float("nan")) for c in cases]
        for c, o in zip(cases, outs, strict=True):
            tree_attention_triton(*c, 0.1, out=o)  # compile, plan
        plan = next(p for key, p in cases[0][3].memo.items() if key[0] == "plan")
        assert (plan.config == ONE_CTA_CONFIG) == one_cta and plan.trigger_first
        assert plan.combine_shot == (4 if one_cta else 2) and plan.grid[0] == 1
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c, o in zip(cases, outs, strict=True):
                tree_attention_triton(*c, 0.1, out=o)
        for o in outs:
            o.fill_(float("nan"))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        for o, ref in zip(outs, refs, strict=True):
            check(o, ref, torch.bfloat16)

    def test_cuda_graph_captured_short_replays_long(self):
        long_ctx = [5000, 300]
        q, k, v, batch = make_case(12, long_ctx, [31, 9], 16, 32, 8, 128, torch.bfloat16)
        ref = tree_attention_ref(q, k, v, batch, 0.1, None, fp64=True)
        short_ctx = torch.tensor([40, 3], dtype=torch.int32, device=DEV)
        ctx_long = batch.ctx_lens_t.clone()
        batch.ctx_lens_t.copy_(short_ctx)  # capture at short contexts (same static buffers)
        kw = dict(max_ctx_len=max(long_ctx))
        tree_attention_triton(q, k, v, batch, 0.1, **kw)  # warm-up / compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tree_attention_triton(q, k, v, batch, 0.1, **kw)
        batch.ctx_lens_t.copy_(ctx_long)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, ref, torch.bfloat16)


def test_strided_q_rows_and_per_batch_memo():
    """q as a view of a fused [T, Hq + Hkv, D] tensor (rows strided, heads packed) gives the
    contiguous result; later calls on the same batch reuse the memoised plan and scratch and
    stay right for new inputs; an explicit split count gets its own plan."""
    q, k, v, batch = make_case(8, [29, 0, 70], [7, -4, 12], 16, 4, 2, 16, torch.float32)
    t, hq, d = q.shape
    g = torch.Generator().manual_seed(6)
    qk = torch.randn(t, hq + 2, d, generator=g).to(q)
    qk[:, :hq] = q
    strided = qk[:, :hq]
    assert not strided.is_contiguous()
    ref = tree_attention_ref(q, k, v, batch, 0.25, None, fp64=True)
    check(tree_attention(strided, k, v, batch, 0.25, impl="triton"), ref, torch.float32)
    plans = [key for key in batch.memo if key[0] == "plan"]
    assert len(plans) == 1
    q2 = torch.randn(q.shape, generator=g).to(q)
    ref2 = tree_attention_ref(q2, k, v, batch, 0.25, None, fp64=True)
    check(tree_attention(q2, k, v, batch, 0.25, impl="triton"), ref2, torch.float32)
    check(tree_attention_triton(q2, k, v, batch, 0.25, num_splits=3), ref2, torch.float32)
    assert len([key for key in batch.memo if key[0] == "plan"]) == 2
    gapped = torch.randn(t, 2 * hq, d, generator=g).to(q)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):  # heads not packed: stride(1) = 2·D
        tree_attention_triton(gapped, k, v, batch, 0.25)


@pytest.mark.parametrize("kernel,parts,block", [("per_row", 7, 4), ("per_row", 5, 8),
                                                ("per_row", 1, 2), ("rows", 5, 4),
                                                ("rows", 3, 2), ("rows", 1, 4)])
def test_combines_match_softmax_weighting(kernel, parts, block):
    """Both LSE merges against softmax weighting in float64 over 15 (token, head) rows: the
    per-row kernel in one load (parts ≤ BLOCK_S) and in chunks of BLOCK_S parts, the row-block
    kernel with blocks that do not divide the rows. An empty part (LSE −inf, O poisoned with
    NaN) adds nothing (the per-row kernel does not read its O, the row-block one discards it);
    the 2 parts past `parts` (NaN O, huge LSE) must not be read."""
    from specserve.kernels.tree_attention.combine import combine, combine_rows

    g = torch.Generator().manual_seed(parts + 10 * (kernel == "rows"))
    t, hq, d = 3, 5, 16
    o_part = torch.randn(parts + 2, t, hq, d, generator=g)
    lse = torch.randn(parts + 2, t, hq, generator=g) * 4
    o_part[parts:], lse[parts:] = float("nan"), 1e4
    if parts > 1:
        lse[1, 0], o_part[1, 0] = float("-inf"), float("nan")
    out = torch.full((t, hq, d), float("nan"), device=DEV)
    if kernel == "rows":
        combine_rows(o_part.to(DEV), lse.to(DEV), out, parts, block, use_pdl=False)
        with pytest.raises(ValueError, match="contiguous"):  # rows are read as one flat block
            combine_rows(o_part.to(DEV)[:, :, ::2], lse.to(DEV), out, parts, block, False)
    else:
        combine(o_part.to(DEV), lse.to(DEV), out, parts, block,
                max(2, 1 << (parts - 1).bit_length()), use_pdl=False)
    w = torch.softmax(lse[:parts].double() * np.log(2), dim=0)  # log2-domain LSEs
    ref = (w[..., None] * o_part[:parts].double().nan_to_num(0.0)).sum(0)
    assert torch.allclose(out.double().cpu(), ref, atol=1e-5)


def test_launcher_uses_both_combines():
    """Plans of ≤ COMBINE_ROWS_MAX_PARTS parts merge by row blocks, larger ones by row; both
    give the fp64 answer through the launcher (10 splits + the tail = 11 parts)."""
    from specserve.kernels.tree_attention.configs import COMBINE_BLOCK_R, COMBINE_ROWS_MAX_PARTS

    q, k, v, batch = make_case(5, [61, 30], [7, 4], 16, 4, 1, 16, torch.float32)
    ref = tree_attention_ref(q, k, v, batch, 0.25, None, fp64=True)
    for splits, want in ((2, COMBINE_BLOCK_R), (COMBINE_ROWS_MAX_PARTS + 2, None)):
        out = torch.full_like(q, float("nan"))
        tree_attention_triton(q, k, v, batch, 0.25, num_splits=splits, out=out)
        check(out, ref, torch.float32)
        plans = [p for key, p in batch.memo.items() if key[0] == "plan" and p.parts == splits + 1]
        assert [p.combine_rows for p in plans] == [want]


def test_one_round_combine_ignores_empty_parts():
    """The one-round combine (configs.combine_shot_rows) gives the fp64 answer with more splits
    than the contexts fill: the empty parts' partial O, never written, hold NaN here."""
    from specserve.kernels.tree_attention.plan import scratch

    q, k, v, batch = make_case(9, [61, 30], [7, 4], 16, 4, 1, 16, torch.float32)
    ref = tree_attention_ref(q, k, v, batch, 0.25, None, fp64=True)
    with pytest.raises(ValueError, match="power of two"):
        tree_attention_triton(q, k, v, batch, 0.25, options={"combine_shot": 3})
    for rows in (1, 2, 4):
        for o in scratch(batch, 21, *q.shape, q.device):
            o.fill_(float("nan"))
        out = torch.full_like(q, float("nan"))
        tree_attention_triton(q, k, v, batch, 0.25, num_splits=20, out=out,
                              options={"combine_shot": rows})
        check(out, ref, torch.float32)
        plan = next(p for key, p in batch.memo.items()
                    if key[0] == "plan" and key[-1] == (("combine_shot", rows),))
        assert plan.combine_shot == rows and plan.parts == 21


def test_plan_choices_follow_the_measured_table():
    """The config / split choices the H200 sweeps picked (BENCHMARKS.md runs 5-7): a 65-node tree
    (260 rows) at 1k uses 64-row blocks in 4 splits, at 128k 128-row blocks in 11 (two full
    waves of 132 SMs); a 17-node tree (68 rows) at 128k 16 splits (one wave); 16 and 1 tree
    nodes at 32k split 32 ways."""
    from specserve.kernels.tree_attention.configs import (
        ONE_CTA_CONFIG,
        SHORT_CONTEXT,
        combine_shot_rows,
        ctas_per_sm,
        default_num_splits,
        one_cta_splits,
        pick_config,
    )

    short, long = pick_config(90, 128, 260, 2, 1024), pick_config(90, 128, 260, 2, 131072)
    assert (short.block_m, long.block_m) == (64, 128)
    assert pick_config(90, 128, 260, 2, SHORT_CONTEXT + 1).block_m == 128
    assert pick_config(90, 128, 260, 2) == long  # no context given: the rows decide
    assert default_num_splits(1024, 260, 8 * 5, 132, ctas_per_sm(short)) == 4
    assert default_num_splits(131072, 260, 8 * 3, 132, ctas_per_sm(long)) == 11
    assert default_num_splits(131072, 68, 8, 132, 1) == 16  # one wave, not two (S = 33)
    assert default_num_splits(131072, 256, 16, 132, 1) == 8
    assert default_num_splits(131072, 1024, 64, 132, 1) == 2
    assert default_num_splits(32768, 64, 8, 132, 2) == 32
    assert default_num_splits(32768, 4, 8, 132, 2) == 32
    assert default_num_splits(700, 4, 8, 132, 2) == 2  # chunks stay ≥ 256 tokens
    # one request's 16 tree nodes (64 rows) at 16k-64k: one CTA per SM in 16 splits, the
    # one-round combine at 4 rows; beyond, the table plan with it at 2 rows; nowhere else
    for ctx in (16384, 32768, 65536):
        assert one_cta_splits(90, 128, 64, 2, ctx, 8, 132) == 16
        assert combine_shot_rows(90, 128, 64, 2, ctx, 8, 132, True) == 4
    assert one_cta_splits(90, 128, 36, 2, 32768, 8, 132) == 16  # 9 nodes: the same bucket
    one = ONE_CTA_CONFIG  # given explicitly, without splits: planned as one CTA per SM too
    assert default_num_splits(32768, 64, 8, 132, ctas_per_sm(one)) == 16
    assert combine_shot_rows(90, 128, 64, 2, 131072, 8, 132, False) == 2
    for args in [(90, 128, 64, 2, 131072, 8), (90, 128, 64, 2, 8192, 8),
                 (90, 128, 64, 2, 32768, 16), (90, 128, 16, 2, 32768, 8),
                 (90, 128, 68, 2, 32768, 8), (90, 64, 64, 2, 32768, 8),
                 (90, 128, 64, 4, 32768, 8), (120, 128, 64, 2, 32768, 8),
                 (None, 128, 64, 2, 32768, 8)]:
        assert one_cta_splits(*args, 132) is None, args
    for args in [(90, 128, 16, 2, 131072, 8), (90, 128, 64, 2, 8192, 8),
                 (90, 128, 64, 2, 131072, 16), (120, 128, 64, 2, 131072, 8)]:
        assert combine_shot_rows(*args, 132, False) is None, args
