"""Fused layer kernels vs the torch ops they replace (CPU interpreter; GPU classes when present).

Each kernel vs ref.py (the lean torch path's own ops) on small irregular shapes — 7 rows, 96 / 100
columns, 6 q + 2 kv heads of 16, shuffled slots over odd page counts — random non-zero inputs,
fixed seeds, bf16 and fp32; KV pools poisoned with NaN (slots not written must still hold it).
Then whole tiny models: the fused forward vs the torch forward, taps and KV pool included.

What "equal" means (`check`):
- bf16: every element within 1 ulp, at most 0.1% off at all (the bf16 runs here are bitwise).
  The kernels round after each op where torch does, with fp32 math between; what differs is fp32
  detail below bf16's precision — the sum of squares' order (a tree, not torch's vector loop),
  exp (libdevice / numpy, not Sleef) — which moves a result only within ~2^-16 of a boundary.
- fp16 (GPU only): the same within 2 ulp: its finer grid meets such boundaries more often, and a
  normalised value 1 ulp off is up to 2 ulp off after × weight < 1 (a lower binade).
- fp32: those differences are the output's own precision: torch's CPU fp32 rms_norm and silu are
  not correctly rounded (3–4 ulp off the exact steps the kernels take) and RoPE's x·cos +
  roll(x)·sin can cancel, so the bound is absolute: a few ulp of the operands.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the Triton interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specserve.attention.base import AttnBatch  # noqa: E402
from specserve.kernels.fused import fused_ops  # noqa: E402
from specserve.kernels.fused.kernel import add_rms_norm, qk_norm_rope_kv, silu_mul  # noqa: E402
from specserve.kernels.fused.ref import add_rms_norm_ref, qk_norm_rope_kv_ref, silu_mul_ref  # noqa: E402
from specserve.kvcache.pool import KVPool, KVShape  # noqa: E402
from specserve.models.config import ModelConfig, RopeConfig  # noqa: E402
from specserve.models.decoder import DecoderModel  # noqa: E402
from specserve.models.fused_layer import forward_fused  # noqa: E402
from specserve.models.rope import Rotary  # noqa: E402
from tests.helpers import prefill_then_tree_steps  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEV = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float32]
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns as integers in the order of the values (1 apart = 1 ulp apart)."""
    bits = x.view({2: torch.int16, 4: torch.int32}[x.element_size()]).long()
    top = 1 << (8 * x.element_size() - 1)
    return torch.where(bits < 0, -(bits + top), bits)


def check(out: torch.Tensor, ref: torch.Tensor, max_frac: float = 1e-3) -> None:
    """Equal as the module docstring defines it."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    ulps = (_ordered(out) - _ordered(ref)).abs()
    worst, frac = ulps.max().item(), (ulps > 0).float().mean().item()
    bound = 1 if ref.dtype == torch.bfloat16 else 2
    assert worst <= bound and frac <= max_frac, f"{worst} ulp apart, {frac:.2%} differ"


def randn(*shape, gen, scale=1.0, offset=0.0, dtype=torch.float32) -> torch.Tensor:
    return (offset + scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEV)


def poisoned_pool(pages, page_size, hkv, d, dtype):
    return torch.full((pages, page_size, hkv, d), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [96, 100])
def test_add_rms_norm(dtype, n):
    gen = torch.Generator().manual_seed(n)
    wide = randn(7, n + 5, gen=gen, scale=3.0, dtype=dtype)
    x = wide[:, 2 : n + 2]  # strided rows (a view into a wider tensor)
    res = randn(7, n, gen=gen, dtype=dtype)
    w = randn(n, gen=gen, scale=0.3, offset=1.0, dtype=dtype)
    h, x_new = add_rms_norm(x, res, w, 1e-6)
    h_ref, x_ref = add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(x_new, x_ref)  # the add is one rounding, in either form
    check(h, h_ref)
    h, x_same = add_rms_norm(x, None, w, 1e-5)
    assert x_same is x
    check(h, add_rms_norm_ref(x, None, w, 1e-5)[0])


QKV_CASES = [  # hq, hkv, d, pages, page_size, with q/k norm
    (6, 2, 16, 5, 4, True),
    (6, 2, 16, 3, 16, False),
    (4, 4, 32, 7, 1, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", QKV_CASES, ids=lambda c: f"h{c[0]}-{c[1]}-d{c[2]}-p{c[4]}-"
                         f"{'norm' if c[5] else 'nonorm'}")
def test_qk_norm_rope_kv(dtype, case):
    hq, hkv, d, pages, page_size, norm = case
    gen = torch.Generator().manual_seed(d + page_size)
    t = 7
    qkv = randn(t, (hq + 2 * hkv) * d, gen=gen, scale=2.0, dtype=dtype)
    norm_w = randn(hq + hkv, d, gen=gen, scale=0.3, offset=1.0, dtype=dtype) if norm else None
    positions = torch.randint(0, 5000, (t,), generator=gen).to(DEV)
    rope = Rotary(RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
                  d).to(DEV)
    cos, sin = rope.rolled_tables(positions, dtype)
    slots = torch.randperm(pages * page_size, generator=gen)[:t].to(DEV)
    pools = [poisoned_pool(pages, page_size, hkv, d, dtype) for _ in range(4)]
    q = qk_norm_rope_kv(qkv, norm_w, cos, sin, slots, pools[0], pools[1], hq, hkv, 1e-6)
    q_ref = qk_norm_rope_kv_ref(qkv, norm_w, cos, sin, slots, pools[2], pools[3], hq, hkv, 1e-6)
    assert q.is_contiguous()
    check(q, q_ref)
    untouched = torch.ones(pages * page_size, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    for got, ref in ((pools[0], pools[2]), (pools[1], pools[3])):
        flat, flat_ref = got.view(-1, hkv, d), ref.view(-1, hkv, d)
        assert flat[untouched].isnan().all()  # nothing written outside `slots`
        check(flat[slots], flat_ref[slots])
    assert torch.equal(pools[1].view(-1, hkv, d)[slots], pools[3].view(-1, hkv, d)[slots])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [80, 1100])
def test_silu_mul(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = randn(7, 2 * inter, gen=gen, scale=3.0, dtype=dtype)
    check(silu_mul(gate_up), silu_mul_ref(gate_up))


def test_launcher_validation():
    gen = torch.Generator().manual_seed(0)
    x, w = randn(3, 8, gen=gen), randn(8, gen=gen)
    qkv, pool = randn(3, 8 * 16, gen=gen), poisoned_pool(2, 4, 2, 16, torch.float32)
    cos = sin = randn(3, 1, 16, gen=gen)
    slots = torch.arange(3, device=DEV)
    args = (cos, sin, slots, pool, pool, 4, 2)
    calls = {  # what the error names -> a call that must raise it
        "residual": lambda: add_rms_norm(x, x[:2], w, 1e-6),
        "weight": lambda: add_rms_norm(x, None, w.to(torch.bfloat16), 1e-6),
        "contiguous rows": lambda: add_rms_norm(x.t(), None, randn(3, gen=gen), 1e-6),
        "2I": lambda: silu_mul(randn(3, 7, gen=gen)),
        "qkv": lambda: qk_norm_rope_kv(qkv[:, :-16], None, *args),
        "norm_w": lambda: qk_norm_rope_kv(qkv, randn(4, 16, gen=gen), *args),
        "slots": lambda: qk_norm_rope_kv(qkv, None, cos, sin, slots.int(), pool, pool, 4, 2),
        "dtype": lambda: qk_norm_rope_kv(qkv, None, *args[:3], pool.double(), pool.double(), 4, 2),
        "impl": lambda: fused_ops("cuda", "cpu"),
    }
    for match, call in calls.items():
        with pytest.raises(ValueError, match=match):
            call()


def tiny_model(dtype, qk_norm=True, bias=False, sliding=False, fuse=True, k_eps=None, seed=0):
    """3 layers, hidden 96, 6 q / 2 kv heads of 16; every weight random (norms around 1).
    `k_eps`: k_norm's own eps (q/k norms then not stacked: those layers run the torch layer)."""
    cfg = ModelConfig("Qwen3ForCausalLM", vocab_size=211, hidden_size=96, intermediate_size=160,
                      num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      max_position_embeddings=512, tie_word_embeddings=False, qk_norm=qk_norm,
                      attention_bias=bias, sliding_window=5 if sliding else None,
                      layer_types=("full_attention", "sliding_attention", "full_attention")
                      if sliding else ())
    torch.manual_seed(seed)
    model = DecoderModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    for layer in model.model.layers if k_eps is not None else ():
        layer.self_attn.k_norm.eps = k_eps
    model = model.to(DEV, dtype).eval()
    if fuse:
        model.fuse_projections()
    return model


def run_steps(model, forward, taps=(0, 2)):
    """Both steps through `forward(model, ids, batch, kv, taps)`; returns outputs and pool."""
    c = model.config
    kv = KVPool(KVShape(c.num_layers, c.num_kv_heads, c.head_dim, model.lm_head.weight.dtype),
                8, 16, device=DEV, poison=True)
    outs = []
    for ids, args in prefill_then_tree_steps(c.vocab_size):
        with torch.inference_mode():
            outs.append(forward(model, ids.to(DEV), AttnBatch.build(*args, device=DEV), kv, taps))
    return outs, kv.kv


def torch_forward(model, ids, batch, kv, taps):
    return model._forward_inference(ids, batch, kv, taps) if not ids.is_cuda else \
        forward_fused(model, ids, batch, kv, taps, impl="ref")


MODELS = {  # name -> tiny_model kwargs
    "qwen3": {},
    "qwen2-bias-sliding": {"qk_norm": False, "bias": True, "sliding": True},
    "unfused": {"fuse": False},
    "qk-eps-differ": {"k_eps": 0.5},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_fused_forward_equals_torch_forward(dtype, name):
    """Hidden states, tapped features and the KV pool: the Triton forward matches the torch one;
    the torch ops in the fused structure (impl="ref": residual adds carried into the norms)
    are bitwise the torch forward."""
    model = tiny_model(dtype, **MODELS[name])
    ref, ref_kv = run_steps(model, torch_forward)
    same, same_kv = run_steps(model, lambda *a: forward_fused(*a, impl="ref"))
    got, got_kv = run_steps(model, lambda *a: forward_fused(*a, impl="triton"))
    assert torch.equal(same_kv.nan_to_num(7.0), ref_kv.nan_to_num(7.0))
    written = ~ref_kv.isnan()
    assert got_kv[~written].isnan().all()
    check(got_kv[written], ref_kv[written], max_frac=2e-3)
    for (h, feats), (h_same, f_same), (h_ref, f_ref) in zip(got, same, ref, strict=True):
        assert torch.equal(h_same, h_ref) and torch.equal(f_same, f_ref)
        assert f_ref.shape == (h_ref.shape[0], 2 * 96)
        check(h, h_ref, max_frac=2e-3)
        check(feats, f_ref, max_frac=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (and TRITON_INTERPRET unset)")
class TestGPU:
    """The Qwen3-8B shape: T = 65 tree rows, hidden 4096, 32 / 8 heads of 128, MLP 12288.
    The reference is the CPU twin (ref.py on CPU copies): torch's CUDA norm is no closer to it
    than the kernels are (its own sum order and an approximate rsqrt)."""

    T = 65

    @pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
    def test_add_rms_norm(self, dtype):
        gen = torch.Generator().manual_seed(1)
        x = randn(self.T, 4096, gen=gen, scale=4.0, dtype=dtype)
        res = randn(self.T, 4096, gen=gen, dtype=dtype)
        w = randn(4096, gen=gen, scale=0.3, offset=1.0, dtype=dtype)
        h, x_new = add_rms_norm(x, res, w, 1e-6)
        h_ref, x_ref = add_rms_norm_ref(x.cpu(), res.cpu(), w.cpu(), 1e-6)
        assert torch.equal(x_new.cpu(), x_ref)
        check(h.cpu(), h_ref)

    @pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
    def test_silu_mul(self, dtype):
        gen = torch.Generator().manual_seed(2)
        gate_up = randn(self.T, 2 * 12288, gen=gen, scale=3.0, dtype=dtype)
        check(silu_mul(gate_up).cpu(), silu_mul_ref(gate_up.cpu()))

    @pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
    def test_qk_norm_rope_kv(self, dtype):
        gen = torch.Generator().manual_seed(3)
        hq, hkv, d = 32, 8, 128
        qkv = randn(self.T, (hq + 2 * hkv) * d, gen=gen, scale=2.0, dtype=dtype)
        norm_w = randn(hq + hkv, d, gen=gen, scale=0.3, offset=1.0, dtype=dtype)
        positions = torch.randint(0, 30000, (self.T,), generator=gen).to(DEV)
        cos, sin = Rotary(RopeConfig(theta=1e6), d).to(DEV).rolled_tables(positions, dtype)
        slots = torch.randperm(300 * 16, generator=gen)[: self.T].to(DEV)
        k_cache, v_cache = (poisoned_pool(300, 16, hkv, d, dtype) for _ in range(2))
        k_ref, v_ref = k_cache.cpu(), v_cache.cpu()
        q = qk_norm_rope_kv(qkv, norm_w, cos, sin, slots, k_cache, v_cache, hq, hkv, 1e-6)
        q_ref = qk_norm_rope_kv_ref(qkv.cpu(), norm_w.cpu(), cos.cpu(), sin.cpu(), slots.cpu(),
                                    k_ref, v_ref, hq, hkv, 1e-6)
        check(q.cpu(), q_ref)
        written = ~k_ref.isnan()
        k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
        assert k_cache[~written].isnan().all() and v_cache[~written].isnan().all()
        check(k_cache[written], k_ref[written])
        assert torch.equal(v_cache[written], v_ref[written])

    @pytest.mark.parametrize("name", sorted(MODELS))
    def test_model_forward_on_cuda_is_fused(self, name):
        """On CUDA the inference forward is the fused one, and matches the torch ops' (CUDA's
        own norm differs from the kernel's in rare ulps, which later layers carry on: compared
        by relative error, bf16's ulp being 2^-8)."""
        model = tiny_model(torch.bfloat16, **MODELS[name])
        got, got_kv = run_steps(model, lambda m, *a: m(*a))
        ref, ref_kv = run_steps(model, torch_forward)
        written = ~ref_kv.isnan()
        assert got_kv[~written].isnan().all()
        pairs = [(got_kv[written], ref_kv[written])] + [
            pair for g, r in zip(got, ref, strict=True) for pair in zip(g, r, strict=True)]
        for out, want in pairs:
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            assert err <= 2e-3, err


@pytest.mark.parametrize("rows", [7, 65])
def test_down_proj_is_the_linear_and_restores_the_blas_choice(rows):
    """`down_proj` = F.linear (through cuBLASLt on CUDA at 64-96 rows: the fp64 product within
    bf16 rounding there) and leaves torch's preferred BLAS library as it found it, also when the
    GEMM raises."""
    from specserve.models.fused_layer import LT_DOWN_ROWS, down_proj

    gen = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x, w = randn(rows, 96, gen=gen, dtype=dtype), randn(80, 96, gen=gen, scale=0.2, dtype=dtype)
    before = torch.backends.cuda.preferred_blas_library()
    got = down_proj(x, w)
    want = (x.double() @ w.double().T).to(dtype)
    assert (got.double() - want.double()).abs().max() <= 2e-2 * want.double().abs().max()
    assert torch.backends.cuda.preferred_blas_library() == before
    with pytest.raises(RuntimeError):
        down_proj(x, w[:, :95])
    assert torch.backends.cuda.preferred_blas_library() == before
    assert (rows in LT_DOWN_ROWS) == (rows == 65)
