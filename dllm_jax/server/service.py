"""The engine in its own thread, so the server's event loop never waits on the device.

HTTP handlers hand requests to the thread through a queue and get each request's blocks back on an asyncio queue
of their own. The engine is only ever touched by its thread. The thread first warms the engine (compiles every
program its settings allow), then serves: requests that arrive meanwhile wait in the queue. `drain()` stops
admitting (handlers answer 503) and lets what runs finish.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from dllm_jax.audit import SHADOW, AuditConfig, Auditor, CalibrationConfig
from dllm_jax.engine.engine import Engine
from dllm_jax.engine.request import BlockOutput
from dllm_jax.server.settings import ADMISSION_WAIT

log = logging.getLogger("dllm_jax.server")
LATENCIES_KEPT = 65536  # finished requests' timings waiting for /metrics (older ones are dropped, unobserved)
# holds judged by their latest HOLDS_JUDGED: when fewer than 2 of them saw any arrival (open traffic that does not
# answer finished requests with new ones), only every HOLDS_JUDGED-th is held, to notice such clients coming back
HOLDS_JUDGED = 8


class ServiceUnavailable(RuntimeError):
    """The engine cannot serve (its warm-up failed or its thread stopped): the handler answers 503."""


class EngineService:
    """warmup: compile every program before serving (skipped if the engine is already warm); progress: its tqdm
    bar on stderr; max_consecutive_faults: failed device calls in a row after which the service is not alive (each
    fails only its own requests, see Engine; repeated ones mean the device is gone). admission_wait: after a block
    call that finished requests, hold the next call up to this fraction of the last call's seconds for new requests
    to take the freed rows (ends as soon as they are taken): a client that sends its next request on an answer
    arrives a few ms after the next call started, and would otherwise wait that whole call. 0: never hold.
    audit: which requests served with an affix technique are also decoded exactly, in the rows and pages users leave
    (`dllm_jax.audit`; None: none); calibration: how anchor_ratio="auto" and shallow_depth="auto" choose a
    ratio or depth per affix."""

    def __init__(
        self,
        engine: Engine,
        warmup: bool = True,
        progress: bool = False,
        max_consecutive_faults: int = 3,
        admission_wait: float = ADMISSION_WAIT,
        audit: AuditConfig | None = None,
        calibration: CalibrationConfig | None = None,
    ):
        if not 0 <= admission_wait <= 1:
            raise ValueError(f"admission_wait={admission_wait} must be a fraction of a call in [0, 1]")
        self.engine = engine
        self.admission_wait = admission_wait
        self.auditor = Auditor(engine, audit or AuditConfig(fraction=0.0), calibration)
        # holds of the next call for arrivals: how many, their seconds, the requests they took in
        self.waits = dict(count=0, seconds=0.0, admitted=0)
        self._held_for = collections.deque(maxlen=HOLDS_JUDGED)  # whether each of the latest holds saw an arrival
        self._passed = 0  # holds passed over since the latest ones stopped seeing arrivals
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="dllm-jax-engine", daemon=True)
        self._progress = progress
        self.max_consecutive_faults = max_consecutive_faults
        self.warmed = not warmup or engine.warmed
        self.programs = engine.program_count()  # known before warming: /ready reports it
        self.warmup_started: float | None = None
        self.draining = False
        self.cutting = False  # abort_all was called: what comes in now is refused
        self.open_answers = 0  # HTTP answers being written (the event loop's count: a cut waits for them)
        self.failure: BaseException | None = None  # the last failed step (the service goes on serving)
        self.fatal: str | None = None  # why the engine cannot serve at all (/health answers 503 with it)
        self._rate: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) of ~10 s
        # (time to first block, latency) of the latest finished requests: bounded, read by /metrics
        self.latencies: collections.deque[tuple[float, float]] = collections.deque(maxlen=LATENCIES_KEPT)
        self.finished_count = 0  # every request that ever finished (the deque keeps the latest)
        self._latency_lock = threading.Lock()

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> "EngineService":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)
        self.auditor.close()

    def drain(self) -> None:
        """Stop admitting new requests; running and queued ones finish."""
        self.draining = True

    def idle(self) -> bool:
        return not self._streams and self._inbox.empty()

    def alive(self) -> str | None:
        """None while the engine thread runs and can serve, else why not."""
        if self.fatal is not None:
            return self.fatal
        if self._thread.ident is not None and not self._thread.is_alive():
            return "the engine thread stopped"
        if self.engine.consecutive_faults >= self.max_consecutive_faults:
            return f"{self.engine.consecutive_faults} device calls failed in a row, the last: {self.engine.last_fault}"
        return None

    def readiness(self) -> dict:
        """{"status": "ready" | "warming" | "draining" | "failed", ...}: what GET /ready answers."""
        reason = self.alive()
        if reason is not None:
            return {"status": "failed", "error": reason}
        if self.draining:
            return {"status": "draining"}
        if not self.warmed:
            started = self.warmup_started
            seconds = 0.0 if started is None else time.perf_counter() - started
            return {"status": "warming", "programs": self.programs, "seconds": round(seconds, 1)}
        return {"status": "ready"}

    # ---- requests ----------------------------------------------------------------------------------------------
    async def submit(
        self,
        prompt: list[int],
        config,
        affix: Any,
        seed: int,
        timeout: float | None = None,
        request_id: str | None = None,
        auto: str | None = None,
    ) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns (its engine id, the queue its BlockOutputs arrive on). Raises what
        Engine.add_request raises (RequestError, QueueFull), before anything runs. timeout: seconds from now;
        request_id: the engine's id for it (the client's X-Request-Id: its log lines name it), unless one open
        request has it already (then the engine makes one). auto: "anchors" (anchor_ratio="auto") or "shallow"
        (shallow_depth="auto"): the technique and its level are the calibrator's for the request's affix
        (`dllm_jax.audit.Calibrator`; exact while it calibrates)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        stream: asyncio.Queue = asyncio.Queue()
        args = (prompt, config, affix, seed, timeout, request_id, time.perf_counter(), auto)
        self._inbox.put(("add", args, loop, done, stream))
        try:
            rid = await done
        except asyncio.CancelledError:  # the handler left just after its request was taken in: nobody reads it
            if done.done() and not done.cancelled() and done.exception() is None:
                self.abort(done.result())
            raise
        return rid, stream

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """fn(engine) run on the engine thread (the only one that touches the engine), between its steps."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._inbox.put(("call", fn, loop, done))
        return await done

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def abort_all(self) -> None:
        """End every open request now: its handler is told at once (it answers 503), without waiting for the
        engine thread's current device call; the engine frees their pages after it. Those not yet taken in are
        refused."""
        self.draining = self.cutting = True
        for rid, (loop, stream) in list(self._streams.items()):
            try:
                loop.call_soon_threadsafe(stream.put_nowait, BlockOutput(rid, -1, [], True, "abort"))
            except RuntimeError:  # the event loop closed
                pass
        for item in list(self._inbox.queue):  # submitted, not yet taken in: refused now (again later: a no-op)
            if item is not None and item[0] == "add":
                _, _, loop, done, _ = item
                try:
                    loop.call_soon_threadsafe(_settle, done, None, ServiceUnavailable("the server is shutting down"))
                except RuntimeError:
                    pass
        self._inbox.put(("abort_all",))

    def latencies_since(self, seen: int) -> tuple[list[tuple[float, float]], int]:
        """The timings of requests finished after the first `seen` (those still kept), and the new count."""
        with self._latency_lock:
            new = min(self.finished_count - seen, len(self.latencies))
            return list(self.latencies)[len(self.latencies) - new :], self.finished_count

    def submitted_waiting(self) -> int:
        """Requests handed to the engine thread that it has not taken in yet (a burst while a block runs)."""
        return sum(1 for item in list(self._inbox.queue) if item is not None and item[0] == "add")

    def tokens_per_second(self) -> float:
        now = time.perf_counter()
        while self._rate and now - self._rate[0][0] > 10.0:
            self._rate.popleft()
        return sum(n for _, n in self._rate) / 10.0

    # ---- the thread --------------------------------------------------------------------------------------------
    def _deliver(self, out: BlockOutput) -> None:
        self.auditor.observe(out)  # first: the record is released below once finished
        loop_stream = self._streams.get(out.request_id)
        if loop_stream is not None:
            loop, stream = loop_stream
            try:
                loop.call_soon_threadsafe(stream.put_nowait, out)
            except RuntimeError:  # the event loop closed (the server exits at a second signal): nobody to tell
                pass
        if out.finished:
            self._streams.pop(out.request_id, None)
            r = self.engine.request(out.request_id)
            if r.finish_time is not None and r.first_block_time is not None and out.finish_reason != "abort":
                with self._latency_lock:
                    self.latencies.append((r.first_block_time - r.arrival, r.finish_time - r.arrival))
                    self.finished_count += 1
            self.engine.release(out.request_id)

    def _handle(self, item) -> None:
        if item[0] == "abort":
            self.engine.abort(item[1])  # its final output reaches _deliver through on_block
            return
        if item[0] == "abort_all":
            for rid in list(self._streams):
                self.engine.abort(rid)
            return
        if item[0] == "call":
            _, fn, loop, done = item
            try:
                loop.call_soon_threadsafe(_settle, done, fn(self.engine), None)
            except Exception as e:  # noqa: BLE001  the caller answers it
                loop.call_soon_threadsafe(_settle, done, None, e)
            return
        if self.cutting:  # submitted before the cut, taken in after: refused
            _, _, loop, done, _ = item
            loop.call_soon_threadsafe(_settle, done, None, ServiceUnavailable("the server is shutting down"))
            return
        _, (prompt, config, affix, seed, timeout, request_id, arrival, auto), loop, done, stream = item
        if done.cancelled():  # its handler left (the client went away) while it waited here: nobody would read it
            return
        if request_id in self._streams:  # a client reusing an id while its first request runs
            request_id = None
        calibrate = None
        try:
            if auto is not None:  # the level the calibrator holds for the request's affix (exact while it calibrates)
                planned = self.engine.plan_request(prompt, config, affix, remember=False)
                if planned.affix_span is not None:
                    technique, calibrate = self.auditor.resolve_auto(planned, auto)
                    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, affix=technique))
            rid = self.engine.add_request(
                prompt,
                config,
                affix=affix,
                seed=seed,
                on_block=self._deliver,
                timeout=timeout,
                request_id=request_id,
                arrival=arrival,
            )
        except Exception as e:  # noqa: BLE001  the handler answers it (400, 429)
            loop.call_soon_threadsafe(_settle, done, None, e)
            return
        self._streams[rid] = (loop, stream)
        self.auditor.consider(self.engine.request(rid), seed, calibrate=calibrate, auto=auto is not None)
        loop.call_soon_threadsafe(self._accepted, done, rid)

    def _accepted(self, done: asyncio.Future, rid: str) -> None:
        """On the handler's event loop: its request was taken in as `rid`; aborted if the handler left meanwhile."""
        if done.cancelled():
            self.abort(rid)
        else:
            _settle(done, rid, None)

    def _run(self) -> None:
        try:
            if self.warmed or self._warm():
                self._serve()
                return
        except BaseException as e:  # noqa: BLE001  a bug in the loop: /health says so rather than hanging clients
            log.exception("the engine thread stopped")
            self.fatal = f"the engine thread stopped: {type(e).__name__}: {e}"
            for rid, (loop, stream) in list(self._streams.items()):  # their handlers answer 503
                loop.call_soon_threadsafe(stream.put_nowait, BlockOutput(rid, -1, [], True, "abort"))
            self._streams.clear()
        self._refuse()

    def _warm(self) -> bool:
        self.warmup_started = time.perf_counter()
        try:
            info = self.engine.warmup(progress=self._progress)
        except Exception as e:  # noqa: BLE001  nothing can be served: refuse what waits and what comes
            log.exception("warm-up failed")
            self.fatal = f"warm-up failed: {type(e).__name__}: {e}"
            return False
        self.warmed = True
        log.info(
            "warmed up %d programs in %.1f s (%d XLA compiles; fewer where the compilation cache had them)",
            info["programs"],
            info["seconds"],
            info["compiles"],
        )
        return True

    def _refuse(self) -> None:
        """After a fatal error: answer every request (queued or to come) ServiceUnavailable until stop()."""
        while True:
            item = self._inbox.get()
            if item is None:
                return
            if item[0] in ("add", "call"):  # both carry (kind, what, loop, future, ...)
                _, _, loop, done, *_ = item
                loop.call_soon_threadsafe(_settle, done, None, ServiceUnavailable(self.fatal))

    def _serve(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self.auditor.admit()  # the users left room: audits waiting for it start
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
                self.auditor.admit()  # shadow requests take only the rows and pages users leave
                t0 = time.perf_counter()
                outs = self.engine.step()
                call_seconds = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001  a bug outside the device calls (the engine fails those itself)
                log.exception("engine step failed")
                self.failure = e
                for rid in list(self._streams):
                    self.engine.abort(rid)
                continue
            outs = [o for o in outs if not o.request_id.startswith(SHADOW)]  # the users' outputs
            tokens = sum(len(o.tokens) for o in outs)
            if tokens:
                self._rate.append((time.perf_counter(), tokens))
            freed = sum(1 for o in outs if o.finished)
            if freed and not self._hold(freed, call_seconds):
                return

    def _hold(self, freed: int, call_seconds: float) -> bool:
        """Right after a call that finished `freed` requests: hold the next one up to admission_wait x call_seconds
        while rows are open and requests run, taking in what arrives, until `freed` requests came (the successors
        of those it finished; what arrived during the call counts). False: stop was asked."""
        engine = self.engine
        if not self.admission_wait or self.draining or not engine.has_unfinished() or not engine.open_rows():
            return True
        if len(self._held_for) == HOLDS_JUDGED and sum(self._held_for) < 2:
            self._passed += 1
            if self._passed % HOLDS_JUDGED:
                return True
        else:
            self._passed = 0
        t0 = time.perf_counter()
        deadline = t0 + self.admission_wait * call_seconds
        since = engine.counters["requests"]  # what came during the call is in the inbox still: taken in below
        waited_at = None  # the request count when the hold first had to wait
        while engine.counters["requests"] - since < freed and engine.open_rows() and engine.has_unfinished():
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:  # nothing came yet: wait for it, up to the deadline
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                if waited_at is None:
                    waited_at = engine.counters["requests"]
                try:
                    item = self._inbox.get(timeout=left)
                except queue.Empty:
                    break
            if item is None:
                return False
            self._handle(item)
        if waited_at is not None:  # a hold: the next call waited, and for these arrivals
            came = engine.counters["requests"] - waited_at
            self.waits["count"] += 1
            self.waits["seconds"] += time.perf_counter() - t0
            self.waits["admitted"] += came
            self._held_for.append(came > 0)
        return True


def _settle(fut: asyncio.Future, value, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
