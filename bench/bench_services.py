"""Microservice overhead: the same workload in process vs over gRPC (three real processes).

    .venv/bin/specserve bench services [--tokens 64] [--json out.json]
    PYTHONPATH=. .venv/bin/python bench/bench_services.py ...   # the same (tests.helpers)

Workload: a tiny random Qwen3 target (CPU, fp32, one intra-op thread everywhere), n-gram
speculation (budget 8) on repetitive token-id prompts so steps really accept; 1 and 8 concurrent
requests. In process: `Engine` + `NgramDrafter`. Over gRPC: drafter, verifier and gateway as
subprocesses on 127.0.0.1, requests streamed through the gateway. Per-step time = wall / engine
steps (the verifier's `Stats.steps` counter over gRPC); overhead = the difference per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)
VOCAB = 320
ENV = {**os.environ, "GRPC_VERBOSITY": "ERROR", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "SPECSERVE_KV_MEMORY_GB": "0.05",
       "SPECSERVE_GATEWAY_HTTP_PORT": "off"}  # gRPC only: nothing bound on :8000


def make_model(root: Path) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.helpers import hf_config

    torch.manual_seed(7)
    transformers.Qwen3ForCausalLM(hf_config("qwen3-gqa4-yarn", vocab_size=VOCAB,
                                            num_hidden_layers=4, initializer_range=0.2)
                                  ).save_pretrained(root)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    return root


def prompts(n: int) -> list[list[int]]:
    from tests.helpers import random_prompts

    return [p * 4 for p in random_prompts(n, VOCAB, [7, 9, 11, 13, 5, 8, 10, 12], seed=3)]


def in_process(model: Path, batch: int, tokens: int) -> dict:
    from specserve.config import EngineConfig
    from specserve.drafters.ngram import NgramDrafter
    from specserve.engine.engine import Engine
    from specserve.types import SamplingParams

    engine = Engine(EngineConfig(str(model), max_draft_tokens=8), drafter=NgramDrafter())
    engine.generate(prompts(1), SamplingParams(max_tokens=4, ignore_eos=True), budget=8)  # warm
    for i, p in enumerate(prompts(batch)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True), 8)
    t0, steps, committed = time.perf_counter(), 0, 0
    while engine.has_unfinished:
        committed += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "steps": steps, "tokens": committed}


def start(name: str, tmp: Path, flags: list[str], env: dict | None = None
          ) -> tuple[subprocess.Popen, str]:
    """`python -m services.NAME` on a free port (`env`: default ENV); (process, address)."""
    port_file = tmp / f"{name}.port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", f"services.{name}", "--port", "0",
                             "--port-file", str(port_file), *flags], cwd=ROOT,
                            env=ENV if env is None else env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


async def over_grpc(gateway: str, verifier: str, batch: int, tokens: int,
                    cpu_s=None) -> dict:
    """`batch` concurrent n-gram generations of `tokens` through the gateway (after one warm-up):
    wall time, verifier steps, tokens streamed, and `cpu_s()` seconds spent (when given)."""
    from services.common.server import channel
    from services.gateway import convert
    from specserve.types import SamplingParams
    from specserve.v1 import gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    async def one(stub, prompt) -> int:
        req = convert.generate_request_to_pb(prompt, params, "ngram", 8)
        n = 0
        async for msg in stub.Generate(req, timeout=600):
            event = convert.response_from_pb(msg)
            if not isinstance(event, convert.GatewayFinal):
                n += len(event[1].token_ids)
        return n

    cpu = cpu_s or (lambda: 0.0)
    async with channel(gateway) as g, channel(verifier) as v:
        stub, stats = gateway_pb2_grpc.GatewayStub(g), verifier_pb2_grpc.VerifierStub(v)
        await one(stub, prompts(1)[0][:8])  # warm
        before = (await stats.Stats(verifier_pb2.StatsRequest(), timeout=10)).steps
        cpu0, t0 = cpu(), time.perf_counter()
        counts = await asyncio.gather(*(one(stub, p) for p in prompts(batch)))
        wall, cpu1 = time.perf_counter() - t0, cpu()
        after = (await stats.Stats(verifier_pb2.StatsRequest(), timeout=10)).steps
    return {"wall_s": wall, "steps": after - before, "tokens": sum(counts), "cpu_s": cpu1 - cpu0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request (≥ 1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.tokens < 1:
        ap.error(f"--tokens must be at least 1, got {args.tokens}")
    tmp = Path(tempfile.mkdtemp())
    model = make_model(tmp / "target")
    cpu = ["--device", "cpu", "--dtype", "float32"]
    procs = []
    try:
        d, daddr = start("drafter", tmp, ["--model", str(model), *cpu])
        procs.append(d)
        v, vaddr = start("verifier", tmp, ["--model", str(model), "--drafter", daddr, *cpu,
                                           "--max-draft-tokens", "8", "--default-budget", "8"])
        procs.append(v)
        g, gaddr = start("gateway", tmp, ["--verifier", vaddr, "--model", str(model)])
        procs.append(g)
        rows = []
        for batch in (1, 8):
            local = in_process(model, batch, args.tokens)
            remote = asyncio.run(over_grpc(gaddr, vaddr, batch, args.tokens))
            rows.append({"batch": batch, "in_process": local, "grpc": remote})
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    print("| requests | mode | tokens | engine steps | wall s | ms/step | overhead ms/step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = 1e3 * r["in_process"]["wall_s"] / r["in_process"]["steps"]
        for mode in ("in_process", "grpc"):
            m = r[mode]
            per = 1e3 * m["wall_s"] / m["steps"]
            print(f"| {r['batch']} | {mode} | {m['tokens']} | {m['steps']} | {m['wall_s']:.2f} "
                  f"| {per:.2f} | {per - base:+.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
