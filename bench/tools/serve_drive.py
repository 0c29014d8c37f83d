"""How a bench_serve row's requests reach the engine: through the Python API (`drive`: a closed loop of
`concurrency`, or Poisson arrivals) or through `dllm-jax serve`'s app over HTTP (`http_drive`: uvicorn in a thread on
the warmed engine, the `openai` clients in processes of their own, `http_clients.py`). Items are bench_serve's
`Item`s (prompt, span, config, seed, http fields)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# package imports (re-point here when the package moves)
from dllm_jax.engine import Engine


def arrival_times(arrival: str, n: int) -> np.ndarray | None:
    """Poisson arrivals (seconds from the start) for "poisson_R", None for a closed loop. The same for every row."""
    if not arrival.startswith("poisson_"):
        return None
    return np.cumsum(np.random.default_rng(0).exponential(1.0 / float(arrival.split("_", 1)[1]), n))


def drive(engine: Engine, items: list, arrival: str, concurrency: int) -> dict:
    """Serve the items (closed loop of `concurrency`, or Poisson arrivals) through the Python API; times are taken
    where a caller sees them: a request's first block and last block when `step` returns them."""
    arrivals = arrival_times(arrival, len(items))
    t0 = time.perf_counter()
    submitted, done = 0, 0
    sent, first, last, tokens = {}, {}, {}, {}
    while done < len(items):
        now = time.perf_counter() - t0
        while submitted < len(items) and (
            submitted - done < concurrency if arrivals is None else arrivals[submitted] <= now
        ):
            it = items[submitted]
            rid = engine.add_request(it.prompt, it.config, affix=it.span, seed=it.seed)
            sent[rid] = time.perf_counter() if arrivals is None else t0 + arrivals[submitted]
            tokens[rid] = 0
            submitted += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[submitted] - now))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            tokens[o.request_id] += len(o.tokens)
            first.setdefault(o.request_id, t)
            if o.finished:
                last[o.request_id] = t
                done += 1
                engine.release(o.request_id)
    wall = time.perf_counter() - t0
    return timing(wall, sum(tokens.values()), [last[r] - sent[r] for r in sent], [first[r] - sent[r] for r in sent])


def timing(wall: float, tokens: int, latency: list[float], ttfb: list[float]) -> dict:
    return dict(
        seconds=wall,
        tokens=tokens,
        tokens_per_s=tokens / wall,
        p50_s=float(np.percentile(latency, 50)),
        p99_s=float(np.percentile(latency, 99)),
        ttfb_p50_s=float(np.percentile(ttfb, 50)),
        ttfb_p99_s=float(np.percentile(ttfb, 99)),
    )


class IdTokenizer:
    """What the server needs of a tokenizer, for random weights that have none: a token is its id as text."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]


def http_drive(
    engine: Engine, items: list, arrival: str, concurrency: int, admission_wait: float, audit_fraction: float
) -> dict:
    """The items through `dllm-jax serve`'s app (uvicorn in a thread on the warmed engine) from the openai
    client's async API in processes of their own (as clients are: in this one they would take the GIL from the
    engine thread and the server; bench/tools/http_clients.py), streaming (the first chunk is the first block): a
    closed loop of `concurrency`, or the arrival pattern's times."""
    import tempfile
    import threading

    import uvicorn

    from dllm_jax.audit import AuditConfig
    from dllm_jax.server import EngineService, ServeSettings, create_app
    from dllm_jax.server.run import bind

    calls, arrived = [], {}  # call start times; each request's arrival (the engine's clock)

    def record(ids: list[str]) -> None:  # Engine.before_call: when each call starts, and who arrived when
        calls.append(time.perf_counter())
        for rid in ids:
            arrived.setdefault(rid, engine.request(rid).arrival)

    engine.before_call = record
    audit = AuditConfig(fraction=audit_fraction)  # serve's --audit-fraction (its shadows run beside the users)
    service = EngineService(engine, admission_wait=admission_wait, audit=audit).start()  # warm: serves at once
    app = create_app(service, ServeSettings(model_name="bench"))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "clients.json"
        spec.write_text(
            json.dumps(
                dict(
                    url=url,
                    concurrency=concurrency,
                    items=[[it.prompt, it.http] for it in items],
                    arrivals=None if (times := arrival_times(arrival, len(items))) is None else times.tolist(),
                )
            )
        )
        try:
            cmd = [sys.executable, str(Path(__file__).resolve().parent / "http_clients.py"), str(spec)]
            subprocess.run(cmd, check=True, timeout=1800)
        finally:
            server.should_exit = True
            thread.join(30)
            service.stop()
        wall, out = json.loads(spec.read_text())["result"]
    engine.before_call = None
    row = timing(wall, sum(o[0] for o in out), [o[1] for o in out], [o[2] for o in out])
    waits = dict(admission_wait=admission_wait, **{f"admission_waits_{k}": v for k, v in service.waits.items()})
    report = service.auditor.report() if service.auditor is not None else {}
    audited = dict(audit_fraction=audit_fraction, audit_shadows=report.get("shadows_finished", 0))
    return {**row, **arrival_offsets(calls, list(arrived.values())), **waits, **audited}


def arrival_offsets(calls: list[float], arrivals: list[float]) -> dict:
    """How far into a running device call requests arrived (ms), for those that arrived while one ran: near 0, the
    next call started just before they came; near a call's length, they came just before it ended. Calls are
    every `before_call` (a stored affix's own forward too); a block call's mean length is block_device_s /
    block_calls."""
    starts = np.asarray(calls)
    lengths = np.diff(starts)
    offsets = []
    for t in arrivals:
        k = int(np.searchsorted(starts, t)) - 1  # the last call that started before the arrival
        if 0 <= k < len(lengths) and t - starts[k] < lengths[k]:
            offsets.append((t - starts[k]) * 1e3)
    if not offsets:
        return dict(arrived_in_call=0)
    q = np.percentile(offsets, [10, 50, 90])
    return dict(
        arrived_in_call=len(offsets),
        arrival_offset_ms_p10=q[0],
        arrival_offset_ms_p50=q[1],
        arrival_offset_ms_p90=q[2],
    )
