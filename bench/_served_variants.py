"""bench/bench_served.py: a verifier variant's services, and two variants interleaved.

`start_services` starts drafter + verifier for one `--variants` entry (transport, extra verifier
flags, `SPECSERVE_*` environment); `start_gateway` puts a gRPC-only gateway on them.
`paired_variants` (`--paired-variants N`) keeps the first and the last variant's services alive
together and runs every case N rounds, each round once through each, the order alternating
(ABBA …), after one warm round each: a round's ratio compares two runs a second apart, so a
drift of the machine does not land in it (the sequential rows time one variant minutes after
the other). Reported per case: each round's tok/s and steady p50 both ways, the median ratio of
tok/s (last over first) and its range. Benchmark-only code.
"""

from __future__ import annotations

from _served_paired import abba, pooled_p50, spread
from _served_run import Services, served, summary


def variant_parts(variant: str) -> tuple[list[str], dict]:
    """A variant's extra verifier flags (after the transport) and its services' environment
    (`SPECSERVE_*=value` tokens)."""
    transport, _, extra = variant.partition(":")
    env = dict(t.split("=", 1) for t in extra.split() if t.startswith("SPECSERVE_"))
    flags = [t for t in extra.split() if not t.startswith("SPECSERVE_")]
    return ["--drafter-transport", transport, *flags], env


def start_services(args, svc: Services, variant: str) -> None:
    flags, env = variant_parts(variant)
    svc.start("drafter", ["--model", args.model, "--draft-model", args.draft_model, "--device",
                          args.device, "--drafter-pages", str(args.drafter_pages)], env)
    svc.wait()
    svc.start("verifier", ["--model", args.model, "--draft-model", args.draft_model,
                           "--drafter", svc.addr("drafter"), "--device", args.device,
                           "--kv-memory-gb", str(args.kv_memory_gb), "--max-num-batched-tokens",
                           str(args.chunk), "--default-budget", str(args.budget), *flags], env)


def start_gateway(args, svc: Services) -> None:
    """A gateway on the running verifier, gRPC only (nothing on :8000); waits until it serves."""
    svc.start("gateway", ["--model", args.model, "--verifier", svc.addr("verifier"),
                          "--http-port", "off"])
    svc.wait()


def paired_variants(args, last: Services, variants: list[str], cases, log=print) -> list[dict]:
    """`args.paired_variants` interleaved rounds of every case through the first variant's
    services (started here, stopped after) and the last one's (`last`, its gateway up)."""
    (last.tmp / "first").mkdir(exist_ok=True)
    first = Services(last.tmp / "first")
    try:
        start_services(args, first, variants[0])
        first.wait()
        start_gateway(args, first)
        sides = {variants[0]: first.addr("gateway"), variants[-1]: last.addr("gateway")}
        out = []
        for case, _ctx, prompts, late in cases:
            got: dict[str, list] = {v: [] for v in sides}
            for i in range(args.paired_variants + 1):  # round 0 warms both sides
                for v in abba(tuple(sides), i):
                    t = served(sides[v], prompts, args.new_tokens, args.budget, late)
                    if i:
                        got[v].append(t)
            out.append(_row(case, variants[0], variants[-1], got))
            log(f"paired variants {case}: tok/s ratio median {out[-1]['ratio_median']:.3f} "
                f"[{out[-1]['ratio_min']:.3f}, {out[-1]['ratio_max']:.3f}]")
        return out
    finally:
        first.close()


def _row(case: str, a: str, b: str, got: dict) -> dict:
    sums = {v: [summary(t) for t in runs] for v, runs in got.items()}
    tok_s = {v: [s["tok_s"] for s in ss] for v, ss in sums.items()}
    p50 = {v: [s["steady_p50_ms"] for s in ss] for v, ss in sums.items()}
    ratios = [y / x for x, y in zip(tok_s[a], tok_s[b], strict=True)]
    pooled = pooled_p50(got)
    return dict(case=case, first=a, last=b, rounds=len(ratios),
                first_tok_s=[round(x, 2) for x in tok_s[a]],
                last_tok_s=[round(x, 2) for x in tok_s[b]],
                first_p50_ms=[round(x, 3) for x in p50[a]],
                last_p50_ms=[round(x, 3) for x in p50[b]], **spread(ratios),
                first_pooled_p50_ms=pooled[a], last_pooled_p50_ms=pooled[b])
