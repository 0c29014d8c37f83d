"""Run the server: the engine thread, the app, uvicorn on a socket bound here (so port 0 reports its real port),
and a graceful exit: the first SIGTERM / SIGINT stops admitting (new requests get 503), lets what runs finish,
then exits; a second one exits at once."""

from __future__ import annotations

import socket
import sys
import threading
import time

import uvicorn

from dllm_jax.engine.engine import Engine, EngineConfig
from dllm_jax.io.loading import generation_defaults
from dllm_jax.server.app import ServeSettings, create_app
from dllm_jax.server.service import EngineService


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: EngineService):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        if self.service.draining:  # a second signal: stop now
            return super().handle_exit(sig, frame)
        self.service.drain()
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def _exit_when_idle(self) -> None:
        while not self.service.idle():
            time.sleep(0.05)
        self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(
    model,
    engine_config: EngineConfig,
    settings: ServeSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
) -> int:
    sock = bind(host, port)  # before anything slow: a taken port fails at once
    try:
        engine = Engine(model, engine_config)  # a KV budget over the free memory is refused here
    except ValueError:
        sock.close()
        raise
    service = EngineService(engine).start()
    app = create_app(service, settings, generation_defaults(model.path))
    server = DrainingServer(
        uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=30), service
    )
    actual = sock.getsockname()[1]
    print(
        f"dllm-jax serve: model {settings.model_name!r} at http://{host}:{actual}/v1 (Ctrl-C or SIGTERM: finish "
        "what runs, then exit)",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        service.stop()
        sock.close()
    return 0
