"""Run the server: uvicorn on a socket bound here (so port 0 reports its real port) while the engine thread warms
up (GET /ready says when it serves; requests sent meanwhile wait), and a graceful exit: the first SIGTERM / SIGINT
stops admitting (new requests get 503), lets what runs finish, then exits (code 0); a second one, or
--drain-timeout running out, cuts the drain: every open request is answered at once (a 503 in OpenAI's shape; a
stream, that error event then [DONE]) and the process exits with 128 + the signal's number (a second signal) or
EXIT_DRAIN_TIMEOUT."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI

from dllm_jax.audit import AuditConfig, CalibrationConfig
from dllm_jax.compilation import enable_compile_cache
from dllm_jax.engine.engine import Engine, EngineConfig
from dllm_jax.server import logs
from dllm_jax.server.app import create_app
from dllm_jax.server.service import EngineService
from dllm_jax.server.settings import ADMISSION_WAIT, ServeSettings


class CompileCacheError(ValueError):
    """The compilation cache's directory cannot be made or written."""


EXIT_DRAIN_TIMEOUT = 3  # the exit code when --drain-timeout cut the drain
ANSWER_GRACE_S = 5.0  # at a cut: how long the open requests' final answers get to reach their clients


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: EngineService, drain_timeout: float | None = None):
        super().__init__(config)
        self.service = service
        self.drain_timeout = drain_timeout
        self._cut = threading.Event()

    def handle_exit(self, sig, frame) -> None:
        if self.service.draining:  # a second signal: answer what is open now, then exit
            self.cut(f"second signal: exiting now (code {128 + sig})", 128 + sig)
            return
        self.service.drain()
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def cut(self, why: str, code: int) -> None:
        """End the drain now: every open request answered (503), then exit with `code`. The process exits itself
        (uvicorn's graceful shutdown would wait for the open requests, then cancel them into tracebacks)."""
        if self._cut.is_set():
            return
        self._cut.set()
        print(f"dllm-jax serve: {why}: answering the open requests with 503", file=sys.stderr, flush=True)

        def end() -> None:
            self.service.abort_all()
            deadline = time.monotonic() + ANSWER_GRACE_S
            while self.service.open_answers and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)  # the answers' last bytes, written by the event loop
            os._exit(code)

        threading.Thread(target=end, daemon=True).start()

    def _exit_when_idle(self) -> None:
        """Wait for what runs and waits to finish, saying every few seconds how much is left; cut the drain when
        it outlasts drain_timeout."""
        last, start = 0.0, time.monotonic()
        while not self.service.idle():
            if self._cut.is_set():
                return
            if self.drain_timeout is not None and time.monotonic() - start > self.drain_timeout:
                self.cut(
                    f"the drain took over {self.drain_timeout:g} s (code {EXIT_DRAIN_TIMEOUT})", EXIT_DRAIN_TIMEOUT
                )
                return
            if time.monotonic() - last > 5.0:
                s = self.service.engine.stats()
                print(
                    f"dllm-jax serve: draining: {s['running']} running, {s['waiting']} waiting (a second Ctrl-C or "
                    "SIGTERM exits now)",
                    file=sys.stderr,
                    flush=True,
                )
                last = time.monotonic()
            time.sleep(0.05)
        self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    """A listening socket: connections made before uvicorn runs wait in its backlog instead of being refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def build_service(
    model,
    engine_config: EngineConfig,
    settings: ServeSettings,
    log_level: str = "warning",
    progress: bool = True,
    compile_cache: str | os.PathLike | None = None,
    max_consecutive_faults: int = 3,
    admission_wait: float = ADMISSION_WAIT,
    log_format: str = "text",
    audit: AuditConfig | None = None,
    calibration: CalibrationConfig | None = None,
) -> tuple[EngineService, FastAPI]:
    """The engine, its service (not started) and the HTTP app on it: what one `dllm-jax serve` process (`serve`) or
    one replica of a cluster (`dllm_jax.cluster`) runs. Raises KVBudgetError / CompileCacheError / ValueError for
    settings the model or machine refuse, before any device work."""
    engine = Engine(model, engine_config)  # a KV budget over the free memory is refused here
    if compile_cache is not None:  # jax-wide: turned on only once nothing else can refuse the start
        try:
            enable_compile_cache(compile_cache)
        except OSError as e:
            raise CompileCacheError(f"cannot use {compile_cache}: {e.strerror or e}") from None
    logs.configure(log_format, verbose=log_level == "info")
    service = EngineService(
        engine,
        progress=progress,
        max_consecutive_faults=max_consecutive_faults,
        admission_wait=admission_wait,
        audit=audit,
        calibration=calibration,
    )
    return service, create_app(service, settings)


def serve(
    model,
    engine_config: EngineConfig,
    settings: ServeSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    drain_timeout: float | None = None,
    **options,
) -> int:
    """Serve until a signal: the engine warms every program first (a progress bar on stderr when progress) while
    the socket already accepts. drain_timeout: seconds a drain may take before it is cut (None: as long as it
    takes). options: `build_service`'s: progress; compile_cache, jax's persistent compilation cache directory
    (None: off); max_consecutive_faults, failed device calls in a row after which GET /health answers 503;
    admission_wait, the fraction of a block call the next one may be held for new requests to take freed rows;
    log_format, "text" or "json" (JSON lines; log_level "info" adds a line per finished request and uvicorn's
    access log); audit, which requests served with an affix technique are also decoded exactly
    (`dllm_jax.audit`; GET /v1/audit reports it); calibration, how anchor_ratio and shallow_depth "auto" choose
    each affix's ratio or depth."""
    sock = bind(host, port)  # before anything slow: a taken port fails at once
    try:
        service, app = build_service(model, engine_config, settings, log_level=log_level, **options)
    except BaseException:
        sock.close()
        raise
    server = DrainingServer(
        uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=30),
        service,
        drain_timeout,
    )
    actual = sock.getsockname()[1]
    print(  # the first line on stderr (tests read the port from it), before the warm-up's bar
        f"dllm-jax serve: model {settings.model_name!r} at http://{host}:{actual}/v1, warming up "
        f"{service.programs} programs first (GET /ready: 200 once done; Ctrl-C or SIGTERM: finish what runs, then "
        "exit)",
        file=sys.stderr,
        flush=True,
    )
    service.start()
    try:
        server.run(sockets=[sock])
    finally:
        service.stop()
        sock.close()
    return 0
