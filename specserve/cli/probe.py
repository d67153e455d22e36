"""`specserve probe`: the commit probe client (predictable vs novel text by context).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from specserve.cli.client import add_gateway_flags, gateway_channel


def add(sub) -> None:
    p = sub.add_parser("probe", help="the commit probe: predictable vs novel text by context",
                       description="Send predictable text ('The cat sat on the mat.' repeated) "
                                   "and novel text at several context lengths through the "
                                   "gateway; print commit_len, depth, drafts, timings and a "
                                   "verdict per row (exit 3 if speculation changed tokens).")
    add_gateway_flags(p)
    p.add_argument("--model", default=os.environ.get("SPECSERVE_MODEL"),
                   help="target checkpoint dir (its tokenizer.json sizes the prompts) "
                        "[env SPECSERVE_MODEL; default: the demo target in checkpoints/]")
    p.add_argument("--contexts", default="1k,16k,64k,128k", help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--drafter", choices=["dflash", "ngram", "none"], default=None)
    p.add_argument("--budget", type=int, default=15, help="DDTree budget (draft nodes)")
    p.add_argument("--texts", default="predictable,novel", help="which texts to probe")
    p.add_argument("--text-file", help="novel text to use instead of the built-in one")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="deadline per request")
    p.add_argument("--lossless-check", choices=["on", "off"], default="on",
                   help="per row, the same request without speculation must give the same "
                        "first tokens (one more short request each)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (commit_len, step time)")
    p.set_defaults(func=_probe)


def _probe(args) -> int:
    import grpc

    from specserve import probe, probe_client, probe_plot
    from specserve.engine.tokenizer import Tokenizer
    from specserve.v1 import gateway_pb2_grpc

    if not args.model:
        from specserve.demo import default_pair

        args.model = default_pair()[0]
    if not args.model:
        raise SystemExit("specserve probe: --model (or SPECSERVE_MODEL) is required "
                         "(no demo pair under checkpoints/)")
    contexts, texts = probe.parse_contexts(args.contexts), args.texts.split(",")
    tok = Tokenizer.from_dir(args.model)
    source = {"predictable": lambda n: probe.PREDICTABLE * (n // 4 + 8),
              "novel": (lambda n: Path(args.text_file).read_text(encoding="utf-8"))
              if args.text_file else (lambda n: probe.novel_corpus(6 * n))}
    rows = []
    ch, metadata = gateway_channel(args)
    with ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for text in texts:
            corpus = source[text](max(contexts))
            corpus_ids = tok.encode(corpus) if text == "predictable" else None
            for n in contexts:
                ids = probe.prompt_ids(tok, corpus, n)
                expected = corpus_ids[n : n + args.new_tokens] if corpus_ids else None
                try:
                    row = probe_client.probe_row(stub, ids, expected, text, args.new_tokens,
                                                 args.drafter, args.budget, args.timeout_s,
                                                 metadata, args.lossless_check == "on")
                except grpc.RpcError as e:
                    print(f"specserve probe: {text} @ {n}: {e.code().name}: {e.details()}",
                          file=sys.stderr)
                    return 2
                rows.append(row)
                print(f"  {text} @ {n:,}: commit_len {row.commit_len:.2f}, "
                      f"steps {row.first_step_ms:.1f} ms then {row.steady_step_ms:.1f} ms, "
                      f"wall {row.wall_s:.1f} s: {row.verdict}", file=sys.stderr)
                if row.lossless is False:
                    print(f"specserve probe: {text} @ {n:,}: speculation changed the tokens "
                          "(the same request without it differs)", file=sys.stderr)
    print(probe.table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(probe.rows_as_json(rows), indent=2))
    if args.plot:
        probe_plot.plot(rows, args.plot, args.budget, Path(args.model).name)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 3 if any(r.lossless is False for r in rows) else 0
