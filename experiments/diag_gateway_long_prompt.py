"""How long the gateway's event loop stalls while it tokenizes one very long prompt: posts a
prompt of `--mb` MB of text to a running gateway's HTTP API (/v1/completions; over the context,
so it ends in a 400 once tokenized) and polls `/health` every 0.1 s meanwhile; prints the big
request's status and time and the worst `/health` latency, and writes JSON.

    specserve up --ports 61051 --http-port 61080 --metrics-ports 61091 &
    python experiments/diag_gateway_long_prompt.py --http-port 61080 --mb 4 --out /tmp/lp.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time

TEXT = "The quick brown fox jumps over the lazy dog. "


def _post(port: int, text: str, out: dict) -> None:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": text, "max_tokens": 4}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    out.update(status=resp.status, seconds=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    text = TEXT * (int(args.mb * 2**20) // len(TEXT) + 1)
    big: dict = {}
    worker = threading.Thread(target=_post, args=(args.http_port, text, big))
    worker.start()
    health: list[float] = []
    while worker.is_alive():
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", args.http_port, timeout=600)
        conn.request("GET", "/health")
        conn.getresponse().read()
        health.append(time.perf_counter() - t0)
        time.sleep(0.1)
    worker.join()
    result = dict(mb=args.mb, chars=len(text), big_status=big.get("status"),
                  big_s=big.get("seconds"), health_polls=len(health),
                  health_worst_s=max(health, default=0.0),
                  health_p50_s=sorted(health)[len(health) // 2] if health else 0.0)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
