"""One replica of a cluster: the single-process server (`dllm-jax serve`'s engine, service and HTTP app, built
from the same flags) answering HTTP requests handed to it in-process (a Ray Serve replica has no socket of its
own: the ingress forwards each request's method, path, headers and body to it).

`ReplicaServer.request` runs the app's ASGI callable on one request and yields the response as it is written:
first its status and headers, then the body's chunks (a stream's server-sent events one by one), so streaming
answers stream through the ingress too. No Ray here: the Ray deployment (`app.Replica`) wraps this class.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from dllm_jax import cli
from dllm_jax.server.run import build_service

Header = tuple[str, str]


class ReplicaServer:
    """`dllm-jax serve` ARGS's server, in this process: the model loaded and the engine warming up in its own
    thread at once (GET /ready answers 200 once warm, as the single server's).

    Flags the model or machine refuse (a BiCache depth past the model's layers, a KV budget over the device's
    memory: what `serve` can only check once the model is loaded) do not raise: the replica keeps the one-line
    refusal in `refused` and answers every request with a 503 carrying it (GET /ready and /health as
    {"status": "failed", "error": ...}), so that `dllm-jax serve --replicas` can report it and exit 2 instead of
    Ray restarting the replica over and over."""

    def __init__(self, argv: Sequence[str] | argparse.Namespace, progress: bool = False):
        args = argv if isinstance(argv, argparse.Namespace) else cli.build_parser().parse_args(["serve", *argv])
        self.refused: str | None = None
        self.service = self.app = None
        try:
            parts = cli.serve_parts(args)
            try:
                self.service, self.app = build_service(
                    parts.model, parts.config, parts.settings, **{**parts.options, "progress": progress}
                )
            except ValueError as e:
                raise cli.engine_start_error(e, args) from None
        except cli.UsageError as e:
            self.refused = str(e)
            return
        self.service.start()

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()

    @property
    def warm(self) -> bool:
        """Whether this replica's engine has finished its warm-up (a refused one never does)."""
        return self.service is not None and bool(self.service.warmed)

    def alive(self) -> str | None:
        """None while this replica can serve (or refused its flags: that is reported, not restarted), else why
        not."""
        return None if self.service is None else self.service.alive()

    def _refusal(self, path: str) -> list[Any]:
        if path in ("/ready", "/health"):
            body: dict = {"status": "failed", "error": self.refused}
        else:
            body = {"error": {"message": self.refused, "type": "service_unavailable", "param": None, "code": None}}
        data = json.dumps(body).encode()
        return [{"status": 503, "headers": [("content-type", "application/json")]}, data]

    async def request(
        self, method: str, path: str, query: str = "", headers: Sequence[Header] = (), body: bytes = b""
    ) -> AsyncIterator[Any]:
        """Yields {"status": int, "headers": [(name, value)]}, then the body as bytes chunks."""
        if self.refused is not None:
            for part in self._refusal(path):
                yield part
            return
        sent: asyncio.Queue = asyncio.Queue()
        done = asyncio.Event()
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()  # the client is there until the answer is out
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await sent.put(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method.upper(),
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": query.encode(),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
            "state": {},
        }
        task = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            while True:
                getter = asyncio.ensure_future(sent.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the app returned without (more of) an answer
                    getter.cancel()
                    task.result()  # its exception, if it raised one
                    return
                message = getter.result()
                if message["type"] == "http.response.start":
                    yield {
                        "status": message["status"],
                        "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])],
                    }
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        return
        finally:
            done.set()
            if not task.done():
                task.cancel()
