"""The Ray Serve application of `dllm-jax serve --replicas N`: N `Replica` deployments (each one engine server,
`replica.ReplicaServer`, on its own device) behind one `Ingress` (a FastAPI app on Ray's HTTP proxy, no model).

The ingress forwards every HTTP request as it is (method, path, headers, body) and streams the answer back,
adding an `x-dllm-replica` header that names the replica that answered. Requests to /v1/completions and
/v1/chat/completions carry their routing key (`routing.request_route_key`), which `AffixRouter`, the replicas'
Ray Serve request router, turns into a replica by `routing.RoutingRule`: the key's owner unless its queue is at
`spill_queue`, else the least loaded. Affix registrations (POST / DELETE /v1/affixes) go to every replica (an
affix's id is a content key, the same on each); GET /health and /ready answer 200 only when every replica does.
A request whose replica died before its whole plain answer (or before an event stream's first part) is sent once
more (Ray restarts the replica).

No `from __future__ import annotations` here: FastAPI reads the route's parameter types at run time.
"""

import argparse
import functools
import json
import os
from typing import Any, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from dllm_jax.cluster.replica import ReplicaServer
from dllm_jax.cluster.routing import RoutingRule, request_route_key

REPLICA_HEADER = "x-dllm-replica"
REPLICAS_HEADER = "x-dllm-replicas"  # a broadcast's answer: every replica that answered, in order
ROUTED = ("/v1/completions", "/v1/chat/completions")
BROADCAST = "/v1/affixes"  # and its sub-paths
ALL_MUST_ANSWER = ("/health", "/ready")
METRICS = "/metrics"  # every replica's, each sample labelled with its replica
AUDIT = "/v1/audit"  # every replica's, summed, each group and calibration naming its replica
AUDIT_COUNTS = (
    "audited shadows shadows_finished dropped skipped incomplete shadow_tokens shadow_abort shadow_error pending"
).split()
# how often Ray pulls each replica's routing stats (its warm flag): a restarted replica takes routed requests within
# about this long of finishing its warm-up (Ray's default, 10 s, would leave it idle that long)
ROUTING_STATS_PERIOD_S = 1.0
HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}


class AffixRouter(RequestRouter):
    """Ray Serve's request router for the replicas: `RoutingRule` on each request's `route_key`, with the queue
    lengths Ray's router keeps per replica (requests sent and not yet answered); a `replica_index` names one
    replica of the sorted live ones instead (the ingress's broadcasts).

    Why Ray's request-router extension point (`RequestRouter`, public since Ray 2.4x) rather than a router of our
    own in the ingress: Ray keeps the live replica set, the queue lengths, retries and backoff, and restarts, so the
    routing is only the choice. Why not Ray's own routers: `PrefixCacheAffinityRouter` matches token prefixes of
    the prompt text, which misses an affix placed after the question (ACache serves any placement) and cannot use
    a registered id; the experimental consistent-hash router has no spill past a busy owner."""

    # a replica compiling its programs (XLA holds the GIL for long stretches) answers Ray's queue-length probes late:
    # Ray's 0.1 s deadline would skip it, and a broadcast that must reach it would spin on the probe
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 10.0

    def initialize_state(self, spill_queue: int = 8, affinity: bool = True) -> None:
        self.rule = RoutingRule(spill_queue=spill_queue, affinity=affinity)
        self.turn = 0

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:  # back off between rounds (else a replica that cannot take the request now
            pending_request.routing_context.should_backoff = True  # makes Ray's retry loop spin)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        index = kwargs.get("replica_index")
        if index is not None:
            ids = sorted(by_id)
            return [[by_id[ids[index % len(ids)]]]]
        cache = self.replica_queue_len_cache
        queues = {rid: cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        # `Replica.record_routing_stats`, as Ray's controller last pulled it: none yet counts as warming
        warming = [rid for rid, r in by_id.items() if not (r.routing_stats or {}).get("warm")]
        self.turn += 1
        chosen, _ = self.rule.choose(kwargs.get("route_key"), queues, self.turn, warming)
        return [[by_id[chosen]], [r for rid, r in by_id.items() if rid != chosen]]


async def _answer(stream) -> tuple[dict, List[bytes]]:
    """The head and the whole body of a replica's streamed answer."""
    head, chunks = None, []
    async for part in stream:
        if isinstance(part, dict):
            head = part
        else:
            chunks.append(part)
    return head, chunks


async def _parts(head: dict, body: Any):
    yield head
    yield json.dumps(body).encode()


class Replica:
    """One engine server (`dllm-jax serve`'s, from its parsed flags) as a Ray Serve replica."""

    def __init__(self, args: argparse.Namespace):
        self.server = ReplicaServer(args)
        self.name = serve.get_replica_context().replica_id.unique_id

    async def request(
        self,
        method: str,
        path: str,
        query: str,
        headers: List[Any],
        body: bytes,
        route_key: Optional[str] = None,
        replica_index: Optional[int] = None,
    ):
        """The answer as `ReplicaServer.request` yields it, this replica named in its headers (route_key and
        replica_index are read by the router)."""
        answer = self.server.request(method, path, query, headers, body)
        if path in ALL_MUST_ANSWER:  # the ingress lists every replica's: say which one this is, and its process
            head, chunks = await _answer(answer)
            state = {**json.loads(b"".join(chunks)), "replica": self.name, "pid": os.getpid()}
            answer = _parts({**head, "headers": [h for h in head["headers"] if h[0] != "content-length"]}, state)
        async for part in answer:
            if isinstance(part, dict):
                part = {**part, "headers": [*part["headers"], (REPLICA_HEADER, self.name)]}
            yield part

    def record_routing_stats(self) -> dict:
        """What the router reads of this replica (Ray pulls it every `ROUTING_STATS_PERIOD_S`): whether it is warm."""
        return {"warm": self.server.warm}

    def check_health(self) -> None:
        """Ray restarts a replica whose engine cannot serve (its thread died or its faults ran over the limit)."""
        reason = self.server.alive()
        if reason is not None:
            raise RuntimeError(f"engine replica cannot serve: {reason}")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


api = FastAPI(title="dllm-jax cluster ingress", docs_url=None, redoc_url=None, openapi_url=None)


def _headers(head: dict) -> dict:
    """A replica's answer headers as the ingress sends them (Ray's proxy adds the request id itself)."""
    return {k: v for k, v in head["headers"] if k.lower() not in HOP_BY_HOP and k.lower() != "x-request-id"}


def merge_metrics(texts: List[tuple]) -> str:
    """Prometheus text of several replicas, [(replica, text)], as one: each family's HELP and TYPE once, then
    every replica's samples of it, each labelled with its `replica`."""
    meta, samples = {}, {}
    for replica, text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                meta.setdefault(family, {}).setdefault(line.split(" ", 2)[1], line)
                samples.setdefault(family, [])
            elif line.strip() and not line.startswith("#"):
                samples.setdefault(family, []).append(_labelled(line, replica))
    return "".join("\n".join([*meta.get(f, {}).values(), *lines]) + "\n" for f, lines in samples.items())


def merge_audit(reports: List[tuple]) -> dict:
    """Every replica's GET /v1/audit, [(replica, report)], as one report of the same shape: the counts summed, the
    groups and calibrations of each replica listed with a `replica` field (each replica audits and calibrates the
    affixes it serves: with affix routing, mostly its own)."""
    merged = dict(reports[0][1])
    for key in AUDIT_COUNTS:
        merged[key] = sum(r.get(key, 0) for _, r in reports)
    for key in ("groups", "calibration"):
        merged[key] = [{**row, "replica": replica} for replica, r in reports for row in r.get(key, [])]
    return merged


def _labelled(sample: str, replica: str) -> str:
    head, value = sample.rsplit(" ", 1)  # the exporter writes no timestamps
    label = f'replica="{replica}"'
    if not head.endswith("}"):
        return f"{head}{{{label}}} {value}"
    name, labels = head.split("{", 1)
    return f"{name}{{{label}{'' if labels == '}' else ','}{labels} {value}"


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


STREAM_LOST = (
    b'data: {"error": {"message": "the replica serving this stream stopped; send the request again", '
    b'"type": "server_error", "param": null, "code": "replica_lost"}}\n\ndata: [DONE]\n\n'
)


async def answer_rest(stream):
    """The rest of a replica's event stream; where the replica dies mid-stream, it ends with an error event (in
    OpenAI's error shape) and [DONE] (its first part already went out, so it cannot be sent again)."""
    try:
        async for part in stream:
            yield part
    except RayActorError:
        yield STREAM_LOST


async def first_answer(call) -> tuple[dict, Optional[List[bytes]], Any]:
    """The answer of a replica call (`call()` starts one), made once more where its replica dies before giving it:
    its head, and a plain answer's whole body (None for an event stream, whose rest the returned stream carries).
    A replica that dies before a plain answer's last byte is retried: none of it went out, and a head alone would
    reach the client as an empty 200."""
    for attempt in (0, 1):
        stream = call()
        try:
            head = await stream.__anext__()
            if dict(head["headers"]).get("content-type", "").startswith("text/event-stream"):
                return head, None, stream
            return head, [part async for part in stream], stream
        except RayActorError:  # the replica died mid-answer: once more, on a live one
            if attempt:
                raise


# a stop polls the in-flight requests every 0.2 s (Ray's default 2 s adds ~2 s a deployment to every stop)
@serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=0.2)
@serve.ingress(api)
class Ingress:
    """Forwards HTTP to the replicas (`AffixRouter` picks one), streaming the answers back."""

    def __init__(self, replicas, count: int):
        self.replicas = replicas
        self.count = count

    def _call(self, method, path, query, headers, body, **route):
        return self.replicas.options(stream=True).request.remote(method, path, query, headers, body, **route)

    async def _everywhere(self, method, path, query, headers, body) -> List[tuple[dict, List[bytes]]]:
        # one after the other: the calls of one HTTP request share Ray's internal request id, by which its router
        # matches a chosen replica to a waiting call, so concurrent ones would wait for each other forever
        return [
            await _answer(self._call(method, path, query, headers, body, replica_index=i)) for i in range(self.count)
        ]

    # every method the replicas may answer (theirs: GET, POST, DELETE; a 405 in OpenAI's shape for the others)
    @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"], include_in_schema=False)
    async def forward(self, request: Request, path: str) -> Response:
        method, path, query = request.method, request.url.path, request.url.query
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        body = await request.body()
        if path == METRICS:
            answers = await self._everywhere(method, path, query, headers, body)
            texts = [
                (dict(h["headers"]).get(REPLICA_HEADER, str(i)), b"".join(c).decode())
                for i, (h, c) in enumerate(answers)
            ]
            return Response(merge_metrics(texts), media_type=dict(answers[0][0]["headers"]).get("content-type"))
        if path == AUDIT and method == "GET":
            answers = await self._everywhere(method, path, query, headers, body)
            if any(h["status"] != 200 for h, _ in answers):  # a 401, say: the replicas' own answer
                return self._combined(path, answers)
            named = [
                (dict(h["headers"]).get(REPLICA_HEADER, str(i)), _json(b"".join(c))) for i, (h, c) in enumerate(answers)
            ]
            return JSONResponse(merge_audit(named))
        if path in ALL_MUST_ANSWER or (method != "GET" and path.startswith(BROADCAST)):
            return self._combined(path, await self._everywhere(method, path, query, headers, body))
        key = request_route_key(_json(body)) if method == "POST" and path in ROUTED else None
        call = functools.partial(self._call, method, path, query, headers, body, route_key=key)
        head, whole, stream = await first_answer(call)
        if whole is None:
            return StreamingResponse(answer_rest(stream), status_code=head["status"], headers=_headers(head))
        return Response(b"".join(whole), status_code=head["status"], headers=_headers(head))

    def _combined(self, path: str, answers: List[tuple[dict, List[bytes]]]) -> Response:
        """Every replica's answer to a broadcast as one: the first failure's if any replica failed, else the first
        replica's; /health and /ready list every replica's body."""
        failed = [a for a in answers if a[0]["status"] >= 400]
        head, chunks = (failed or answers)[0]
        who = {REPLICAS_HEADER: ",".join(dict(h["headers"]).get(REPLICA_HEADER, "?") for h, _ in answers)}
        if path in ALL_MUST_ANSWER:
            bodies = [_json(b"".join(c)) for _, c in answers]
            status = "ok" if not failed else "unavailable"
            if path == "/ready":
                status = "ready" if not failed else "not ready"
            return JSONResponse({"status": status, "replicas": bodies}, status_code=503 if failed else 200, headers=who)
        return Response(b"".join(chunks), status_code=head["status"], headers={**_headers(head), **who})


def _replica_env(memory_fraction: Optional[float]) -> dict:
    """The replica processes' environment: XLA reads its GPU memory share from there (this library reads none)."""
    if memory_fraction is None:
        return {}
    return {"env_vars": {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{memory_fraction:g}"}}


def build_app(
    args: argparse.Namespace,
    replicas: int,
    gpus_per_replica: float = 0.0,
    spill_queue: int = 8,
    affinity: bool = True,
    memory_fraction: Optional[float] = None,
    max_ongoing_requests: int = 1024,
):
    """The bound application: `replicas` engine replicas, each the server of `dllm-jax serve`'s parsed flags `args`
    on `gpus_per_replica` GPUs (XLA taking `memory_fraction` of its GPU's memory, None: its default), behind the
    ingress."""
    from ray.serve.config import RequestRouterConfig

    replica = serve.deployment(Replica).options(
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,  # the engine queues (and answers 429 past --max-queue) itself
        ray_actor_options={"num_cpus": 0, "num_gpus": gpus_per_replica, "runtime_env": _replica_env(memory_fraction)},
        health_check_period_s=5,
        graceful_shutdown_timeout_s=5,
        graceful_shutdown_wait_loop_s=0.2,
        request_router_config=RequestRouterConfig(
            request_router_class=AffixRouter,
            request_router_kwargs={"spill_queue": spill_queue, "affinity": affinity},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    )
    return Ingress.bind(replica.bind(args), replicas)
