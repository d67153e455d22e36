"""bench/bench_served.py's printed tables: the rows (in process and each served variant), the
interleaved pairs (`--paired`) and two variants interleaved (`--paired-variants`).
Benchmark-only code."""

from __future__ import annotations

import statistics


def table(rows: list[dict]) -> str:
    head = (f"{'case':<10} {'path':<24} {'TTFT ms':>9} {'x':>5} {'1st step':>9} "
            f"{'steady p50':>10} {'p90':>7} {'x':>5} {'tok/s':>7} {'x':>5}  floor TTFT/step")
    lines = [head, "-" * len(head)]
    for r in rows:
        s, base = r["summary"], r["ratio"]
        lines.append(f"{r['case']:<10} {r['path']:<24} {s['ttft_ms']:9.1f} {base['ttft']:5.2f} "
                     f"{s['first_step_ms']:9.2f} {s['steady_p50_ms']:10.2f} "
                     f"{s['steady_p90_ms']:7.2f} {base['steady']:5.2f} {s['tok_s']:7.1f} "
                     f"{base['tok_s']:5.2f}  {r['floor']['prefill_ms']:.1f} / "
                     f"{r['floor']['step_ms']:.2f}")
    lines += ["", "steady tail, ms (mean / p99 / max) and how far apart the requests' first "
              "and last tokens came"]
    for r in rows:
        s = r["summary"]
        lines.append(f"{r['case']:<10} {r['path'][:40]:<40} {s['steady_mean_ms']:.2f} / "
                     f"{s['steady_p99_ms']:.2f} / {s['steady_max_ms']:.2f}  first "
                     f"{s['first_token_spread_ms']:.1f}  last {s['last_token_spread_ms']:.1f}")
    late = [r for r in rows if "interference" in r["summary"]]
    if late:
        lines += ["", "a prompt sent while 7 requests decode: its TTFT ms; their steps meanwhile "
                  "(how many, p50 / p90 / max ms)"]
    for r in late:
        i = r["summary"]["interference"]
        lines.append(f"{r['case']:<16} {r['path'][:34]:<34} {i['late_ttft_ms']:9.1f}  "
                     f"{i['steps_meanwhile']:4d}  {i['step_meanwhile_p50_ms']:.2f} / "
                     f"{i['step_meanwhile_p90_ms']:.2f} / {i['step_meanwhile_max_ms']:.2f}")
    lines += ["", "steady steps by what they verified: count  p50 / p90 ms"]
    for r in rows:
        by = r["summary"].get("steady_by_shape") or {}
        lines.append(f"{r['case']:<10} {r['path'][:40]:<40} " + "  ".join(
            f"{k} {v['n']} {v['p50_ms']:.2f} / {v['p90_ms']:.2f}" for k, v in by.items()))
    lines += ["", "ms per step: in process the drafter's own forward + tree; served the "
              "verifier's profile (Stats.profile)"]
    for r in rows:
        parts = r.get("profile_ms") or {"drafter": r.get("drafter_ms", float("nan"))}
        lines.append(f"{r['case']:<10} {r['path'][:40]:<40} " + " ".join(
            f"{k}={v:.2f}" for k, v in sorted(parts.items())))
    return "\n".join(lines)


def paired_table(rows: list[dict]) -> str:
    head = (f"{'case':<8} {'rounds':>6} {'in-process p50 ms':>18} {'served p50 ms':>14} "
            f"{'ratio median [min, max]':>24} {'pooled':>7} {'host moved':>10}")
    lines = ["steady step, in process and served interleaved (--paired)", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:<8} {r['rounds']:>6} {r['in_process_pooled_p50_ms']:18.2f} "
                     f"{r['served_pooled_p50_ms']:14.2f} {r['ratio_median']:8.3f} "
                     f"[{r['ratio_min']:.3f}, {r['ratio_max']:.3f}] {r['ratio_pooled']:7.3f} "
                     f"{max(r.get('host_spreads') or [1]):9.2f}x")
    return "\n".join(lines)


def variants_table(rows: list[dict]) -> str:
    head = (f"{'case':<8} {'rounds':>6} {'first tok/s':>12} {'last tok/s':>11} "
            f"{'tok/s ratio median [min, max]':>30} {'steady p50 ms':>14}")
    lines = [f"two variants interleaved (--paired-variants): last ({rows[0]['last']}) over "
             f"first ({rows[0]['first']})", head, "-" * len(head)]
    for r in rows:
        a, b = statistics.median(r["first_tok_s"]), statistics.median(r["last_tok_s"])
        lines.append(f"{r['case']:<8} {r['rounds']:>6} {a:12.1f} {b:11.1f} "
                     f"{r['ratio_median']:14.3f} [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}] "
                     f"{r['first_pooled_p50_ms']:6.2f} / {r['last_pooled_p50_ms']:.2f}")
    return "\n".join(lines)
