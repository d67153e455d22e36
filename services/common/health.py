"""The containers' health check: `python -m services.common.health ROLE` exits 0 once the
service ROLE (gateway | verifier | drafter) on this host reports SERVING, else 1.

It reads what the service itself reads: the port from `SPECSERVE_{ROLE}_PORT` and TLS from the
`SPECSERVE_TLS_*` variables (a service under TLS is dialed over TLS, presenting its own
certificate: docker/compose.secure.yml), so one command serves plain and secured deployments.
"""

from __future__ import annotations

import asyncio
import os
import sys

from services.common.security import Security
from services.common.server import wait_serving

ROLES = ("gateway", "verifier", "drafter")


def check(role: str, timeout_s: float = 5.0, environ=None) -> None:
    """Raise TimeoutError unless ROLE's port on 127.0.0.1 is SERVING within `timeout_s`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    env = os.environ if environ is None else environ
    port = env.get(f"SPECSERVE_{role.upper()}_PORT")
    if not port:
        raise ValueError(f"SPECSERVE_{role.upper()}_PORT is not set")
    asyncio.run(wait_serving(f"127.0.0.1:{port}", f"specserve.v1.{role.capitalize()}",
                             timeout_s, Security.from_env(env)))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m services.common.health {{{','.join(ROLES)}}}", file=sys.stderr)
        return 2
    try:
        check(argv[0])
    except (TimeoutError, ValueError) as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
