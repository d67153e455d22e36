"""Tree-verify attention over a paged KV pool: public entry point `tree_attention`.

Owns the input contract (`check_inputs`: ValueError on misuse; the kernels check nothing), the
CPU interpreter fix both kernels need (`fix_interpreter_index`) and the
dispatch between the Triton kernel (kernel.py: split-KV prefix with GQA packing + tree
tail/combine) and the torch reference (ref.py). Semantics are those of
`specserve.attention.torch_ref` (AttnBatch: ragged new tokens over a paged prefix, ancestor
bitmask or causal among the new tokens, optional sliding window on absolute positions).
"""

from __future__ import annotations

import torch

from specserve.attention.base import AttnBatch

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_tensors(q, k_pool, v_pool) -> None:
    """Raise ValueError unless q [T, Hq, D] and the pools [P, S, Hkv, D] share a dtype."""
    if q.dim() != 3 or k_pool.dim() != 4 or v_pool.shape != k_pool.shape:
        raise ValueError(f"need q [T, Hq, D] and equal pools [P, S, Hkv, D], got q "
                         f"{tuple(q.shape)}, k {tuple(k_pool.shape)}, v {tuple(v_pool.shape)}")
    if q.dtype not in _DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"q/k/v must share a dtype in {_DTYPES}, got "
                         f"{q.dtype}/{k_pool.dtype}/{v_pool.dtype}")


def check_inputs(q, k_pool, v_pool, batch, sliding_window, num_splits) -> None:
    """Raise ValueError unless the inputs fit the kernels (the kernels check nothing).

    q may have strided rows (e.g. a view of a fused q|k projection) but its heads must be packed:
    stride(2) == 1 and stride(1) == head_dim. The batch-metadata half of the checks depends only
    on the batch, the device and T, so it runs once per batch (memoised in `batch.memo`), not once
    per layer.
    """
    _check_tensors(q, k_pool, v_pool)
    t, hq, d = q.shape
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()) or (
            q.stride(2) != 1 or (hq > 1 and q.stride(1) != d) or (t > 1 and q.stride(0) < hq * d)):
        raise ValueError("k_pool and v_pool must be contiguous, q contiguous within each row "
                         f"(q strides {q.stride()})")
    _, page_size, hkv, dk = k_pool.shape
    if dk != d or hq % hkv != 0:
        raise ValueError(f"head mismatch: q has {hq} heads of {d}, pools {hkv} heads of {dk} "
                         "(need Hq % Hkv == 0 and equal head_dim)")
    if k_pool.numel() >= 2**31 or max(t - 1, 0) * q.stride(0) + hq * d >= 2**31:
        raise ValueError("k_pool / q must span < 2**31 elements (the kernels use int32 offsets)")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if page_size != batch.page_size or page_size & (page_size - 1):
        raise ValueError(f"pool page size {page_size} must equal batch.page_size "
                         f"{batch.page_size} and be a power of two")
    device = q.device
    if k_pool.device != device or v_pool.device != device:
        raise ValueError("q, k_pool, v_pool must be on one device")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if num_splits is not None and not 1 <= int(num_splits) <= 65535:
        raise ValueError(f"num_splits must be in [1, 65535], got {num_splits}")
    key = ("checked", t, device)
    if key not in batch.memo:
        _check_batch(batch, t, device)
        batch.memo[key] = True


def _check_batch(batch, t, device) -> None:
    if t != sum(batch.q_lens) or len(batch.ctx_lens) != len(batch.q_lens):
        raise ValueError(f"q has {t} rows but batch.q_lens sums to {sum(batch.q_lens)}")
    meta = {"cu_q": (batch.cu_q, torch.int32), "ctx_lens_t": (batch.ctx_lens_t, torch.int32),
            "block_table": (batch.block_table, torch.int32),
            "positions": (batch.positions, torch.int64)}
    if batch.tree_mask is not None:
        meta["tree_mask"] = (batch.tree_mask, torch.int32)
        if batch.tree_mask.shape[0] != t or 32 * batch.tree_mask.shape[1] < max(batch.q_lens):
            raise ValueError(f"tree_mask {tuple(batch.tree_mask.shape)} must be [T, W] with "
                             f"32·W >= max q_len")
    for name, (x, dtype) in meta.items():
        if x.dtype != dtype or not x.is_contiguous() or x.device != device:
            raise ValueError(f"batch.{name} must be contiguous {dtype} on {device}, got "
                             f"{x.dtype} on {x.device}")


_INTERPRETER_FIXED = False


def fix_interpreter_index() -> None:
    """Triton 3.6's CPU interpreter holds scalars as 1-element arrays and turns them into loop
    bounds with `int(array)`, which numpy ≥ 2.3 rejects; take the element instead (idempotent)."""
    global _INTERPRETER_FIXED
    if _INTERPRETER_FIXED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _INTERPRETER_FIXED = True


_TRITON = None  # kernel.tree_attention_triton, imported on first use


def tree_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [P, page_size, Hkv, D] (new tokens' K already written)
    v_pool: torch.Tensor,  # [P, page_size, Hkv, D]
    batch: AttnBatch,
    scale: float,
    sliding_window: int | None = None,
    impl: str = "auto",
    num_splits: int | None = None,
    max_ctx_len: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of the batch's new tokens; `impl`: "auto" (triton on CUDA, ref on CPU),
    "triton" (on CPU needs TRITON_INTERPRET=1) or "ref". `num_splits` / `max_ctx_len` only
    affect the Triton path (see `kernel.tree_attention_triton`, CUDA-graph notes there)."""
    global _TRITON
    if impl == "auto":
        impl = "triton" if q.is_cuda else "ref"
    if impl == "triton":  # the launcher validates (once, not twice per call)
        if _TRITON is None:
            from specserve.kernels.tree_attention.kernel import tree_attention_triton

            _TRITON = tree_attention_triton
        return _TRITON(q, k_pool, v_pool, batch, scale, sliding_window, num_splits=num_splits,
                       max_ctx_len=max_ctx_len)
    if impl == "ref":
        from specserve.kernels.tree_attention.ref import tree_attention_ref

        check_inputs(q, k_pool, v_pool, batch, sliding_window, num_splits)
        return tree_attention_ref(q, k_pool, v_pool, batch, scale, sliding_window)
    raise ValueError(f"impl must be 'auto', 'triton' or 'ref', got {impl!r}")


__all__ = ["check_inputs", "fix_interpreter_index", "tree_attention"]
