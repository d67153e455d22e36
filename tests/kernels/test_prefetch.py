"""The L2 prefetch of o_proj's weight (kernels/fused/prefetch.py, wired in fused_layer).

A prefetch changes no value, so what can go wrong is: the compiler dropping the instruction (its
result is a dummy), the tail's size going wrong (a request past the tensor), bad input slipping
through, and the side-stream branch breaking the forward or a CUDA graph. Checked: the PTX for
sm_90 and sm_120 (cross-compiled in a process without the CPU interpreter, no GPU needed) holds
the guarded bulk prefetch; the launcher's ValueErrors; on a GPU, the forward with the prefetch
forked at either point is bitwise the forward without it, eager and replayed from a graph, and
the kernel is launched exactly when it should be.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.kernels.test_fused import DEV, ON_GPU, run_steps, tiny_model

COMPILE = textwrap.dedent("""
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.fused.prefetch import CHUNK, LANES, _l2_prefetch_kernel
    sig = {"Base": "*u8", "nbytes": "i64", "Sink": "*i32", "CHUNK": "constexpr",
           "LANES": "constexpr"}
    out = {}
    for arch in (90, 120):
        c = triton.compile(ASTSource(fn=_l2_prefetch_kernel, signature=sig,
                                     constexprs={"CHUNK": CHUNK, "LANES": LANES}),
                           target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
        out[arch] = [c.asm["ptx"], len(c.asm["cubin"])]
    print(json.dumps(out))
""")


def test_prefetch_compiles_to_a_guarded_bulk_prefetch():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(__file__) + "/../..")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    for arch, (ptx, cubin) in json.loads(proc.stdout).items():
        lines = [ln for ln in ptx.splitlines() if "cp.async.bulk.prefetch.L2.global" in ln]
        assert len(lines) == 1, (arch, lines)
        assert "@p cp.async.bulk.prefetch" in lines[0] and "setp.gt.s32" in lines[0]
        assert cubin > 0


def test_prefetch_validates_its_input():
    from kernels.fused.prefetch import l2_prefetch

    with pytest.raises(ValueError, match="contiguous CUDA"):
        l2_prefetch(torch.ones(64))  # a CPU tensor
    if not ON_GPU:
        return
    w = torch.ones(64, 96, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="contiguous CUDA"):
        l2_prefetch(w.t())
    for bad in (-16, 15, w.numel() * 2 + 16):
        with pytest.raises(ValueError, match="multiple of 16"):
            l2_prefetch(w, bad)
    l2_prefetch(w, 0)  # nothing to ask for: no launch, no error
    l2_prefetch(w, 4096)
    torch.cuda.synchronize()


def _launched(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "_l2_prefetch_kernel" in e.name
               and str(e.device_type).endswith("CUDA"))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("at", ["rope", "qkv"])
def test_forward_with_prefetch_is_bitwise_the_forward_without(at, monkeypatch):
    from specserve.models import fused_layer

    model = tiny_model(torch.bfloat16)
    fwd = lambda m, *a: m(*a)  # noqa: E731
    monkeypatch.setattr(fused_layer, "O_PREFETCH_AT", None)
    want, want_kv = run_steps(model, fwd)
    assert _launched(lambda: run_steps(model, fwd)) == 0
    monkeypatch.setattr(fused_layer, "O_PREFETCH_AT", at)
    got, got_kv = run_steps(model, fwd)
    assert torch.equal(got_kv.nan_to_num(7.0), want_kv.nan_to_num(7.0))
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))
    layers = model.config.num_layers
    assert _launched(lambda: run_steps(model, fwd)) == 2 * layers  # both steps, every layer
    monkeypatch.setattr(fused_layer, "PREFETCH_MAX_ROWS", 3)  # the steps have more rows
    assert _launched(lambda: run_steps(model, fwd)) == 0
