"""Where a served step's time goes, from the services' own traces (`$SPECSERVE_TRACE_DIR`).

Reads the JSON-lines spans the three services write (`<service>.jsonl`, one span per line) and
splits every request's steps the way the verifier's `draft` span and the drafter's
`draft.forward` / `ddtree.build` spans allow:
- to the drafter: from the verifier's `draft` start to the drafter's `draft.forward` start (the
  verifier's host work, the stream, the drafter's decode and thread hop);
- the drafter's forward and tree build;
- back: from the tree build's end to the verifier's `draft` end (encode, stream, wake-up);
- verify and commit (the verifier's spans).
With the events the verifier puts on its `draft` span (`drafter_client.DRAFT_EVENTS`) the round
trip splits further (`DETAIL`). Per request: the first step alone (it waits for the prompt's
context feed) and the medians of the rest; then medians over all requests. The clocks of the
processes are one host's.

    python bench/trace_breakdown.py DIR [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime
from pathlib import Path

PARTS = ("step", "to_drafter", "forward", "tree_build", "back", "verify", "commit")
# with the verifier's draft-span events (RemoteDrafter.DRAFT_EVENTS), the round trip in detail:
# step prep → call, build the batch, hop to the event loop + write, wire + the drafter's read /
# decode / thread hop, …, the drafter's encode + wire + read, wake the engine thread, trees,
# and the verify layout before the draft span ends
DETAIL = ("prep", "build", "loop_write", "wire_in", "wire_out", "wake", "trees", "layout")


def _ms(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1e3


def load(trace_dir: Path) -> dict[str, list[dict]]:
    """trace id → its spans, by start time."""
    traces: dict[str, list[dict]] = {}
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                span = json.loads(line)
                traces.setdefault(span["context"]["trace_id"], []).append(span)
    for spans in traces.values():
        spans.sort(key=lambda s: _ms(s["start_time"]))
    return traces


def steps(spans: list[dict]) -> list[dict[str, float]]:
    """One dict of ms per part for each step of a request that drafted with DFlash."""
    def named(name):
        return [s for s in spans if s["name"] == name]

    out = []
    for step, draft, fwd, build, verify, commit in zip(
            named("step"), named("draft"), named("draft.forward"), named("ddtree.build"),
            named("verify"), named("commit"), strict=False):
        out.append(dict(
            step=_ms(step["end_time"]) - _ms(step["start_time"]),
            to_drafter=_ms(fwd["start_time"]) - _ms(draft["start_time"]),
            forward=_ms(fwd["end_time"]) - _ms(fwd["start_time"]),
            tree_build=_ms(build["end_time"]) - _ms(build["start_time"]),
            back=_ms(draft["end_time"]) - _ms(build["end_time"]),
            verify=_ms(verify["end_time"]) - _ms(verify["start_time"]),
            commit=_ms(commit["end_time"]) - _ms(commit["start_time"])))
        ev = {e["name"]: _ms(e["timestamp"]) for e in draft.get("events", ())}
        if len(ev) == 6:
            marks = [_ms(draft["start_time"]), ev["drafter.call"], ev["batch.built"],
                     ev["batch.written"], _ms(fwd["start_time"]), _ms(build["end_time"]),
                     ev["reply.received"], ev["reply.taken"], ev["trees.ready"],
                     _ms(draft["end_time"])]
            gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
            del gaps[4]  # forward + tree build: their own columns
            out[-1].update(zip(DETAIL, gaps, strict=True))
    return out


def breakdown(traces: dict[str, list[dict]]) -> dict:
    requests = []
    for trace_id, spans in traces.items():
        got = steps(spans)
        if len(got) < 2:
            continue
        parts = [p for p in PARTS + DETAIL if all(p in s for s in got)]
        rest = {p: statistics.median(s[p] for s in got[1:]) for p in parts}
        requests.append(dict(trace_id=trace_id, steps=len(got), first=got[0], rest=rest))
    parts = [p for p in PARTS + DETAIL if all(p in r["rest"] for r in requests)]
    overall = {p: statistics.median(r["rest"][p] for r in requests) for p in parts}
    return dict(requests=requests, steady_median_ms=overall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not args.trace_dir.is_dir():
        ap.error(f"{args.trace_dir} is not a directory of <service>.jsonl traces")
    result = breakdown(load(args.trace_dir))
    if not result["requests"]:
        ap.error(f"no request with ≥ 2 DFlash steps in {args.trace_dir}")
    parts = list(result["steady_median_ms"])
    print("| request | steps | which | " + " | ".join(parts) + " |")
    print("|---|---|---|" + "---|" * len(parts))
    for r in result["requests"]:
        for which in ("first", "rest"):
            cells = " | ".join(f"{r[which].get(p, float('nan')):.2f}" for p in parts)
            label = "first step" if which == "first" else "median of the rest"
            print(f"| {r['trace_id'][2:10]} | {r['steps']} | {label} | {cells} |")
    cells = " | ".join(f"{result['steady_median_ms'][p]:.2f}" for p in parts)
    print(f"| all | | steady median | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
