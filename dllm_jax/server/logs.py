"""The server's log lines: each names the request it is about (the client's X-Request-Id, or one made for it), as
text or as JSON lines (`dllm-jax serve --log-format json`) for log collectors."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time

# the request an HTTP handler is serving (set by the app's middleware; log records made in its task carry it)
current_request: contextvars.ContextVar[str | None] = contextvars.ContextVar("dllm_jax_request_id", default=None)
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # what a client's X-Request-Id may be (else one is made)
REQUESTS = logging.getLogger("dllm_jax.server.requests")  # one line per finished request (INFO: --verbose)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, request_id, the extra fields a line
    was logged with (`extra=`), and the traceback where there is one."""

    STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "request_id"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        out.update({k: v for k, v in vars(record).items() if k not in self.STANDARD})
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(fmt: str = "text", verbose: bool = False) -> None:
    """The package's log lines on stderr (once): text ("dllm-jax serve: LEVEL: message [request id]") or JSON
    lines; verbose: one line per finished request too."""
    root = logging.getLogger("dllm_jax")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("dllm-jax serve: %(levelname)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    REQUESTS.setLevel(logging.INFO if verbose else logging.WARNING)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [{rid}]" if rid else line
