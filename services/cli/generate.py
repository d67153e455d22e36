"""`specserve generate`: stream a generation from the gateway, or (`--in-process`) from an engine
built in this process.

The gateway client imports no torch (its wire conversions are `wire`'s): its first byte comes in
well under a second. torch and the engine load only for `--in-process`.
"""

from __future__ import annotations

import json
import os
import sys
import time

from services.cli import usage
from services.cli.client import add_gateway_flags, gateway_channel, rpc_error_text
from specserve.drafters import registry
from specserve.models.generation_config import GENERATION_CONFIG
from specserve.spec.metrics import reason_kind

# SamplingParams field (InvalidRequest.param) → the flag that sets it
PARAM_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k",
               "top_p": "--top-p", "seed": "--seed", "stop": "--stop",
               "stop_token_ids": "--stop-token-id", "logprobs": "--logprobs"}


def add(sub) -> None:
    p = sub.add_parser("generate", help="stream a generation from the gateway",
                       formatter_class=usage.HelpFormatter,
                       description="Stream text from the gateway (gRPC); the stats line goes "
                                   "to stderr. --in-process runs an engine here instead.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", type=usage.text, help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt text from this file ('-': stdin)")
    src.add_argument("--token-ids", type=usage.token_ids,
                     help="prompt token ids, comma-separated (each must be in the model's "
                          "vocabulary)")
    add_gateway_flags(p)
    _add_sampling(p)
    p.add_argument("--drafter", choices=registry.CHOICES, default=None,
                   help="drafter for this request (default: the verifier's; gateway only)")
    p.add_argument("--budget", type=usage.budget, default=None,
                   help=f"draft nodes per step, 0..{usage.MAX_BUDGET} (the verifier caps it at "
                        "its --max-draft-tokens; default: the verifier's; gateway only)")
    p.add_argument("--request-id", default="", type=usage.text,
                   help="the request's id (default: one the gateway makes up)")
    p.add_argument("--timeout-s", type=usage.deadline, default=600.0,
                   help="deadline of the call, seconds (> 0, at most a year)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--in-process", action="store_true",
                   help="run an engine in this process (no drafter: plain decoding)")
    p.add_argument("--model", help="HF checkpoint directory (--in-process)")
    p.add_argument("--device", default="cpu", type=usage.device(),
                   help="cpu, cuda or cuda:N (--in-process)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="(--in-process)")
    p.add_argument("--generation-config", choices=GENERATION_CONFIG, default=None,
                   help="(--in-process) auto: sampling not given is generation_config.json's; "
                   "none: greedy [env SPECSERVE_GENERATION_CONFIG] (default: auto)")
    p.set_defaults(func=_generate)


def _add_sampling(p) -> None:
    p.add_argument("--max-tokens", type=usage.int_range(1, usage.INT32_MAX), default=64,
                   help="most tokens to generate")
    p.add_argument("--temperature", type=usage.float_range(0, usage.FLOAT32_MAX), default=None,
                   help="0 = greedy (default: the model's generation_config.json, else greedy)")
    p.add_argument("--top-k", type=usage.int_range(-1, usage.INT32_MAX), default=None,
                   help="sample from the k likeliest tokens; 0 or -1: no cut (default: the "
                   "model's, else no cut)")
    p.add_argument("--top-p", type=usage.float_range(0, 1, lo_open=True), default=None,
                   help="nucleus mass, (0, 1] (default: the model's, else 1)")
    p.add_argument("--seed", type=usage.int_range(0, usage.UINT64_MAX), default=None,
                   help="sampling seed (default: none, not reproducible)")
    p.add_argument("--stop", action="append", default=[], type=usage.unescape,
                   help=r"stop string (repeatable); \n, \t, \r and \\ are unescaped, so "
                        r"--stop '\n\n' stops at a blank line")
    p.add_argument("--stop-token-id", type=usage.int_range(0, usage.INT64_MAX), action="append",
                   default=[],
                   help="stop token id (repeatable; besides the model's EOS)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past EOS (until --max-tokens or a stop)")
    p.add_argument("--logprobs", type=usage.int_range(0, 20), default=None, metavar="N",
                   help="each token's log-probability under the target and the N most likely "
                        "tokens' (in the --json output)")


def _prompt(args) -> str | list[int]:
    if args.token_ids is not None:
        return args.token_ids
    if args.prompt_file is not None:
        return usage.read_text(args.prompt_file, "--prompt-file")
    return args.prompt


def _generate(args) -> int:
    _check_mode(args)
    prompt = _prompt(args)  # a bad prompt file fails here: before a model loads or a byte is sent
    params = _sampling_params(args)
    if args.in_process:
        return _generate_in_process(args, prompt, params)
    return _generate_remote(args, prompt, params)


def _check_mode(args) -> None:
    """Flags of the other mode are refused, not silently dropped."""
    if args.in_process and not args.model:
        raise usage.UsageError("--in-process needs --model DIR")
    if args.in_process:
        given = {"--drafter": args.drafter is not None, "--budget": args.budget is not None,
                 "--request-id": args.request_id != ""}
        if any(given.values()):
            raise usage.UsageError(f"{', '.join(f for f, on in given.items() if on)}: through "
                                   "the gateway only (--in-process decodes plainly)")
    elif given := [f for f, on in (("--model", args.model),
                                   ("--generation-config", args.generation_config)) if on]:
        raise usage.UsageError(f"{', '.join(given)}: with --in-process only (the gateway "
                               "serves its own)")


def _sampling_params(args):
    """The request's SamplingParams; a value the core refuses (InvalidRequest, a ValueError) is
    a usage error that names its flag."""
    from specserve.models.generation_config import GenerationDefaults, load_generation_defaults
    from specserve.types import SamplingParams

    # remote: the server fills what is not given (the fields are cleared on the wire)
    use = args.generation_config or os.environ.get("SPECSERVE_GENERATION_CONFIG", "auto")
    try:
        d = load_generation_defaults(args.model, use) if args.in_process \
            else GenerationDefaults()
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=d.temperature if args.temperature is None else args.temperature,
            top_k=d.top_k if args.top_k is None else None if args.top_k in (0, -1)
            else args.top_k,  # 0 / -1: no cut
            top_p=d.top_p if args.top_p is None else args.top_p, seed=args.seed,
            stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
            ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    except ValueError as e:
        param = getattr(e, "param", None) or str(e).split(" ", 1)[0]
        flag = PARAM_FLAGS.get(param)
        raise usage.UsageError(f"argument {flag}: {e}" if flag else str(e)) from None


def _request(args, prompt, params):
    """The GenerateRequest; a value that does not fit its protobuf field is a usage error."""
    from services.cli import wire

    try:
        req = wire.generate_request(prompt, params, args.drafter, args.budget, args.request_id)
    except ValueError as e:  # protobuf's "Value out of range", a string that is not UTF-8
        raise usage.UsageError(f"the request does not fit the wire format: {e}") from None
    for name in ("temperature", "top_k", "top_p"):  # not given: the model's defaults apply
        if getattr(args, name) is None:
            req.sampling.ClearField(name)
    return req


def _generate_remote(args, prompt, params) -> int:
    import grpc

    from services.cli import wire
    from specserve.v1 import gateway_pb2_grpc

    req = _request(args, prompt, params)
    chunks, final = [], None  # chunks: (client time it arrived, wire.Chunk)
    ch, metadata = gateway_channel(args)
    with ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=args.timeout_s,
                                                        metadata=metadata)
        try:
            for msg in call:
                event = wire.event(msg)
                if isinstance(event, wire.Final):
                    final = event
                    continue
                chunks.append((time.perf_counter(), event))
                if not args.json:
                    print(event.text, end="", flush=True)
        except KeyboardInterrupt:
            call.cancel()
            return 130
        except grpc.RpcError as e:
            sep = "\n" if chunks and not args.json else ""
            print(f"{sep}specserve generate: error: {rpc_error_text(e, args.gateway)}",
                  file=sys.stderr)
            _print_trace(_trace_id(call))
            return 2
    if final is None:
        print("\nspecserve generate: error: the gateway stream ended without a final message",
              file=sys.stderr)
        _print_trace(_trace_id(call))
        return 2
    _report(chunks, final, args.json, _trace_id(call), params.logprobs is not None)
    return 0


def _trace_id(call) -> str | None:
    """The request's trace id, from the gateway's initial or trailing metadata (None: the
    gateway exports no spans, or the call ended before it said)."""
    from services.cli import wire

    return wire.trace_id(call.initial_metadata()) or wire.trace_id(call.trailing_metadata())


def _print_trace(trace_id: str | None) -> None:
    if trace_id is not None:
        print(f"[trace {trace_id}]", file=sys.stderr)


def _logprobs_json(ids: list[int], logprobs) -> list[dict]:
    return [{"token_id": i, "logprob": t.logprob,
             "top": [[j, lp] for j, lp in zip(t.top_ids, t.top_logprobs, strict=True)]}
            for i, t in zip(ids, logprobs, strict=True)]


def _steps_json(chunks) -> list[dict]:
    """One entry per verifier step that streamed tokens (the first: the prompt's token): what
    it verified and committed, and ms since the previous step's tokens arrived (client clock)."""
    timed = [(t, c) for t, c in chunks if c.token_ids]
    before = [None] + [t for t, _ in timed[:-1]]
    return [{"tokens": len(c.token_ids), "commit_len": c.commit_len,
             "accepted_depth": c.accepted_depth, "tree_size": c.tree_size, "shape": c.shape,
             "fallback": c.fallback, "why": c.why,
             "reason": reason_kind(c.why) if c.shape else "",  # the why's kind (metrics' label)
             "ms": None if t0 is None else round(1e3 * (t - t0), 3)}
            for t0, (t, c) in zip(before, timed, strict=True)]


def _report(chunks, final, as_json: bool, trace_id: str | None = None,
            with_logprobs: bool = False) -> None:
    stats, ids = final.stats, [i for _, c in chunks for i in c.token_ids]
    if as_json:
        logprobs = [lp for _, c in chunks for lp in c.logprobs]
        print(json.dumps({
            "text": "".join(c.text for _, c in chunks), "token_ids": ids,
            "request_id": final.request_id, "verifier": final.verifier,
            "finish_reason": final.finish_reason.value if final.finish_reason else None,
            "usage": {"prompt_tokens": final.prompt_tokens,
                      "completion_tokens": final.completion_tokens},
            "stats": {**stats.as_dict(), "other_s": final.other_s},
            "ttft_s": final.ttft_s, "wall_s": final.wall_s, "trace_id": trace_id,
            "steps": _steps_json(chunks),
            **({"logprobs": _logprobs_json(ids, logprobs)} if with_logprobs else {})}))
        return
    reason = final.finish_reason.value if final.finish_reason else "?"
    shapes = ", ".join(f"{shape} {n}" for shape, n in sorted(stats.shapes.items()))
    adaptive = f" (adaptive: {shapes})" if shapes else ""  # steps by the shape verified
    print(f"\n[{len(ids)} tokens in {final.wall_s:.2f} s, TTFT {final.ttft_s * 1e3:.0f} ms, "
          f"mean commit_len {stats.mean_commit_len:.2f} over {stats.steps} steps{adaptive}, "
          f"{sum(stats.fallbacks.values())} fallbacks, finish: {reason}]", file=sys.stderr)
    _print_trace(trace_id)


def _generate_in_process(args, prompt, params) -> int:
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    engine = Engine(EngineConfig(args.model, dtype=args.dtype, device=args.device))
    engine.add_request("cli", prompt, params)
    prompt_tokens = len(engine.requests["cli"].prompt_ids)
    t0, text, ids, logprobs, reason, ttft = time.perf_counter(), [], [], [], None, None
    while engine.has_unfinished:
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
            ids += out.new_token_ids
            logprobs += out.logprobs or ()
            text.append(out.text_delta)
            reason = out.finish_reason or reason
            if not args.json:
                print(out.text_delta, end="", flush=True)
    wall = time.perf_counter() - t0
    if args.json:
        extra = {} if params.logprobs is None else {"logprobs": _logprobs_json(ids, logprobs)}
        print(json.dumps({"text": "".join(text), "token_ids": ids, "finish_reason": reason.value,
                          "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids)},
                          "ttft_s": ttft and round(ttft, 4), "wall_s": round(wall, 4), **extra}))
    else:
        print(f"\n[{len(ids)} tokens in {wall:.2f} s, finish: {reason.value}]", file=sys.stderr)
    return 0
