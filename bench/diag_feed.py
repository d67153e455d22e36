"""Host cost of sending a prefill chunk's context features to the drafter (the services' feed path).

ARCHITECTURE.md leaves "raw taps vs the drafter's fused fc projection" on the wire as a measured
choice: context transfer must stay a small fraction of prefill time at 128k. This measures the
verifier side of one chunk through the real code — `RemoteDrafter._absorb` (the rows kept for
resends, copied to the host), `_State.rows_since`, `convert.add_draft_entry` (the engine
thread's share), the message's serialisation (gRPC's, on the event loop) — and the drafter side's
parse and `tensor_from_pb`, for a chunk of `--rows` rows at each width: the demo pair's raw taps
(2 × 256), the Qwen3-8B shape's raw taps (5 × 4096) and its fc-projected rows (4096). Beside
`to_pb`, `to_pb_copies` times the message built the way it was before 2026-12-02 (a Tensor
message copied into the entry, the entry into the batch). Medians of `--reps` runs; the seconds
per 128k context at that rate (every stage but `to_pb_copies`) and the bytes.

    python bench/diag_feed.py [--rows 8192] [--reps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WIDTHS = {"demo pair, raw taps (2 × 256)": 512, "Qwen3-8B shape, raw taps (5 × 4096)": 20480,
          "Qwen3-8B shape, fc-projected (4096)": 4096}


def one_chunk(rows: int, width: int, device: str) -> dict[str, float]:
    """Seconds per stage for one chunk of `rows` context rows of `width` bf16 values."""
    from services.common.convert import tensor_from_pb, tensor_to_pb
    from services.verifier import convert
    from services.verifier.drafter_client import RemoteDrafter, _State
    from specserve.drafters.base import DraftRequest
    from specserve.v1 import drafter_pb2

    feats = torch.randn(rows, width, device=device).to(torch.bfloat16)  # [rows, taps · hidden]
    client = RemoteDrafter.__new__(RemoteDrafter)  # only the host-side helpers, no stream
    client.needs_context = True
    st, req = _State("dflash"), DraftRequest("r", 1, rows, 16, 0, feats)
    t = [time.perf_counter()]
    client._absorb(req, st)  # the rows kept on the host for resends
    t.append(time.perf_counter())
    context = st.rows_since(0)
    t.append(time.perf_counter())
    batch = convert.draft_batch(1)
    convert.add_draft_entry(batch, req, "dflash", context, [])
    t.append(time.perf_counter())
    wire = batch.SerializeToString()
    t.append(time.perf_counter())
    got = tensor_from_pb(drafter_pb2.DraftBatch.FromString(wire).entries[0].context)
    t.append(time.perf_counter())
    assert got.shape == (rows, width) and torch.equal(got, feats.cpu())
    entry = drafter_pb2.DraftEntry(request_id="r")  # the path before 2026-12-02: submessage
    entry.context.CopyFrom(tensor_to_pb(context))  # copies (CopyFrom, then the batch's own)
    drafter_pb2.DraftBatch(step_id=1, entries=[entry])
    t.append(time.perf_counter())
    names = ("absorb", "rows_since", "to_pb", "serialize", "parse", "to_pb_copies")
    return dict(zip(names, (b - a for a, b in zip(t, t[1:], strict=False)), strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192, help="rows per chunk (the prefill chunk)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rows < 1 or args.reps < 1:
        ap.error("--rows and --reps must be >= 1")
    print(f"# {args.rows} rows per chunk, features on {args.device}; ms, median of {args.reps}")
    print("| width | MB / chunk | absorb | rows_since | to_pb | serialize | parse | verifier "
          "thread | before: with copies | s per 128k | GB per 128k |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for name, width in WIDTHS.items():
        runs = [one_chunk(args.rows, width, args.device) for _ in range(args.reps)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        engine = med["absorb"] + med["rows_since"] + med["to_pb"]  # the engine thread's share
        before = med["absorb"] + med["rows_since"] + med.pop("to_pb_copies")
        per_128k = 131072 / args.rows
        row = dict(width_name=name, width=width, rows=args.rows, mb=args.rows * width * 2 / 1e6,
                   ms={k: 1e3 * v for k, v in med.items()}, engine_thread_ms=1e3 * engine,
                   engine_thread_before_ms=1e3 * before,
                   s_per_128k=per_128k * sum(med.values()),
                   gb_per_128k=131072 * width * 2 / 1e9)
        out.append(row)
        ms = row["ms"]
        print(f"| {name} | {row['mb']:.0f} | {ms['absorb']:.1f} | {ms['rows_since']:.1f} | "
              f"{ms['to_pb']:.1f} | {ms['serialize']:.1f} | {ms['parse']:.1f} | "
              f"{row['engine_thread_ms']:.1f} | {row['engine_thread_before_ms']:.1f} | "
              f"{row['s_per_128k']:.2f} | "
              f"{row['gb_per_128k']:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=args.device, rows=out), indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
