"""The peers of bench/bench_e2e.py on the SAME weights (rows added to `prefill` / `decode`).

* `hf_sdpa` (prefill): transformers' Qwen3ForCausalLM with SDPA attention, built on the meta
  device and given our tensors by state_dict name (`assign=True`: shared, no copy, no second
  16 GB); one forward over the prompt with a DynamicCache and `logits_to_keep=1`.
* `hf_generate` (decode): its greedy `generate`; ms/token = (t(n tokens) − t(1 token)) / (n − 1).
* `dflash_generate` (decode): the reference implementation (PyPI `dflash`, if installed) with the
  reference `DFlashDraftModel` holding our drafter's tensors; per step = decode time / steps.
Both are eager PyTorch: they are the baselines issue 9 compares against, not ours.
"""

from __future__ import annotations

import contextlib
import time

import torch
from _e2e_common import BLOCK_SIZE, ROPE_THETA, prompt_ids, sync
from _e2e_engine import _try


def qwen3_config(b, layers: int):
    import transformers

    c = b.target.config
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
              intermediate_size=c.intermediate_size, num_hidden_layers=layers,
              num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
              head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
              max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
              attention_bias=False, attn_implementation="sdpa")
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    else:
        kw["rope_theta"] = ROPE_THETA
    return transformers.Qwen3Config(**kw)


def _adopt(model, state: dict, cfg, device):
    """Give a meta-device HF module our tensors (shared) and a fresh rotary table."""
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"state_dict names differ: missing {missing[:4]}, extra "
                           f"{unexpected[:4]}")
    for name, mod in list(model.named_modules()):
        if name.endswith("rotary_emb"):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], type(mod)(config=cfg).to(device))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:4]}")
    return model.eval()


def build_hf(b):
    from transformers import Qwen3ForCausalLM

    cfg = qwen3_config(b, b.target.config.num_layers)
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(cfg)
    return _adopt(hf, dict(b.target.state_dict()), cfg, b.device)


def build_dflash_ref(b):
    from dflash.model import DFlashDraftModel as RefDraft

    d = b.drafter.config
    cfg = qwen3_config(b, d.num_layers)
    cfg.block_size, cfg.num_target_layers = d.block_size, d.num_target_layers
    cfg.dflash_config = {"target_layer_ids": list(d.target_layer_ids),
                         "mask_token_id": d.mask_token_id}
    with torch.device("meta"):
        ref = RefDraft(cfg)
    state = {k: v for k, v in b.drafter.state_dict().items()
             if k not in ("embed.weight", "lm_head.weight")}
    return _adopt(ref, state, cfg, b.device)


def _timed(b, fn):
    sync(b.device)
    t0 = time.perf_counter()
    out = fn()
    sync(b.device)
    return time.perf_counter() - t0, out


def hf_prefill(b, hf, T: int) -> dict:
    ids = torch.tensor([prompt_ids(b.target.config.vocab_size, T)], device=b.device)
    with torch.inference_mode():
        hf(ids[:, : max(T // 8, 16)], use_cache=True, logits_to_keep=1)  # warm-up
        s, out = _timed(b, lambda: hf(ids, use_cache=True, logits_to_keep=1))
        first = int(out.logits[0, -1].argmax())
    del out
    ours = next((r for r in b.results["prefill"]["rows"]
                 if r.get("impl") == "ours" and r.get("tokens") == T and "s" in r), None)
    return dict(s=s, tok_per_s=T / s, first_token=first,
                first_token_matches_ours=None if ours is None else first == ours["first_token"])


def hf_generate(b, hf, ctx: int, n: int) -> dict:
    ids = torch.tensor([prompt_ids(b.target.config.vocab_size, ctx)], device=b.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
              pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=2, **kw)  # warm-up
        t1, _ = _timed(b, lambda: hf.generate(ids, max_new_tokens=1, **kw))
        tn, out = _timed(b, lambda: hf.generate(ids, max_new_tokens=n, **kw))
    got = out[0, ctx:].tolist()
    ms = (tn - t1) / max(len(got) - 1, 1) * 1e3
    ours = next((r for r in b.results["decode"]["rows"]
                 if r.get("impl") == "ours_ar" and r.get("ctx") == ctx and "head_tokens" in r),
                None)
    agree = None
    if ours is not None:
        agree = next((i for i, (x, y) in enumerate(zip(got, ours["head_tokens"], strict=False))
                      if x != y), min(len(got), len(ours["head_tokens"])))
    return dict(new_tokens=len(got), steps=len(got) - 1, ms_per_step=ms, tok_per_s=1e3 / ms,
                commit_len=1.0, prefill_s=t1, head_tokens=got[:16], tokens_agreeing_with_ours=agree)


@contextlib.contextmanager
def _cpu_clock(device):
    """dflash_generate's stats clock calls torch.cuda.synchronize(); on CPU use a plain clock."""
    import dflash.model as dm

    saved = dm._cuda_time
    if torch.device(device).type != "cuda":
        dm._cuda_time = time.perf_counter
    try:
        yield
    finally:
        dm._cuda_time = saved


def dflash_reference(b, ref, hf, ctx: int, n: int, warm: bool) -> dict:
    from dflash.model import dflash_generate

    ids = torch.tensor([prompt_ids(b.target.config.vocab_size, ctx)], device=b.device)
    with _cpu_clock(b.device):
        if warm:
            dflash_generate(ref, hf, ids[:, : min(ctx, 256)], 4, None)
        st = dflash_generate(ref, hf, ids, n, None, return_stats=True)
    decode_s = st.time_per_output_token * st.num_output_tokens
    steps = len(st.acceptance_lengths)
    return dict(new_tokens=int(st.num_output_tokens), steps=steps,
                ms_per_step=decode_s / steps * 1e3, tok_per_s=st.num_output_tokens / decode_s,
                commit_len=sum(st.acceptance_lengths) / steps, prefill_s=st.time_to_first_token,
                block_size=BLOCK_SIZE)


def run_peers(b) -> None:
    a = b.args
    pre, dec = b.results.get("prefill"), b.results.get("decode")
    try:
        hf = build_hf(b)
    except Exception as e:  # noqa: BLE001 — no transformers, or an API change
        for sec in (pre, dec):
            if sec is not None:
                sec["rows"].append(dict(impl="hf", error=f"not available: {type(e).__name__}: "
                                                         f"{str(e)[:200]}"))
        return
    b.log(f"peers: HF Qwen3ForCausalLM shares our tensors; {b.mem_note()}")
    if pre is not None and not a.no_hf:
        for T in a.hf_prefill_lens:
            if b.out_of_time(10):
                pre["rows"].append(dict(impl="hf_sdpa", tokens=T, skipped="time budget"))
                continue
            row = _try(b, pre, dict(impl="hf_sdpa", tokens=T), lambda T=T: hf_prefill(b, hf, T))
            b.log(f"HF SDPA prefill {T}: {row.get('s', row.get('error'))}")
    if dec is None:
        return
    if not a.no_hf:
        ctx = min(a.decode_ctxs)
        if b.out_of_time(10):
            dec["rows"].append(dict(ctx=ctx, impl="hf_generate", skipped="time budget"))
        else:
            row = _try(b, dec, dict(ctx=ctx, impl="hf_generate"),
                       lambda: hf_generate(b, hf, ctx, a.peer_new))
            b.log(f"HF generate {ctx}: {row.get('ms_per_step', row.get('error'))} ms/token")
    if a.no_dflash_ref:
        return
    try:
        ref = build_dflash_ref(b)
    except Exception as e:  # noqa: BLE001 — PyPI dflash is optional on the GPU host
        dec["rows"].append(dict(impl="dflash_generate",
                                error=f"not available: {type(e).__name__}: {str(e)[:200]}"))
        return
    for i, ctx in enumerate(a.decode_ctxs):
        if b.out_of_time(15):
            dec["rows"].append(dict(ctx=ctx, impl="dflash_generate", skipped="time budget"))
            continue
        row = _try(b, dec, dict(ctx=ctx, impl="dflash_generate"),
                   lambda ctx=ctx, i=i: dflash_reference(b, ref, hf, ctx, a.peer_new, i == 0))
        b.log(f"dflash_generate {ctx}: {row.get('ms_per_step', row.get('error'))} ms/step")
