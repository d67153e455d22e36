"""The lean inference forward (fewer kernels per layer) equals the nn.Module path; fused weights
track parameter changes; the KV pool's one-tensor layout, packed host-to-device metadata and the
rolled RoPE / two-kernel RMSNorm are exact rewrites."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.attention.base import AttnBatch, packed_offsets, to_device
from specserve.kvcache.pool import KVPool, KVShape
from specserve.models.config import RopeConfig
from specserve.models.decoder import rms_norm
from specserve.models.loader import load_model
from specserve.models.rope import Rotary, apply_rotary, apply_rotary_rolled
from tests.helpers import CONFIGS, prefill_then_tree_steps


def _run(model, grad: bool, taps=()):
    c = model.config
    dtype = model.lm_head.weight.dtype
    kv = KVPool(KVShape(c.num_layers, c.num_kv_heads, c.head_dim, dtype), 8, 16, poison=True)
    outs = []
    for ids, args in prefill_then_tree_steps(c.vocab_size):
        batch = AttnBatch.build(*args)
        with torch.set_grad_enabled(grad):
            hidden, feats = model(ids, batch, kv, taps)
            outs.append((model.logits(hidden).detach(),
                         None if feats is None else feats.detach()))
    return outs


def _close(a, b, tol=1e-5):
    for (la, fa), (lb, fb) in zip(a, b, strict=True):
        assert ((la - lb).norm() / lb.norm()).item() <= tol
        if fb is not None:
            assert ((fa - fb).norm() / fb.norm()).item() <= tol


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inference_path_fused_and_unfused_equal_module_path(checkpoint_cache, name):
    path, _ = checkpoint_cache(name)
    model = load_model(path)
    ref = _run(model, grad=True, taps=(0, 2))  # nn.Module path (autograd on)
    _close(_run(model, grad=False, taps=(0, 2)), ref)  # lean path, separate projections
    model.fuse_projections()
    assert model._fused is not None
    _close(_run(model, grad=False, taps=(0, 2)), ref)  # lean path, fused projections
    _close(_run(model, grad=True, taps=(0, 2)), ref)  # module path still fine on the views


def test_inference_path_with_distinct_q_and_k_norm_eps(checkpoint_cache):
    """q_norm and k_norm with different eps (the unfused-norm branch): each head group is
    normalised once, with its own eps, from the projection — as the module path does."""
    path, _ = checkpoint_cache("qwen3-gqa4-yarn")
    model = load_model(path)
    for layer in model.model.layers:
        layer.self_attn.k_norm.eps = 0.5  # large: a wrong eps or a second norm shows
    ref = _run(model, grad=True)
    _close(_run(model, grad=False), ref)
    model.fuse_projections()
    assert model._fused[0].qk_norm_w is None  # eps differ: norms are not stacked
    _close(_run(model, grad=False), ref)


def test_fused_weights_are_views_and_follow_changes(checkpoint_cache):
    path, _ = checkpoint_cache("qwen3-gqa4-yarn")
    model = load_model(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.fuse_projections()
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    assert all(torch.equal(after[n], t) for n, t in before.items())
    attn = model.model.layers[1].self_attn
    fused = model._fused[1]
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.qkv_w.data_ptr()
    with torch.no_grad():  # in-place edits reach the fused tensors (views / version check)
        attn.q_proj.weight.mul_(1.5)
        attn.k_norm.weight.add_(0.25)
        model.model.layers[0].mlp.up_proj.weight.mul_(-1.0)
    _close(_run(model, grad=False), _run(model, grad=True))
    # a replaced parameter (assign=True) is noticed by its data pointer and re-fused
    state = {n: p.detach().clone() * 0.9 for n, p in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    _close(_run(model, grad=False), _run(model, grad=True))
    model.double()  # .to()/.double() re-fuse in the new dtype
    assert model._fused[0].qkv_w.dtype == torch.float64
    _close(_run(model, grad=False), _run(model, grad=True), tol=1e-12)


def test_kv_pool_one_tensor_layers_copy_and_grad_writes():
    pool = KVPool(KVShape(3, 2, 16, torch.float32), 4, 4)
    g = torch.Generator().manual_seed(4)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
    assert pool.k[2].data_ptr() == pool.kv[0, 2].data_ptr() and pool.v[1].is_contiguous()
    ref = pool.kv.clone()
    src, dst = [1, 5, 6], [5, 6, 9]  # overlapping: every source is read before any write
    pool.copy_slots(src, dst)
    flat, rflat = pool.kv.view(6, 16, 2, 16), ref.view(6, 16, 2, 16)
    assert torch.equal(flat[:, dst], rflat[:, src])
    assert torch.equal(flat[:, [0, 2, 3, 4, 7]], rflat[:, [0, 2, 3, 4, 7]])
    pool.copy_slots(torch.tensor([2]), torch.tensor([3]))
    assert torch.equal(flat[:, 3], rflat[:, 2])
    pool.copy_slots([], [])
    with pytest.raises(ValueError):
        pool.copy_slots([1], [])
    k = torch.randn(2, 2, 16, generator=g).requires_grad_()
    with torch.enable_grad():  # stored detached: the cache never joins an autograd graph
        pool.write(1, torch.tensor([0, 7]), k * 2, k * 3)
    assert not pool.kv.requires_grad
    assert torch.equal(pool.k[1].view(16, 2, 16)[7], (k[1] * 2).detach())
    assert torch.equal(pool.v[1].view(16, 2, 16)[0], (k[0] * 3).detach())


def test_build_with_packs_metadata_and_extras():
    mask = np.array([[1], [3], [0x80000001]], dtype=np.uint32)  # bit 31 survives the int32 view
    batch, (ids, rows) = AttnBatch.build_with(
        [3, 2], [5, 0], [[1, 2], [3]], [5, 6, 6, 0, 1], 4, [mask, np.array([[1], [3]],
                                                                           np.uint32)],
        extra=(np.arange(5), np.array([2, 4])))
    assert batch.tree_mask.dtype == torch.int32 and batch.tree_mask.shape == (5, 1)
    assert batch.tree_mask.view(torch.uint32)[2, 0].item() == 0x80000001
    assert batch.slot_mapping.tolist() == [9, 10, 11, 12, 13]
    assert batch.cu_q.tolist() == [0, 3, 5] and batch.ctx_lens_t.dtype == torch.int32
    assert ids.tolist() == list(range(5)) and rows.dtype == torch.int64
    assert batch.memo == {}
    got = to_device([np.zeros((0, 3), np.int32), np.ones(2, np.float32)], "cpu")
    assert got[0].shape == (0, 3) and got[1].dtype == torch.float32


def test_packed_slots_are_16_byte_aligned():
    """Triton specialises pointers on 16-byte divisibility: every packed view must keep it."""
    offsets, total = packed_offsets([12, 8, 0, 4 * 3, 40, 1])
    assert offsets == [0, 16, 32, 32, 48, 96] and total == 112


@pytest.mark.parametrize("rope", [
    RopeConfig(theta=1e6),
    RopeConfig(theta=1e4, rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    RopeConfig(theta=5e5, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
               high_freq_factor=4.0, original_max_position_embeddings=32),
    RopeConfig(theta=1e4, rope_type="linear", factor=2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rolled_rotary_and_two_kernel_rmsnorm_are_bitwise(rope, dtype):
    r = Rotary(rope, 64)
    pos = torch.randint(0, 50_000, (23,), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(23, 6, 64, generator=g).to(dtype)
    assert torch.equal(apply_rotary(x, *r(pos, dtype)),
                       apply_rotary_rolled(x, *r.rolled_tables(pos, dtype)))
    w = torch.randn(64, generator=g).to(dtype)
    hf = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), hf)
