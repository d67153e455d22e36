"""Where the decoders' long steps go while a long prompt prefills through the services.

Reads the services' JSON-lines traces (`$SPECSERVE_TRACE_DIR`, `--trace-steps 1`) of a
`bench/bench_served.py --interference N` run: for the decoding request with the most steps, each
step's parts in order (bench/trace_breakdown.steps: to the drafter, the drafter's forward and
tree build, back, verify, commit) and the time since the previous step ended (the gap: what
the step span does not cover), starting where the long prompt's first `prefill` span starts;
then the steps over 1.2 × the median, with the part that grew most.

    python experiments/diag_interference_spikes.py DIR [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from trace_breakdown import _ms, load, steps  # noqa: E402


def series(traces: dict) -> list[dict]:
    """The steps (ms parts, start after the long prompt's prefill began, gap) of the decoder
    with the most steps during the last prompt's prefill (its `prefill` span)."""
    prefill = max((s for sp in traces.values() for s in sp if s["name"] == "prefill"),
                  key=lambda s: _ms(s["start_time"]))
    t0, t1 = _ms(prefill["start_time"]), _ms(prefill["end_time"])

    def during(sp):
        return sum(s["name"] == "step" and _ms(s["end_time"]) > t0 and _ms(s["start_time"]) < t1
                   for s in sp)

    busiest = max(traces.values(), key=during)
    marks = [(_ms(s["start_time"]), _ms(s["end_time"])) for s in busiest if s["name"] == "step"]
    out = []
    for i, parts in enumerate(steps(busiest)):
        out.append(dict(parts, start=marks[i][0] - t0,
                        gap=marks[i][0] - marks[i - 1][1] if i else 0.0))
    return [s for s in out if s["start"] < t1 - t0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    got = series(load(args.trace_dir))
    keys = ["start", "step", "gap", "to_drafter", "forward", "tree_build", "back", "verify",
            "commit"]
    print(" ".join(f"{k:>10}" for k in keys))
    for s in got:
        print(" ".join(f"{s.get(k, float('nan')):10.1f}" for k in keys))
    during = [s for s in got if s["start"] >= 0 and s["step"] > 30]
    if during:
        med = {k: statistics.median(s[k] for s in during) for k in keys[1:]}
        print("median during the prefill:", {k: round(v, 1) for k, v in med.items()})
        for s in (s for s in during if s["step"] > 1.2 * med["step"]):
            grew = max(keys[2:], key=lambda k: s[k] - med[k])
            print(f"long step at {s['start']:.0f} ms: {s['step']:.0f} ms, {grew} "
                  f"+{s[grew] - med[grew]:.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(steps=got), indent=1))


if __name__ == "__main__":
    main()
