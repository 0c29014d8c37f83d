"""The engine in its own thread, so the server's event loop never waits on the device.

HTTP handlers hand requests to the thread through a queue and get each request's blocks back on an asyncio queue
of their own. The engine is only ever touched by its thread. `drain()` stops admitting (handlers answer 503) and
lets what runs finish.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import Any

from dllm_jax.engine.engine import Engine
from dllm_jax.engine.request import BlockOutput

log = logging.getLogger("dllm_jax.server")


class EngineService:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="dllm-jax-engine", daemon=True)
        self.draining = False
        self.failure: BaseException | None = None
        self._rate: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) of ~10 s
        self.latencies: list[tuple[float, float]] = []  # (time to first block, latency) of finished requests

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> "EngineService":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)

    def drain(self) -> None:
        """Stop admitting new requests; running and queued ones finish."""
        self.draining = True

    def idle(self) -> bool:
        return not self._streams and self._inbox.empty()

    # ---- requests ----------------------------------------------------------------------------------------------
    async def submit(self, prompt: list[int], config, affix: Any, seed: int) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns (request id, the queue its BlockOutputs arrive on). Raises what
        Engine.add_request raises (RequestError, QueueFull), before anything runs."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        stream: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", (prompt, config, affix, seed), loop, done, stream))
        rid = await done
        return rid, stream

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def tokens_per_second(self) -> float:
        now = time.perf_counter()
        while self._rate and now - self._rate[0][0] > 10.0:
            self._rate.popleft()
        return sum(n for _, n in self._rate) / 10.0

    # ---- the thread --------------------------------------------------------------------------------------------
    def _deliver(self, out: BlockOutput) -> None:
        loop_stream = self._streams.get(out.request_id)
        if loop_stream is not None:
            loop, stream = loop_stream
            loop.call_soon_threadsafe(stream.put_nowait, out)
        if out.finished:
            self._streams.pop(out.request_id, None)
            r = self.engine.request(out.request_id)
            if r.finish_time is not None and r.first_block_time is not None and out.finish_reason != "abort":
                self.latencies.append((r.first_block_time - r.arrival, r.finish_time - r.arrival))
            self.engine.release(out.request_id)

    def _handle(self, item) -> None:
        if item[0] == "abort":
            self.engine.abort(item[1])  # its final output reaches _deliver through on_block
            return
        _, (prompt, config, affix, seed), loop, done, stream = item
        try:
            rid = self.engine.add_request(prompt, config, affix=affix, seed=seed, on_block=self._deliver)
        except Exception as e:  # noqa: BLE001  the handler answers it (400, 429)
            loop.call_soon_threadsafe(_settle, done, None, e)
            return
        self._streams[rid] = (loop, stream)
        loop.call_soon_threadsafe(_settle, done, rid, None)

    def _run(self) -> None:
        while True:
            try:  # wait for work when idle; otherwise take what arrived during the last block, then step
                item = self._inbox.get(block=not self.engine.has_unfinished())
                while True:
                    if item is None:
                        return
                    self._handle(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001  the device failed: fail what runs, keep serving
                log.exception("engine step failed")
                self.failure = e
                for rid in list(self._streams):
                    self.engine.abort(rid)
                continue
            tokens = sum(len(o.tokens) for o in outs)
            if tokens:
                self._rate.append((time.perf_counter(), tokens))


def _settle(fut: asyncio.Future, value, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
