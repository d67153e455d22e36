"""The gateway's configuration: `GatewayConfig`, whose fields carry their flags
(services/common/settings.py), so `specserve serve gateway --help` is this table."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.convert import MAX_STOP_BYTES, MAX_STOP_STRINGS
from services.common.security import Security, security_field
from services.common.server import MAX_MESSAGE_BYTES, MiB
from services.common.settings import (
    DEFAULT_HOST,
    GATEWAY_METRICS_PORT,
    GATEWAY_PORT,
    HTTP_PORT,
    VERIFIER_PORT,
    check_port,
    flag_field,
    generation_config_field,
    grace_field,
    host_field,
    metrics_port_field,
    port_field,
    port_file_field,
)
from services.gateway.replicas import parse_addresses
from specserve.config import check_choice
from specserve.models.generation_config import GENERATION_CONFIG

MIN_MESSAGE_BYTES = 1024


def port_or_off(raw: str) -> int | None:
    """A port number, or "off" (None)."""
    return None if str(raw).lower() == "off" else int(raw)


port_or_off.__name__ = "port or off"


def origins(raw: str | tuple[str, ...]) -> tuple[str, ...]:
    """Comma-separated browser origins ('*': any); ValueError for one that is not an origin."""
    items = raw if isinstance(raw, tuple) else str(raw).split(",")
    out = tuple(o.strip().rstrip("/") for o in items if o.strip())
    for o in out:
        scheme, _, rest = o.partition("://")
        if o != "*" and (scheme not in ("http", "https") or not rest or "/" in rest):
            raise ValueError(f"--allowed-origins: {o[:80]!r} is not an origin (scheme://host"
                             "[:port], or *)")
    return out


@dataclass(frozen=True)
class GatewayConfig:
    model: str = flag_field(  # directory holding the target's tokenizer.json
        "--model", "SPECSERVE_MODEL", "target model directory (its tokenizer.json)",
        cli_default=None)
    verifier: str = flag_field("--verifier", "SPECSERVE_VERIFIER_ADDR",
                               "verifier address HOST:PORT, or several comma-separated "
                               "(replicas: each request goes to the least-loaded healthy one)",
                               default=f"{DEFAULT_HOST}:{VERIFIER_PORT}")
    host: str = host_field()
    port: int = port_field("SPECSERVE_GATEWAY_PORT", GATEWAY_PORT)
    port_file: str | None = port_file_field()
    max_message_bytes: int = flag_field(
        "--max-message-mb", "SPECSERVE_MAX_MESSAGE_MB",
        "largest request message accepted, MiB (larger: RESOURCE_EXHAUSTED)",
        default=MAX_MESSAGE_BYTES, type=int, cli_default=MAX_MESSAGE_BYTES // MiB,
        parse=lambda mb: mb * MiB)
    request_timeout_s: float = flag_field(  # verifier deadline when the client sets none
        "--request-timeout-s", "SPECSERVE_REQUEST_TIMEOUT_S",
        "verifier deadline for requests whose client set none", default=600.0, type=float)
    grace_s: float = grace_field("seconds to drain in-flight requests on SIGTERM")
    metrics_port: int = metrics_port_field("SPECSERVE_GATEWAY_METRICS_PORT",
                                           GATEWAY_METRICS_PORT)
    health_period_s: float = 0.5  # how often the verifier's health is checked
    max_stop_strings: int = flag_field(  # a request's stop list: how many strings
        "--max-stop-strings", "SPECSERVE_MAX_STOP_STRINGS",
        "most stop strings per request (more: INVALID_ARGUMENT)", default=MAX_STOP_STRINGS,
        type=int)
    max_stop_bytes: int = flag_field(  # and their UTF-8 bytes in all
        "--max-stop-bytes", "SPECSERVE_MAX_STOP_BYTES",
        "most UTF-8 bytes of a request's stop strings in all (more: INVALID_ARGUMENT)",
        default=MAX_STOP_BYTES, type=int)
    # TLS / token of this port; TLS to and token for the verifier
    generation_config: str = generation_config_field()  # auto | none
    security: Security = security_field()
    http_port: int | None = flag_field(  # the OpenAI HTTP API (None: not served)
        "--http-port", "SPECSERVE_GATEWAY_HTTP_PORT",
        "OpenAI-compatible HTTP API port (0 = any free, off = none)", default=HTTP_PORT,
        type=port_or_off)
    http_port_file: str | None = flag_field(
        "--http-port-file", None,
        "write the HTTP API's bound port here (useful with --http-port 0)", default=None)
    allowed_origins: tuple[str, ...] = flag_field(  # CORS: () = no browser origin
        "--allowed-origins", "SPECSERVE_ALLOWED_ORIGINS",
        "browser origins that may call the HTTP API (CORS), comma-separated, e.g. "
        "http://localhost:3000; * = any (default: none)", default=(), type=str, parse=origins)
    served_model_name: str | None = flag_field(  # None: the model directory's name
        "--served-model-name", "SPECSERVE_SERVED_MODEL_NAME",
        "model id of the HTTP API (default: the model directory's name)", default=None)

    @property
    def verifiers(self) -> tuple[str, ...]:
        return parse_addresses(self.verifier)

    def __post_init__(self) -> None:
        check_choice("generation_config", self.generation_config, GENERATION_CONFIG)
        if not self.model:
            raise ValueError("model must name a directory with tokenizer.json "
                             "(--model or SPECSERVE_MODEL)")
        parse_addresses(self.verifier)  # ValueError: not HOST:PORT[,HOST:PORT...]
        for name in ("port", "http_port", "metrics_port"):
            check_port(name, getattr(self, name))
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must be non-empty when given")
        if not MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"--max-message-mb must be in [1, {MAX_MESSAGE_BYTES // MiB}] "
                             f"(MiB), got {self.max_message_bytes / MiB:g}")
        if self.request_timeout_s <= 0 or self.grace_s < 0:
            raise ValueError("request_timeout_s must be > 0 and grace_s >= 0")
        if not self.health_period_s > 0:
            raise ValueError(f"health_period_s must be > 0, got {self.health_period_s}")
        if self.max_stop_strings < 0 or self.max_stop_bytes < 0:
            raise ValueError(f"max_stop_strings and max_stop_bytes must be >= 0, got "
                             f"{self.max_stop_strings} and {self.max_stop_bytes}")
