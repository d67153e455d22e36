"""bench/bench_served.py `--paired N`: the steady step in process and served, interleaved.

The rows of bench_served run every case in process first and through the services after, so
a drift of the machine between the two (clocks, other tenants of the host) lands in the ratio.
Here the in-process engine and the services are alive together and each batch-1 case runs N
rounds, each round one request in process and one served, the order alternating (ABBA …):
a round's ratio compares two requests a second apart. Reported per case: every round's
steady p50 both ways and its ratio, the median ratio and its range, the ratio of the
pooled steps' medians, and how far the host's own speed moved within each round (a pure-Python
probe before each request and after the round: a round it moved in compares two hosts).
Benchmark-only code.
"""

from __future__ import annotations

import statistics

from _e2e_common import host_probe_us
from _served_run import Services, in_process, served, steady_steps, summary


def paired(engine, svc: Services, cases, new_tokens: int, budget: int, rounds: int,
           log=print) -> list[dict]:
    """N interleaved rounds of each batch-1 case (`cases` as bench_served.workload gives
    them); the gateway must be up on the running verifier."""
    out = []
    for case, ctx, prompts, late in cases:
        if len(prompts) != 1 or late:
            continue
        got, hosts = {"in-process": [], "served": []}, []
        for i in range(rounds):
            probes = []
            for path in abba(("in-process", "served"), i):
                probes.append(host_probe_us())
                got[path].append(_one(path, engine, svc, prompts, new_tokens, budget))
            probes.append(host_probe_us())  # and after the round
            hosts.append(round(max(probes) / min(probes), 3))
        row = _row(case, ctx, got, rounds) | {"host_spreads": hosts}
        log(f"paired {case}: ratio median {row['ratio_median']:.3f} "
            f"[{row['ratio_min']:.3f}, {row['ratio_max']:.3f}] pooled {row['ratio_pooled']:.3f}"
            f", host spread ≤ {max(hosts):.2f}")
        out.append(row)
    return out


def _one(path: str, engine, svc: Services, prompts, new_tokens: int, budget: int):
    if path == "in-process":
        return in_process(engine, prompts, new_tokens, budget)
    return served(svc.addr("gateway"), prompts, new_tokens, budget)


def _row(case: str, ctx: int, got: dict, rounds: int) -> dict:
    p50 = {path: [summary(t)["steady_p50_ms"] for t in runs] for path, runs in got.items()}
    ratios = [s / i for s, i in zip(p50["served"], p50["in-process"], strict=True)]
    pooled = pooled_p50(got)
    return dict(case=case, ctx=ctx, rounds=rounds,
                in_process_p50_ms=[round(x, 3) for x in p50["in-process"]],
                served_p50_ms=[round(x, 3) for x in p50["served"]], **spread(ratios),
                ratio_pooled=pooled["served"] / pooled["in-process"],
                in_process_pooled_p50_ms=pooled["in-process"],
                served_pooled_p50_ms=pooled["served"])


def abba(pair: tuple, i: int) -> tuple:
    """Round `i`'s order of the two sides: A B, B A, B A, A B, … (drift cancels in pairs)."""
    return pair if i % 4 in (0, 3) else pair[::-1]


def spread(ratios: list[float]) -> dict:
    """Each round's ratio (a ratio of 0.02 keeps 4 digits), their median and range."""
    return dict(ratios=[round(r, 6) for r in ratios], ratio_median=statistics.median(ratios),
                ratio_min=min(ratios), ratio_max=max(ratios))


def pooled_p50(got: dict) -> dict:
    """By side: the median of every steady step of its rounds' requests, pooled."""
    return {side: statistics.median(ms for t in runs for ms in steady_steps(t))
            for side, runs in got.items()}
