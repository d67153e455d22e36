"""The console script: every subcommand answers --help; `bench NAME` runs bench/ scripts;
`generate` talks to a gateway without torch, through the gateway's own wire format (its --json
names the verifier replica; a failed request still prints its trace id); `train-demo` keeps an
existing output unless --force. (Flag values: test_cli_usage.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections import Counter
from concurrent import futures
from dataclasses import replace

import grpc
import pytest

from services.cli import main, wire
from services.gateway import convert
from services.gateway.convert import GatewayFinal, Step
from specserve.spec.metrics import RequestSpecStats
from specserve.types import FinishReason, SamplingParams
from specserve.v1 import gateway_pb2_grpc, verifier_pb2


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("cmd", [[], ["serve"], ["up"], ["generate"], ["probe"], ["bench"],
                                 ["train-demo"]])
def test_help(cmd):
    out = _cli(*cmd, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: specserve" in out.stdout


def test_bench_dispatches_to_the_script():
    out = _cli("bench", "correctness", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: correctness_report.py" in out.stdout
    bad = _cli("bench", "nope")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_a_gpu_benchmark_without_a_gpu_is_a_usage_error(monkeypatch):
    from services.cli import bench, usage

    monkeypatch.setattr(usage, "cuda_devices", lambda: 0)
    with pytest.raises(usage.UsageError, match="bench served needs a CUDA GPU, and torch sees "
                                               "none here; on the CPU pass --tiny"):
        bench._check_device("served", ["--out", "x.json"])
    with pytest.raises(usage.UsageError, match="prefill-attention needs a CUDA GPU.*here$"):
        bench._check_device("prefill-attention", [])
    for name, argv in (("served", ["--tiny"]), ("kernel", ["--sm120-check"]),
                       ("draft", ["--help"]), ("adaptive", []), ("tracing", [])):
        bench._check_device(name, argv)  # the CPU flag, --help or a CPU benchmark: it runs
    monkeypatch.setattr(usage, "cuda_devices", lambda: 1)
    bench._check_device("served", [])


# ---- the gateway client: torch-free, its wire = the gateway's, errors on one line --------------
VOCAB = 4096


class _FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Streams 'hi' + ' there' and a final; out-of-vocabulary ids: INVALID_ARGUMENT, as the
    verifier's engine answers."""

    def __init__(self) -> None:
        self.requests: list = []

    def Generate(self, request, context):
        self.requests.append(request)
        bad = [t for t in request.token_ids.ids if t >= VOCAB]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt token ids out of vocabulary [0, {VOCAB}): {bad}")
        stats = RequestSpecStats(steps=1, draft_tokens=4, accepted_tokens=1, committed_tokens=2,
                                 commit_len_hist=Counter({2: 1}), device="cpu",
                                 shapes=Counter({"chain": 1}))
        if request.request_id.startswith("fail-"):  # a traced request that fails mid-stream
            trace = ((wire.TRACE_ID_KEY, "feed0123"),)
            if request.request_id == "fail-initial":
                context.send_initial_metadata(trace)
            else:
                context.set_trailing_metadata(trace)
            yield convert.chunk_to_pb("hi", Step((5,), 1, 0))
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        yield convert.chunk_to_pb("hi", Step((5,), 1, 0))
        yield convert.chunk_to_pb(" there", Step((6, 7), 2, 1, tree_size=4, shape="chain",
                                                       why="step rows 5: 2.10 tok/step"))
        yield convert.final_to_pb(GatewayFinal(FinishReason.LENGTH, 2, 3, stats, 0.01, "r1",
                                               0.02, 0.05, "10.0.0.7:50052"))


@pytest.fixture
def gateway():
    server, fake = grpc.server(futures.ThreadPoolExecutor(2)), _FakeGateway()
    gateway_pb2_grpc.add_GatewayServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", fake
    server.stop(0)


def test_generate_streams_from_the_gateway(gateway, capsys):
    addr, fake = gateway
    assert main(["generate", "--gateway", addr, "--token-ids", "1,2", "--stop", r"\n\n",
                 "--budget", "7", "--drafter", "ngram", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "hi there" and out["token_ids"] == [5, 6, 7]
    assert out["finish_reason"] == "length" and out["stats"]["steps"] == 1
    assert out["verifier"] == "10.0.0.7:50052" and out["trace_id"] is None  # spans not exported
    first, second = out["steps"]
    assert first == {"tokens": 1, "commit_len": 1, "accepted_depth": 0, "tree_size": 0,
                     "shape": "", "fallback": "", "why": "", "reason": "", "ms": None}
    assert second.pop("ms") >= 0 and second == {"tokens": 2, "commit_len": 2, "accepted_depth": 1,
                                                "tree_size": 4, "shape": "chain", "fallback": "",
                                                "why": "step rows 5: 2.10 tok/step",
                                                "reason": "decided"}
    req = fake.requests[0]
    assert list(req.token_ids.ids) == [1, 2] and list(req.sampling.stop) == ["\n\n"]
    assert req.spec.budget == 7 and not req.sampling.HasField("temperature")


def test_generate_summarises_the_adaptive_shapes(gateway, capsys):
    """Without --json the summary line on stderr counts the steps by adaptive shape."""
    addr, _ = gateway
    assert main(["generate", "--gateway", addr, "--token-ids", "1,2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "hi there"
    assert "over 1 steps (adaptive: chain 1), 0 fallbacks, finish: length]" in captured.err


def test_out_of_vocabulary_ids_are_a_one_line_error(gateway, capsys):
    addr, _ = gateway
    assert main(["generate", "--gateway", addr, "--token-ids", "9707,1"]) == 2
    err = capsys.readouterr().err
    assert err == ("specserve generate: error: INVALID_ARGUMENT: prompt token ids out of "
                   "vocabulary [0, 4096): [9707]\n")


@pytest.mark.parametrize("request_id", ["fail-initial", "fail-trailing"])
@pytest.mark.parametrize("as_json", [False, True])
def test_a_failed_request_prints_its_trace_id(gateway, capsys, request_id, as_json):
    addr, _ = gateway
    argv = ["generate", "--gateway", addr, "--prompt", "x", "--request-id", request_id]
    assert main(argv + ["--json"] * as_json) == 2
    captured = capsys.readouterr()
    assert captured.out == ("" if as_json else "hi")
    assert captured.err == ("" if as_json else "\n") + (
        "specserve generate: error: DEADLINE_EXCEEDED: deadline exceeded\n[trace feed0123]\n")


def test_the_client_wire_is_the_gateways():
    params = [SamplingParams(max_tokens=5), SamplingParams(max_tokens=9, temperature=0.7, top_k=3,
                                                           top_p=0.9, seed=4, stop=("\n",),
                                                           stop_token_ids=(2,), ignore_eos=True)]
    for p in params:
        for prompt, drafter, budget in (("text", None, None), ([1, 2], "none", 0),
                                        ([3], "dflash", 12)):
            assert wire.generate_request(prompt, p, drafter, budget, "id") == \
                convert.generate_request_to_pb(prompt, p, drafter, budget, "id")
    stats = RequestSpecStats(steps=2, draft_tokens=8, accepted_tokens=3, committed_tokens=5,
                             commit_len_hist=Counter({2: 1, 3: 1}),
                             accepted_per_position=Counter({1: 2, 2: 1}),
                             fallbacks=Counter({"drafter_timeout": 1}), shapes=Counter({"t": 2}),
                             prefill_s=0.1, draft_s=0.2, verify_s=0.3, commit_s=0.4, device="x")
    for reason in (*FinishReason, None):
        msg = convert.final_to_pb(GatewayFinal(reason, 4, 5, stats, 0.5, "r", 0.6, 0.7))
        assert vars(wire.event(msg)) == vars(convert.response_from_pb(msg))
    for step in (Step((1, 2), 3, 2), Step((3,), 1, 0, 5, 5, "drafter_timeout", "off"),
                 Step((4, 5), 2, 1, tree_size=3, budget=7, shape="tree", why="step rows 4")):
        text, got = convert.response_from_pb(convert.chunk_to_pb("ab", step))
        assert got == replace(step, budget=0)  # the budget stays at the verifier
        assert wire.event(convert.chunk_to_pb("ab", step)) == wire.Chunk(
            text, got.token_ids, got.commit_len, got.accepted_depth, (), got.tree_size,
            got.shape, got.fallback, got.why)
    ev = verifier_pb2.VerifyEvent(token_ids=[4], commit_len=1, shape="off", why="plain faster")
    assert convert.event_from_pb(ev)[0].why == "plain faster"  # verifier → gateway → client
    metadata = (("other", "1"), (convert.TRACE_ID_KEY, "abc"))
    assert wire.trace_id(metadata) == convert.trace_id_from_metadata(metadata) == "abc"


def test_the_generate_client_imports_no_torch():
    code = ("import sys; from services.cli import main; "
            "rc = main(['generate', '--prompt', 'x', '--gateway', '127.0.0.1:1', "
            "'--timeout-s', '5']); "
            "print(rc, sorted(m for m in ('torch', 'numpy', 'specserve.engine') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr  # 2: nothing listens on :1
    assert "specserve generate: error: UNAVAILABLE" in out.stderr
    assert "no gateway answers at 127.0.0.1:1; start the services with `specserve up`" in \
        out.stderr


class _Failed:
    def __init__(self, code: str, details: str) -> None:
        self._code, self._details = code, details

    def code(self):
        import grpc
        return getattr(grpc.StatusCode, self._code)

    def details(self) -> str:
        return self._details


def test_only_a_refused_connection_suggests_starting_the_services():
    from services.cli.client import rpc_error_text
    said = rpc_error_text(_Failed("UNAVAILABLE", "no verifier is connected"), "h:7")
    assert said == "UNAVAILABLE: no verifier is connected"  # the gateway answered: no hint
    said = rpc_error_text(_Failed("INVALID_ARGUMENT", "failed to connect"), "h:7")
    assert said == "INVALID_ARGUMENT: failed to connect"
    said = rpc_error_text(_Failed("UNAVAILABLE", "failed to connect to all addresses"), "h:7")
    assert said.startswith("UNAVAILABLE: failed to connect to all addresses — no gateway "
                           "answers at h:7; start the services with `specserve up`")


# ---- train-demo keeps what --out holds ------------------------------------------------------
def test_train_demo_refuses_to_overwrite_without_force(tmp_path, monkeypatch, capsys):
    (tmp_path / "training.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["train-demo", "--out", str(tmp_path), "--quick"])
    assert e.value.code == 2
    assert "already exists and is not empty; pass --force" in capsys.readouterr().err
    ran = []
    fake = types.ModuleType("specserve.demo.train")
    fake.run_from_args = lambda args: ran.append(args.out) or 0
    monkeypatch.setitem(sys.modules, "specserve.demo.train", fake)
    assert main(["train-demo", "--out", str(tmp_path), "--quick", "--force"]) == 0
    assert main(["train-demo", "--out", str(tmp_path / "new"), "--quick"]) == 0
    assert ran == [str(tmp_path), str(tmp_path / "new")]
