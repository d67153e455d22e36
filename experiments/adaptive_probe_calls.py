"""How many drafter calls adaptive speculation's probes make, and how many requests each
carries, where speculation cannot pay: the random pair (`--tiny` on the CPU), novel text,
batch 8, 96 new tokens, three generations after two warm.

    PYTHONPATH=.:bench python experiments/adaptive_probe_calls.py [--device cuda --dtype bfloat16]

Probes that each request makes on its own schedule cost one drafter call apiece; probes made
together cost one call for the batch (BENCHMARKS.md, "Adaptive on an H100").
"""

from __future__ import annotations

import argparse
import collections

import bench_adaptive  # bench/: it builds the engines and the prompts

from specserve.drafters.dflash import DFlashDrafter
from specserve.types import SamplingParams

CALLS: list[int] = []


def _counted(inner):
    def draft(self, requests):
        CALLS.append(sum(1 for r in requests if r.budget))  # 0: a prompt's context feed
        return inner(self, requests)
    return draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pair", default="/tmp/pairtiny")
    args = ap.parse_args()
    bargs = bench_adaptive.parse(["--batch", "8", "--contexts", "1024", "--device", args.device,
                                  "--dtype", args.dtype])
    bargs.model, bargs.draft_model = bench_adaptive.random_pair(
        args.pair, args.device == "cpu", args.device)
    DFlashDrafter.draft = _counted(DFlashDrafter.draft)
    engines, tok = bench_adaptive.build(bargs)
    eng, params = engines["adaptive"], SamplingParams(max_tokens=96, ignore_eos=True)
    prompts = bench_adaptive.prompts(tok, "novel", 8, 1024)
    for _ in range(2):
        eng.generate(prompts, params, budget=63)
    CALLS.clear()
    shapes: collections.Counter = collections.Counter()
    eng.on_step = lambda _rid, s: shapes.update([s.shape])
    for _ in range(3):
        eng.generate(prompts, params, budget=63)
    drafted = collections.Counter(n for n in CALLS if n)
    print(f"drafter calls that drafted: {sum(drafted.values())} (requests a call: "
          f"{dict(sorted(drafted.items()))}); verified shapes {dict(shapes)}")


if __name__ == "__main__":
    main()
