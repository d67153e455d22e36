"""The `specserve` console script.

Subcommands are added as their capabilities land; each has `--help`. Today: `generate` runs the
in-process engine on an HF checkpoint directory (the gRPC `generate` client replaces it once the
services exist).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with the in-process engine")
    p.add_argument("--model", required=True, help="HF checkpoint directory (config.json, "
                   "model.safetensors, tokenizer.json)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine
    from specserve.types import SamplingParams

    engine = Engine(EngineConfig(args.model, dtype=args.dtype, device=args.device))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    engine.add_request("cli", args.prompt, params)
    t0, text, ids, reason = time.perf_counter(), [], [], None
    while engine.has_unfinished:
        for out in engine.step():
            ids += out.new_token_ids
            text.append(out.text_delta)
            reason = out.finish_reason or reason
            if not args.json:
                print(out.text_delta, end="", flush=True)
    wall = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"text": "".join(text), "token_ids": ids, "finish_reason": reason.value,
                          "wall_s": round(wall, 4)}))
    else:
        print(f"\n[{len(ids)} tokens in {wall:.2f} s, finish: {reason.value}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    args = parser.parse_args(argv)
    from specserve.errors import SpecServeError

    try:
        return args.func(args)
    except SpecServeError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
