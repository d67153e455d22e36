"""Markdown tables and the issue-9 acceptance checks of bench/bench_e2e.py (from the JSON rows)."""

from __future__ import annotations

from _e2e_verify import table as verify_table


def _rows(b, name: str) -> list[dict]:
    return b.results.get(name, {}).get("rows", [])


def _find(rows, **kw):
    return next((r for r in rows if all(r.get(k) == v for k, v in kw.items())), None)


def acceptance(b) -> list[dict]:
    """Issue 9's acceptance criteria, judged on whatever this run measured."""
    a, out = b.args, []

    def check(what, value, target, ok):
        out.append(dict(check=what, value=value, target=target, ok=bool(ok)))

    ver = _rows(b, "verify")
    for ctx in a.ctxs:
        r = _find(ver, ctx=ctx, batch=1, budget=64)
        if r and "ms" in r:
            check(f"verify B=64 b=1 at {ctx}: × floor", round(r["x_floor"], 3), "≤ 1.3",
                  r["x_floor"] <= 1.3)
    g = next((g for g in b.results.get("verify", {}).get("growth", [])
              if g["batch"] == 1 and g["budget"] == 64), None)
    if g:
        check(f"verify B=64 growth {g['from_ctx']}→{g['to_ctx']}", round(g["growth"], 3),
              "≤ 2.5", g["growth"] <= 2.5)
    pool = b.results.get("verify", {}).get("kv_pool")
    if pool:
        check(f"batch fitting {pool['max_ctx']} tokens in the KV budget",
              pool["max_batch_at_max_ctx"], "≥ 4", pool["max_batch_at_max_ctx"] >= 4)
    pre = _rows(b, "prefill")
    for r in pre:
        if r.get("impl") == "ours" and "s" in r:
            check(f"prefill {r['tokens']}: × FLOP floor", round(r["x_floor"], 3), "≤ 1.3",
                  r["x_floor"] <= 1.3)
            hf = _find(pre, impl="hf_sdpa", tokens=r["tokens"])
            if hf and "s" in hf:
                check(f"prefill {r['tokens']}: HF SDPA s / ours s", round(hf["s"] / r["s"], 3),
                      "> 1", hf["s"] > r["s"])
    dec = _rows(b, "decode")
    for ctx in a.decode_ctxs:
        ar, sp = _find(dec, ctx=ctx, impl="ours_ar"), _find(dec, ctx=ctx, impl="ours_spec_replay")
        if ar and sp and "tok_per_s" in ar and "tok_per_s" in sp:
            want = 0.8 * a.commit_len * ar["tok_per_s"]
            check(f"spec (replay, commit {sp['commit_len']:.2f}) at {ctx}: tok/s vs 0.8×"
                  f"{a.commit_len:g}×AR", round(sp["tok_per_s"] / want, 3), "≥ 1",
                  sp["tok_per_s"] >= want)
        ours, ref = _find(dec, ctx=ctx, impl="ours_dflash"), _find(dec, ctx=ctx,
                                                                   impl="dflash_generate")
        if ours and ref and "ms_per_step" in ours and "ms_per_step" in ref:
            x = ref["ms_per_step"] / ours["ms_per_step"]
            check(f"per step at {ctx}: dflash_generate / ours (DFlash)", round(x, 2), "≥ 10",
                  x >= 10)
    return out


def _f(x, fmt=".2f") -> str:
    return "" if x is None else format(x, fmt) if isinstance(x, float) else str(x)


def prefill_table(rows) -> str:
    lines = ["| tokens | impl | s | tok/s | FLOP floor s (issue 9) | × floor | strict floor s "
             "| × strict | note |", "|" + "---|" * 9]
    for r in rows:
        note = r.get("skipped") or r.get("error") or ""
        if r.get("first_token_matches_ours") is not None:
            note += f"first token = ours: {r['first_token_matches_ours']}"
        if "runs_s" in r:
            note += "runs " + ", ".join(f"{x:.2f}" for x in r["runs_s"])
        lines.append(f"| {r.get('tokens', '')} | {r['impl']} | {_f(r.get('s'))} | "
                     f"{_f(r.get('tok_per_s'), '.0f')} | {_f(r.get('floor_s'))} | "
                     f"{_f(r.get('x_floor'))} | {_f(r.get('floor_strict_s'))} | "
                     f"{_f(r.get('x_floor_strict'))} | {note} |")
    return "\n".join(lines)


def decode_table(rows) -> str:
    lines = ["| ctx | impl | new tokens | steps | commit len | ms/step | p90 / max ms | tok/s "
             "| × our AR tok/s | note |", "|" + "---|" * 10]
    for r in rows:
        ar = _find(rows, ctx=r.get("ctx"), impl="ours_ar")
        rel = (r["tok_per_s"] / ar["tok_per_s"] if ar and "tok_per_s" in r and "tok_per_s" in ar
               else None)
        note = r.get("skipped") or r.get("error") or ""
        if r.get("impl") == "ours_spec_replay" and "p" in r:
            off = r["diverged_at"]
            note += (f"BENCHMARK-ONLY replay: target {r['target_commit_len']:g}, p={r['p']:.3f}, "
                     f"chain {r['budget']}, {r['passes']} pass(es), " + (
                         "on the reference" if off is None else f"left the reference at {off}"))
        if r.get("impl") == "dflash_generate" and "ms_per_step" in r:
            ours = _find(rows, ctx=r["ctx"], impl="ours_dflash")
            if ours and "ms_per_step" in ours:
                note += f"ours (DFlash) ×{r['ms_per_step'] / ours['ms_per_step']:.1f} faster/step"
        if r.get("tokens_agreeing_with_ours") is not None:
            note += f"first {r['tokens_agreeing_with_ours']} tokens = ours"
        if r.get("fallbacks"):
            note += f" {r['fallbacks']} fallback steps"
        lines.append(f"| {r.get('ctx', '')} | {r['impl']} | {_f(r.get('new_tokens'))} | "
                     f"{_f(r.get('steps'))} | {_f(r.get('commit_len'))} | "
                     f"{_f(r.get('ms_per_step'))} | {_f(r.get('ms_per_step_p90'))} / "
                     f"{_f(r.get('ms_per_step_max'))} | {_f(r.get('tok_per_s'), '.1f')} | "
                     f"{_f(rel)} | {note} |")
    return "\n".join(lines)


def report(b) -> str:
    res, parts = b.results, []
    meta, ceil = res.get("meta", {}), res.get("ceilings", {})
    parts.append(f"## bench_e2e — {meta.get('device')} — {meta.get('date')} — status "
                 f"{res.get('status')}")
    if ceil:
        parts.append(f"Ceilings this run: copy {ceil['copy_GBps']:.0f} GB/s, matmul "
                     f"{ceil['matmul_TFLOPs']:.1f} TFLOP/s; weights {meta.get('weight_GB', 0):.2f}"
                     f" GB, KV {meta.get('kv_bytes_per_token')} B/token")
    for name, render in (("verify", verify_table), ("prefill", lambda s: prefill_table(
            s.get("rows", []))), ("decode", lambda s: decode_table(s.get("rows", [])))):
        sec = res.get(name)
        if sec is None:
            continue
        head = f"### {name} ({sec.get('status', 'running')}, {sec.get('seconds', 0):.0f} s)"
        if sec.get("error"):
            head += f" — error: {sec['error']}"
        parts += [head, render(sec)]
    if res.get("peers", {}).get("error"):
        parts.append(f"peers error: {res['peers']['error']}")
    checks = res.get("acceptance") or []
    if checks:
        parts.append("### issue-9 acceptance (this run)\n\n" + "\n".join(
            f"- [{'x' if c['ok'] else ' '}] {c['check']}: {c['value']} (target {c['target']})"
            for c in checks))
    return "\n\n".join(parts)
