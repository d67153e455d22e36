"""`specserve probe`: the commit probe client (predictable vs novel text by context).

A context the server can never run (more KV pages than the verifier's pool: its refusal says so)
is a row of its own, reported and not measured; the other rows still run. Exit codes: 0 when a
row was measured and none changed tokens; 3 when speculation changed tokens; 4 when no row fit
the server (nothing measured); 5 when a row found the drafter unavailable (a broken system, not
hard text); 2 on a usage error or any other failed request (the rows so far are printed); 130
on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from services.cli import usage
from services.cli.client import add_gateway_flags, gateway_channel, rpc_error_text
from specserve import probe
from specserve.drafters import registry

NOTHING_MEASURED = 4  # the exit code when no row fit the server
DRAFTER_DOWN = 5  # ... when a row found the drafter unavailable


def add(sub) -> None:
    p = sub.add_parser("probe", help="the commit probe: predictable vs novel text by context",
                       formatter_class=usage.HelpFormatter,
                       description="Send predictable text ('The cat sat on the mat.' repeated) "
                                   "and novel text at several context lengths through the "
                                   "gateway; print commit_len, depth, drafts, timings and a "
                                   "verdict per row. A context that can never fit the server's KV "
                                   "pool is reported as such and the other rows still run. Exit "
                                   "0: rows measured; 3: speculation changed tokens; 4: no row "
                                   "fit the server (nothing measured); 5: the drafter was "
                                   "unavailable; 2: a usage error or a failed request.")
    add_gateway_flags(p)
    p.add_argument("--model", default=os.environ.get("SPECSERVE_MODEL"),
                   help="target checkpoint dir (its tokenizer.json sizes the prompts) "
                        "[env SPECSERVE_MODEL; default: the demo target in checkpoints/]")
    p.add_argument("--contexts", type=_contexts, default="1k,16k,64k,128k",
                   help="prompt lengths in tokens, comma-separated (k = 1024)")
    p.add_argument("--new-tokens", type=usage.int_range(1, usage.INT32_MAX), default=64,
                   help="tokens generated per row")
    p.add_argument("--drafter", choices=registry.CHOICES, default=None,
                   help="drafter for the requests (default: the verifier's)")
    p.add_argument("--budget", type=usage.budget, default=15,
                   help=f"DDTree budget (draft nodes), 0..{usage.MAX_BUDGET}; the verifier caps "
                        "it at its --max-draft-tokens")
    p.add_argument("--texts", type=usage.names(probe.TEXTS), default=",".join(probe.TEXTS),
                   help=f"which texts to probe, comma-separated: {', '.join(probe.TEXTS)}")
    p.add_argument("--text-file", help="novel text to use instead of the built-in one "
                                       "(default: stdlib docstrings)")
    p.add_argument("--timeout-s", type=usage.deadline, default=3600.0,
                   help="deadline per request, seconds (> 0, at most a year)")
    p.add_argument("--lossless-check", choices=["on", "off"], default="on",
                   help="per row, the same request without speculation must give the same "
                        "first tokens (one more short request each)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (commit_len, step time)")
    p.set_defaults(func=_probe)


def _contexts(value: str) -> list[int]:
    try:
        return probe.parse_contexts(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _probe(args) -> int:
    from specserve import probe_plot

    novel = usage.read_text(args.text_file, "--text-file") if args.text_file else None
    if novel is not None and not novel.strip():
        raise usage.UsageError(f"argument --text-file: {args.text_file!r} has no text")
    _check(args)
    rows: list = []
    try:
        failed = _run(args, _sources(novel), rows)
    except KeyboardInterrupt:  # keep what was measured
        print(f"specserve probe: interrupted after {len(rows)} rows", file=sys.stderr)
        failed = 130
    measured = probe.measured(rows)
    if rows:
        print(probe.table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(probe.rows_as_json(rows), indent=2))
    if args.plot and measured:
        probe_plot.plot(measured, args.plot, args.budget, Path(args.model).name)
        print(f"plot: {args.plot}", file=sys.stderr)
    if failed:
        return failed
    if not measured:
        print("specserve probe: no context fit this server: nothing measured", file=sys.stderr)
        return NOTHING_MEASURED
    if any(r.lossless is False for r in rows):
        return 3
    return DRAFTER_DOWN if any(r.verdict == probe.NO_DRAFTER for r in measured) else 0


def _check(args) -> None:
    """Usage errors found before any request: the model, the contexts it can take, the paths
    the results go to."""
    if not args.model:
        from specserve.demo import default_pair

        args.model = default_pair()[0]
    if not args.model:
        raise usage.UsageError("--model (or SPECSERVE_MODEL) is required (no demo pair under "
                               "checkpoints/)")
    limit = int(usage.model_config(args.model, "--model").get("max_position_embeddings") or 0)
    if limit and max(args.contexts) + args.new_tokens > limit:
        raise usage.UsageError(f"argument --contexts: {max(args.contexts):,} tokens + "
                               f"--new-tokens {args.new_tokens} is past the model's "
                               f"{limit:,} positions")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            usage.writable(path, flag)


def _run(args, source: dict, rows: list) -> int:
    """Probe each text × context into `rows` (printing each); 2 when a request failed. A row the
    server can never run is kept unmeasured (`probe.unfit_row`) and the rest still run."""
    import grpc

    from services.cli import probe_client
    from specserve.tokenizer import Tokenizer
    from specserve.v1 import gateway_pb2_grpc

    tok = Tokenizer.from_dir(args.model)
    ch, metadata = gateway_channel(args)
    with ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for text in args.texts:
            corpus = source[text](max(args.contexts))
            corpus_ids = tok.encode(corpus) if text == "predictable" else None
            for n in args.contexts:
                ids = probe.prompt_ids(tok, corpus, n)
                expected = corpus_ids[n : n + args.new_tokens] if corpus_ids else None
                try:
                    row = probe_client.probe_row(stub, ids, expected, text, args.new_tokens,
                                                 args.drafter, args.budget, args.timeout_s,
                                                 metadata, args.lossless_check == "on")
                except grpc.RpcError as e:
                    refused = probe_client.refusal(e)
                    if refused is None:
                        print(f"specserve probe: {text} @ {n}: "
                              f"{rpc_error_text(e, args.gateway)}", file=sys.stderr)
                        return 2
                    row = probe.unfit_row(text, n, refused)
                rows.append(row)
                _print_row(row)
    return 0


def _sources(novel_text: str | None) -> dict:
    """text name → (context length → the corpus to cut prompts from); `novel_text`: --text-file's
    (None: the built-in novel corpus)."""
    novel = (lambda n: novel_text) if novel_text is not None else \
        (lambda n: probe.novel_corpus(6 * n))
    return {"predictable": lambda n: probe.PREDICTABLE * (n // 4 + 8), "novel": novel}


def _print_row(row) -> None:
    if row.refused is not None:
        print(f"  {row.text} @ {row.context:,}: {probe.unfit_text(row)} (not measured)",
              file=sys.stderr)
        return
    print(f"  {row.text} @ {row.context:,}: commit_len {row.commit_len:.2f}, "
          f"steps {probe.ms(row.first_step_ms)} ms then {probe.ms(row.steady_step_ms)} ms, "
          f"wall {row.wall_s:.1f} s: {row.verdict}", file=sys.stderr)
    if row.lossless is False:
        print(f"specserve probe: {row.text} @ {row.context:,}: speculation changed the tokens "
              "(the same request without it differs)", file=sys.stderr)
