"""`specserve generate` / `probe` refuse what the wire cannot carry before anything is sent: a
number out of its protobuf field's range, an empty --token-ids item, a deadline <= 0, a prompt
file that is not UTF-8 text: `specserve CMD: error: argument --FLAG: …`, exit 2, no traceback.
(The other flag checks: test_cli_usage.py.)"""

from __future__ import annotations

import pytest

from services.cli import build_parser, generate, main, usage
from specserve.v1 import common_pb2, gateway_pb2


@pytest.fixture
def dialed(monkeypatch):
    """The gateway channels `generate` opened (none, when a flag is refused)."""
    calls = []

    def channel(args):
        calls.append(args.gateway)
        raise AssertionError("a request was about to be sent")

    monkeypatch.setattr(generate, "gateway_channel", channel)
    return calls


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"specserve {argv[0]}: error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("flags, says", [
    (["--seed", "-1", "--temperature", "0.5"], "argument --seed: must be an integer in [0, "),
    (["--seed", str(2**64)], "argument --seed: must be an integer in [0, 18446744073709551615]"),
    (["--top-k", "99999999999"], "argument --top-k: must be an integer in [-1, 2147483647]"),
    (["--top-k", "-2"], "argument --top-k: must be an integer in [-1, 2147483647], got -2"),
    (["--max-tokens", "2147483648"], "argument --max-tokens: must be an integer in [1, "),
    (["--max-tokens", "0"], "argument --max-tokens: must be an integer in [1, 2147483647]"),
    (["--stop-token-id", str(2**63)], "argument --stop-token-id: must be an integer in [0, "),
    (["--temperature", "1e39"], "argument --temperature: must be a number in [0, 3.40282e+38]"),
    (["--temperature", "nan"], "argument --temperature: must be a number in [0, "),
    (["--temperature", "-0.1"], "argument --temperature: must be a number in [0, "),
    (["--top-p", "0"], "argument --top-p: must be a number in (0, 1], got '0'"),
    (["--top-p", "1.5"], "argument --top-p: must be a number in (0, 1]"),
    (["--budget", "-1"], "argument --budget: must be in [0, 1024], got -1"),
    (["--timeout-s", "-1"], "argument --timeout-s: must be a number in (0, 31536000], got '-1'"),
    (["--timeout-s", "0"], "argument --timeout-s: must be a number in (0, 31536000], got '0'"),
    (["--timeout-s", "inf"], "argument --timeout-s: must be a number in (0, 31536000]"),
    (["--stop", "\udcff"], "argument --stop: must be UTF-8 text"),
    (["--request-id", "\udcff"], "argument --request-id: must be UTF-8 text"),
])
def test_out_of_range_sampling_flags_are_usage_errors(flags, says, capsys, dialed):
    err = _refused(["generate", "--prompt", "x", "--gateway", "127.0.0.1:1", *flags], capsys)
    assert says in err and dialed == []


@pytest.mark.parametrize("ids, says", [
    ("1,,2", "argument --token-ids: must be integers separated by commas (no empty items), "
             "got '1,,2'"),
    ("1,2,", "no empty items"), (",1", "no empty items"), ("", "no empty items"),
    ("1,x", "must be integers"), ("1.5", "must be integers"),
    ("1,-3", "argument --token-ids: must be non-negative token ids"),
    (str(2**63), "must be non-negative token ids (at most 9223372036854775807)"),
])
def test_token_ids_refuse_empty_items_and_non_integers(ids, says, capsys, dialed):
    err = _refused(["generate", "--token-ids", ids, "--gateway", "127.0.0.1:1"], capsys)
    assert says in err and dialed == []


def test_token_ids_take_commas_and_spaces():
    assert usage.token_ids("1,2 3") == [1, 2, 3]
    assert usage.token_ids(" 4, 5 ,6 ") == [4, 5, 6]
    assert usage.token_ids(str(2**63 - 1)) == [2**63 - 1]


def test_a_prompt_file_that_is_not_utf8_is_a_usage_error(tmp_path, capsys, dialed):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    err = _refused(["generate", "--prompt-file", str(bad), "--gateway", "127.0.0.1:1"], capsys)
    assert f"argument --prompt-file: {str(bad)!r} is not UTF-8 text (invalid start byte at " \
           "byte 0)" in err and dialed == []


def test_a_prompt_on_stdin_that_is_not_utf8_is_a_usage_error(capsys, dialed, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff")))
    err = _refused(["generate", "--prompt-file", "-", "--gateway", "127.0.0.1:1"], capsys)
    assert "argument --prompt-file: stdin is not UTF-8 text (invalid start byte at byte 3)" \
           in err and dialed == []


def test_a_utf8_prompt_file_is_read(tmp_path):
    good = tmp_path / "p.txt"
    good.write_text("héllo\n", encoding="utf-8")
    args = build_parser()[0].parse_args(["generate", "--prompt-file", str(good)])
    assert generate._prompt(args) == "héllo\n"


def test_a_value_the_core_refuses_names_its_flag():
    """Past the flag checks (a caller filling args itself), InvalidRequest from SamplingParams
    is still a usage error naming the flag, never a traceback."""
    args = build_parser()[0].parse_args(["generate", "--prompt", "x"])
    args.top_k = -5
    with pytest.raises(usage.UsageError, match=r"^argument --top-k: top_k must be"):
        generate._sampling_params(args)
    args.top_k, args.seed = None, -1
    with pytest.raises(usage.UsageError, match=r"^argument --seed: seed must be"):
        generate._sampling_params(args)


def test_a_request_that_does_not_fit_the_wire_is_a_usage_error():
    args = build_parser()[0].parse_args(["generate", "--prompt", "x"])
    params = generate._sampling_params(args)
    with pytest.raises(usage.UsageError, match="does not fit the wire format"):
        generate._request(args, [2**64], params)


@pytest.mark.parametrize("field, top, parse", [
    ("max_tokens", usage.INT32_MAX, usage.int_range(1, usage.INT32_MAX)),
    ("top_k", usage.INT32_MAX, usage.int_range(1, usage.INT32_MAX)),
    ("seed", usage.UINT64_MAX, usage.int_range(0, usage.UINT64_MAX)),
])
def test_the_int_bounds_are_the_wire_fields(field, top, parse):
    common_pb2.SamplingParams(**{field: parse(str(top))})  # the largest accepted value fits
    with pytest.raises(ValueError):
        common_pb2.SamplingParams(**{field: top + 1})
    with pytest.raises(usage.argparse.ArgumentTypeError):
        parse(str(top + 1))


def test_the_id_and_float_bounds_are_the_wire_fields():
    top = usage.token_ids(str(usage.INT64_MAX))
    gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=top))
    common_pb2.SamplingParams(stop_token_ids=top)
    with pytest.raises(ValueError):
        common_pb2.SamplingParams(stop_token_ids=[usage.INT64_MAX + 1])
    big = common_pb2.SamplingParams(temperature=usage.FLOAT32_MAX).temperature
    assert big == usage.FLOAT32_MAX  # the largest float32: still finite on the wire


@pytest.mark.parametrize("flags, says", [
    (["--timeout-s", "-1"], "argument --timeout-s: must be a number in (0, 31536000]"),
    (["--new-tokens", "2147483648"], "argument --new-tokens: must be an integer in [1, "),
])
def test_probe_flags_out_of_range(flags, says, capsys):
    assert says in _refused(["probe", *flags], capsys)


def test_probe_text_file_that_is_not_utf8_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "novel.txt"
    bad.write_bytes(b"\xff\xfe")
    err = _refused(["probe", "--model", str(tmp_path), "--text-file", str(bad),
                    "--gateway", "127.0.0.1:1"], capsys)
    assert f"argument --text-file: {str(bad)!r} is not UTF-8 text" in err


@pytest.mark.parametrize("given, sent", [("0", 0), ("-1", 0), ("7", 7)])
def test_top_k_0_or_minus_1_asks_for_no_cut_over_the_model_s(given, sent):
    """A checkpoint's top_k default is overridden by --top-k 0 / -1: the wire carries top_k 0
    (no cut) explicitly; left out, the field is cleared (the model's default applies)."""
    args = build_parser()[0].parse_args(["generate", "--prompt", "x", "--top-k", given])
    req = generate._request(args, "x", generate._sampling_params(args))
    assert req.sampling.HasField("top_k") and req.sampling.top_k == sent
    args = build_parser()[0].parse_args(["generate", "--prompt", "x"])
    assert not generate._request(args, "x", generate._sampling_params(args)) \
        .sampling.HasField("top_k")
