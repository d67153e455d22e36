"""The twenty-fourth session's served-audit findings, measured through `specserve up` on the CPU
demo pair (run it from the checkout to measure; `--repo` another checkout for a before/after):

- scratch: on a 64-page pool (1,024 tokens) a 950-token prompt with max_tokens 48 and budget 0
  (998 tokens) — refused as never fitting while every request reserved max_draft_tokens + 1;
- slow bodies: clients that send half their body and then nothing, against a gateway with
  --request-timeout-s 5 — how many got an answer within 15 s;
- drafter crashes: the drafter killed with -9 six times, each time once it is SERVING again —
  whether `up` (and with it the verifier and gateway) is still serving afterwards;
- sockets: the lane sockets the killed drafters left in the temp directory.

    python experiments/served_audit.py --out experiments/results/served_audit_new_cpu_s24.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def http(port: int, path: str, body: dict | None = None, timeout: float = 120.0):
    """(status, parsed body) of a GET (no body) or POST."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
    except OSError as e:
        return None, str(e)


def wait_health(port: int, within_s: float = 300.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if http(port, "/health", timeout=2)[0] == 200:
            return True
        time.sleep(0.5)
    return False


def scratch(port: int) -> dict:
    ids = [5 + (i * 37) % 3900 for i in range(950)]
    status, body = http(port, "/v1/completions", {"prompt": ids, "max_tokens": 48, "budget": 0,
                                                  "drafter": "none", "ignore_eos": True})
    return {"status": status, "usage": body.get("usage") if isinstance(body, dict) else None,
            "error": body.get("error", {}).get("message") if isinstance(body, dict) else body}


def slow_bodies(port: int, n: int = 8, wait_s: float = 15.0) -> dict:
    """n clients send half a body and stop; seconds until each got an answer (None: none)."""
    socks, t0 = [], time.monotonic()
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt": "' + b"a" * 400)
        s.setblocking(False)
        socks.append(s)
    answered: list[float | None] = [None] * n
    while time.monotonic() - t0 < wait_s and None in answered:
        for i, s in enumerate(socks):
            if answered[i] is None:
                try:
                    if s.recv(4096):
                        answered[i] = round(time.monotonic() - t0, 2)
                except BlockingIOError:
                    pass
        time.sleep(0.1)
    for s in socks:
        s.close()
    return {"clients": n, "answered_after_s": answered}


def drafter_pid(port: int) -> int | None:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if re.search(rf"services\.cli serve drafter .*--port {port}\b", line):
            return int(line.split()[0])
    return None


def crashes(base: int, http_port: int, log: Path, kills: int = 6) -> dict:
    """Kill the drafter `kills` times, each once `up` said it is SERVING again."""
    done = 0
    for k in range(kills):
        pid = drafter_pid(base + 2)
        if pid is None:
            break
        os.kill(pid, signal.SIGKILL)
        done += 1
        end = time.monotonic() + 90
        while time.monotonic() < end and log.read_text().count("drafter SERVING again") <= k:
            time.sleep(0.5)
        time.sleep(2.0)
    status, _ = http(http_port, "/v1/completions", {"prompt": "The cat sat on the",
                                                   "max_tokens": 8}, timeout=60)
    text = log.read_text()
    return {"kills": done, "restarted": text.count("drafter SERVING again"),
            "stopped_everything": "restarts in a row; stopping" in text,
            "request_after": status}


@contextlib.contextmanager
def running_up(repo: str, ports: int, http_port: int, log: Path, **env: str):
    """`specserve up` of the checkout `repo` (its output to `log`) until the block ends."""
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--ports", str(ports),
                           "--http-port", str(http_port), "--metrics-ports", "0"],
                          cwd=repo, env={**os.environ, "GRPC_VERBOSITY": "ERROR", **env},
                          stdout=log.open("w"), stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        assert wait_health(http_port), log.read_text()[-2000:]
        yield up
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            up.wait(60)


def write_out(path: str, out: dict) -> None:
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


def audit_parser(doc: str, ports: int) -> argparse.ArgumentParser:
    """The flags every served audit takes: --repo (whose `specserve up`), --ports, --out."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--repo", default=".", help="the checkout whose `specserve up` to run")
    ap.add_argument("--ports", type=int, default=ports)
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    args = audit_parser(__doc__, 64451).parse_args()
    http_port, log = args.ports + 30, Path(tempfile.mkdtemp()) / "up.log"
    out = {"repo": os.path.abspath(args.repo)}
    with running_up(args.repo, args.ports, http_port, log, SPECSERVE_KV_MEMORY_GB="0.0078125",
                    SPECSERVE_REQUEST_TIMEOUT_S="5"):
        out["scratch"] = scratch(http_port)
        out["slow_bodies"] = slow_bodies(http_port)
        out["crashes"] = crashes(args.ports, http_port, log)
        left = Path(tempfile.gettempdir()).glob(f"specserve-drafter-{args.ports + 2}-*.sock")
        out["sockets_left"] = len([p for p in left if not str(p).endswith(
            f"-{drafter_pid(args.ports + 2)}.sock")])
    write_out(args.out, out)


if __name__ == "__main__":
    main()
