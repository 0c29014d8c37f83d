"""The OpenAI-compatible HTTP API on the engine (FastAPI; run by uvicorn, see `dllm-jax serve`).

POST /v1/completions, POST /v1/chat/completions (stream: one server-sent event per committed block, then [DONE];
usage in the last chunk, or with stream_options.include_usage in a chunk of no choices after it, and in the plain
body; several choices, `n` or a list of prompts: each an engine request, a chunk per block of one of them), GET
/v1/models (and /v1/models/{id}), POST /tokenize and /detokenize (vLLM's),
GET /health (liveness: 200 while the engine thread can serve, warming and draining included), GET /ready
(readiness: 200 once warmed up and not draining, else 503 with the status), GET /metrics (Prometheus). Requests
sent during the warm-up wait for it.
Errors have the OpenAI shape {"error": {"message", "type", "param", "code"}} (the router's 404 / 405 too): 400 for
a bad field, an unknown model, a request too long or a block length / BiCache depth the server does not serve;
401 without the API key; 429 when the queue is full; 500 for the requests of a device call that failed; 503 while
draining or when the engine cannot serve. GET /openapi.json documents every body and response (`openapi.py`),
/docs browses it.
GET / is the playground (`playground/`: one static page, no build step): a request's blocks replayed in the order
their tokens were committed, its shared affix and ACache's anchors marked, the server's counters.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from dllm_jax import __version__
from dllm_jax.audit import affix_id
from dllm_jax.decoding.caches.bicache import DEPTH_TABLES
from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.engine import AffixHandle, RequestError
from dllm_jax.engine.request import BlockOutput
from dllm_jax.engine.scheduler import QueueFull
from dllm_jax.io.loading import DEFAULT_MODEL_DIR, generation_defaults
from dllm_jax.server import logs, openapi
from dllm_jax.server.metrics import ServerMetrics
from dllm_jax.server.protocol import (
    MAX_CHOICES,
    Affix,
    AffixCreate,
    AffixID,
    AffixMessage,
    AffixSpan,
    AffixText,
    APIError,
    AuditReport,
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    Detokenized,
    DetokenizeRequest,
    Diffusion,
    Health,
    Message,
    ModelCard,
    ModelList,
    Readiness,
    Tokenized,
    TokenizeRequest,
    completion_body,
    new_id,
    parse,
    usage,
)
from dllm_jax.server.service import EngineService, ServiceUnavailable
from dllm_jax.server.settings import ServeSettings

__all__ = ["ServeSettings", "create_app"]
MAX_AFFIXES = 1024  # affixes registered over HTTP at once (each pins its tokens in the engine's affix index)
PLAYGROUND = Path(__file__).parent / "playground"
# the playground's first example on the bundled model (its digit rule, as in the README)
BUNDLED_EXAMPLE = {
    "affix": "rule examples : 7 4 0 -> 2 5 9 ; 3 6 8 -> 6 3 1 ; 6 5 2 -> 3 4 7 ; 4 3 4 -> 5 6 5 ; 0 4 1 -> 9 5 8 ;",
    "question": "input : 8 9 5 what does the rule give ?",
}


class Answer:
    """A request's text as its blocks arrive: stop strings cut it (held back until they cannot start in what is
    still to come), max_tokens caps it. trace: keep each block as decoded (return_commit_steps), timed from t0."""

    def __init__(self, tokenizer, stops: list[str], max_tokens: int, trace: bool = False, t0: float = 0.0):
        self.tok, self.stops, self.max_tokens, self.trace, self.t0 = tokenizer, stops, max_tokens, trace, t0
        self.ids: list[int] = []
        self.emitted = ""
        self.finish: str | None = None
        self.blocks: list[dict] = []  # protocol.BlockTrace's fields, one per block (with trace)
        self.affix: tuple = (None, [])  # the engine's (affix span, ACache's anchors) of the request

    def add(self, out: BlockOutput) -> str:
        """The text to send now (may be empty); sets `finish` when the answer is complete."""
        room = self.max_tokens - len(self.ids)
        ids, self.affix = out.tokens[:room], out.affix
        if self.trace and out.block >= 0:
            tokens, steps = [self.tok.decode([t]) for t in ids], out.commit_steps[:room]
            elapsed = round(time.perf_counter() - self.t0, 4)
            self.blocks.append(
                dict(block=out.block, token_ids=ids, tokens=tokens, commit_steps=steps, elapsed_s=elapsed)
            )
        self.ids = self.ids + ids
        text = self.tok.decode(self.ids)
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            text, self.finish = text[:cut], "stop"
        elif len(self.ids) >= self.max_tokens:
            self.finish = "length"
        elif out.finished:
            self.finish = "length" if out.finish_reason == "length" else "stop"
        visible = text
        if self.finish is None:  # hold back what may be the start of a stop string or of a split character
            hold = max((len(s) - 1 for s in self.stops), default=0)
            visible = text[: len(text) - hold] if hold else text
            visible = visible.rstrip("\ufffd")
        delta = visible[len(self.emitted) :] if visible.startswith(self.emitted) else ""
        self.emitted = visible if visible.startswith(self.emitted) else self.emitted
        return delta


def create_app(service: EngineService, settings: ServeSettings) -> FastAPI:
    """The ASGI app on an EngineService (started, or started later: requests wait for it). Defaults the settings
    leave open come from the model's generation_config.json."""
    app = FastAPI(
        title="dllm-jax",
        version=__version__,
        description="OpenAI-compatible serving of diffusion language models (LLaDA, Dream) with shared affixes",
        docs_url="/docs",
        redoc_url=None,
    )
    model = service.engine.model
    openapi.install(app, settings.model_name, model.config.vocab_size)
    settings = settings.resolve(generation_defaults(model.path), service.engine.block_lengths)
    metrics = ServerMetrics(service, settings.model_name)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)  # a fault of ours: still OpenAI's shape (uvicorn logs its traceback)
    async def internal_error(request: Request, e: Exception):
        body = APIError(500, f"internal server error: {type(e).__name__}: {e}", code="internal_error").body()
        return JSONResponse(body, status_code=500)

    @app.exception_handler(HTTPException)  # the router's own (no such path, a method it lacks): OpenAI's shape too
    async def http_error(request: Request, e: HTTPException):
        what = {404: "no such endpoint", 405: "method not allowed"}.get(e.status_code, str(e.detail))
        message = f"{what}: {request.method} {request.url.path} (the endpoints: GET /docs)"
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code, headers=e.headers)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        path = request.url.path
        if settings.api_key and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")):
            header = request.headers.get("authorization", "")
            if header != f"Bearer {settings.api_key}":
                e = APIError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    @app.middleware("http")  # outermost (added last): every answer, a 401 included, names its request
    async def request_id(request: Request, call_next):
        given = request.headers.get("x-request-id")
        rid = given if given and logs.REQUEST_ID.fullmatch(given) else new_id("req")
        request.state.request_id = rid
        token = logs.current_request.set(rid)
        try:
            response = await call_next(request)
        finally:
            logs.current_request.reset(token)
        response.headers["X-Request-Id"] = rid
        return response

    app.mount("/playground", StaticFiles(directory=PLAYGROUND), name="playground")
    bundled = model.path is not None and Path(model.path).resolve() == DEFAULT_MODEL_DIR.resolve()
    page_settings = dict(
        model=settings.model_name,
        block_lengths=list(service.engine.block_lengths),
        shallow_depths=list(service.engine.config.shallow_depths),
        api_key=settings.api_key is not None,
        example=BUNDLED_EXAMPLE if bundled else None,
        **{k: getattr(settings, k) for k in ("block_length", "max_tokens", "steps_per_token", "temperature")},
        **{k: getattr(settings, k) for k in ("affix_technique", "anchor_ratio", "shallow_depth")},
    )
    page = (
        (PLAYGROUND / "index.html").read_text().replace("__SETTINGS__", json.dumps(page_settings).replace("</", "<\\/"))
    )

    affixes: dict[str, AffixHandle] = {}  # registered over HTTP: id -> handle (at most MAX_AFFIXES)

    @app.post(
        "/v1/affixes",
        response_model=Affix,
        response_model_exclude_none=True,
        openapi_extra=openapi.body(AffixCreate),
        responses=openapi.errors(400, 401, 408, 413, 503),
    )
    async def register_affix(request: Request):
        """Register a span many prompts will contain (a system prompt, few-shot examples, a document): requests
        naming its id, or containing its tokens anywhere, share its one stored copy."""
        spec = parse(AffixCreate, await _json(request, settings.body_timeout))
        if (spec.text is None) == (spec.tokens is None):
            raise APIError(400, "give the affix as text or as tokens (one of them)", param="text")
        tokens = spec.tokens if spec.tokens is not None else model.tokenizer.encode(spec.text)
        if len(affixes) >= MAX_AFFIXES:
            raise APIError(400, f"{MAX_AFFIXES} affixes are registered already: DELETE /v1/affixes/{{id}} some first")
        try:
            handle = await service.call(lambda engine: engine.register_affix(tokens))
        except RequestError as e:
            raise APIError(400, str(e), param="tokens" if spec.tokens is not None else "text") from None
        except ServiceUnavailable as e:
            raise APIError(503, f"the engine cannot serve: {e}") from None
        affixes[affix_id(handle.key)] = handle
        return {"id": affix_id(handle.key), "object": "affix", "tokens": len(handle.tokens)}

    @app.delete("/v1/affixes/{id}", response_model=Affix, responses=openapi.errors(401, 404, 503))
    async def drop_affix(id: str):
        """Unregister an affix: requests no longer find it by its tokens (its stored copy is evicted when the pool
        needs the pages)."""
        handle = affixes.pop(id, None)
        if handle is None:
            raise APIError(404, f"no affix {id!r} is registered", param="id", code="affix_not_found")
        try:
            await service.call(lambda engine: engine.affixes.unregister(handle.key))
        except ServiceUnavailable as e:
            raise APIError(503, f"the engine cannot serve: {e}") from None
        return {"id": id, "object": "affix", "tokens": len(handle.tokens), "deleted": True}

    @app.get("/v1/audit", response_model=AuditReport, responses=openapi.errors(401))
    async def audit():
        """What the affix techniques cost in answers: per affix and setting, the audited requests' agreement with
        their exact twins (`dllm-jax serve --audit-fraction`)."""
        return service.auditor.report()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground():
        return page

    card = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "dllm-jax"}

    def _this_model(name: str | None, status: int = 400) -> None:
        if name is not None and name != settings.model_name:
            raise APIError(
                status,
                f"unknown model {name!r}: this server serves {settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _tokenizer_body(request: Request, model_cls: type) -> Any:
        """The body of a tokenizer endpoint, for this model, which has tokenizer files."""
        req = parse(model_cls, await _json(request, settings.body_timeout))
        _this_model(req.model)
        if model.tokenizer is None:
            raise APIError(400, f"the model at {model.path} has no tokenizer files: send token ids")
        return req

    @app.post(
        "/tokenize",
        response_model=Tokenized,
        openapi_extra=openapi.body(TokenizeRequest),
        responses=openapi.errors(400, 401, 408, 413),
    )
    async def tokenize(request: Request):
        """A prompt's (or a chat's, as its template renders it) token ids, as a request's prompt is read."""
        req = await _tokenizer_body(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give a prompt or messages (one of them)", param="prompt")
        if req.prompt is not None:
            tokens = model.tokenizer.encode(req.prompt)
        else:
            tokens = model.encode_chat(_chat(req.messages), req.add_generation_prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": service.engine.max_len}

    @app.post(
        "/detokenize",
        response_model=Detokenized,
        openapi_extra=openapi.body(DetokenizeRequest),
        responses=openapi.errors(400, 401, 408, 413),
    )
    async def detokenize(request: Request):
        """Token ids back to text, special tokens kept."""
        req = await _tokenizer_body(request, DetokenizeRequest)
        if any(t >= model.config.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids are below the vocabulary's {model.config.vocab_size}", param="tokens")
        return {"prompt": model.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/v1/models", response_model=ModelList, responses=openapi.errors(401))
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=openapi.errors(401, 404))
    async def model_card(model_id: str):
        _this_model(model_id, status=404)
        return card

    @app.get(
        "/health",
        response_model=Health,
        response_model_exclude_none=True,
        responses={503: {"model": Health, "description": "Not alive: restart"}},
    )
    async def health():
        reason = service.alive()
        if reason is not None:
            return JSONResponse({"status": "failed", "error": reason}, status_code=503)
        return {"status": "ok"}

    @app.get(
        "/ready",
        response_model=Readiness,
        response_model_exclude_none=True,
        responses={503: {"model": Readiness, "description": "Warming up, draining or failed"}},
    )
    async def ready():
        state = service.readiness()
        return JSONResponse(state, status_code=200 if state["status"] == "ready" else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"description": "Prometheus metrics", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}
        },
    )
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/v1/completions",
        openapi_extra=openapi.body(CompletionRequest),
        responses={
            **openapi.answer(Completion, "text_completion chunks"),
            **openapi.errors(400, 401, 408, 413, 429, 500, 503, 504),
        },
    )
    async def completions(request: Request):
        req = parse(CompletionRequest, await _json(request, settings.body_timeout))
        texts = req.prompts()
        prompts = [[int(t) for t in p] if isinstance(p, list) else model.tokenizer.encode(p) for p in texts]
        return await _serve(request, req, prompts, chat=False, texts=texts)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=openapi.body(ChatRequest),
        responses={
            **openapi.answer(ChatCompletion, "chat.completion.chunk objects"),
            **openapi.errors(400, 401, 408, 413, 429, 500, 503, 504),
        },
    )
    async def chat(request: Request):
        req = parse(ChatRequest, await _json(request, settings.body_timeout))
        prompt = model.encode_chat(_chat(req.messages))
        if req.max_completion_tokens is not None and req.max_tokens is None:
            req = req.model_copy(update={"max_tokens": req.max_completion_tokens})
        return await _serve(request, req, [prompt], chat=True)

    async def _serve(request: Request, req: Diffusion, prompts: list[list[int]], chat: bool, texts=(None,)):
        """Answer the request: one choice (the path below), or several (`_serve_choices`): texts are the prompts as
        sent (a string, or token ids)."""
        _this_model(req.model)
        if service.draining:
            raise APIError(503, "the server is shutting down: it finishes its requests and accepts no new ones")
        config, max_tokens = _config(req, settings, service.engine.model.config, service.engine.config.shallow_depths)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options only goes with stream: true", param="stream_options")
        if len(prompts) * req.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={req.n} exceed {MAX_CHOICES} choices a request", "n")
        if len(prompts) * req.n > 1 and (req.return_commit_steps or req.return_anchors):
            field = "return_commit_steps" if req.return_commit_steps else "return_anchors"
            raise APIError(400, f"{field} traces one answer: send one prompt with n 1", param=field)
        found = [_affix(req, p, model.tokenizer, affixes, text) for p, text in zip(prompts, texts)]
        if len(prompts) * req.n > 1:
            return await _serve_choices(request, req, prompts, found, config, max_tokens, chat)
        prompt, affix = prompts[0], found[0]
        service.open_answers += 1  # until its answer is handed to the server (a cut shutdown waits for it)
        try:
            rid, stream = await _submit(request, req, prompt, config, affix)
        except BaseException:
            service.open_answers -= 1  # its error answer is written at once
            raise
        t0 = time.perf_counter()
        answer = Answer(model.tokenizer, req.stop, max_tokens, req.return_commit_steps, t0)
        cid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            ended = _once(functools.partial(_stream_ended, rid, answer, request.state.request_id, len(prompt), t0))
            events = _events(rid, stream, answer, cid, req, prompt, chat, t0, ended)
            return _EventStream(events, ended)
        try:
            body = await _collect(request, rid, stream, answer, cid, req, prompt, chat)
        except APIError as e:
            _logged(request.state.request_id, e.status, len(prompt), answer, t0, e.code)
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers, background=_sent())
        except BaseException:
            service.open_answers -= 1
            raise
        _logged(request.state.request_id, 200, len(prompt), answer, t0)
        if isinstance(body, Response):  # the client left
            body.background = _sent()
            return body
        return JSONResponse(body, background=_sent())

    async def _serve_choices(
        request: Request,
        req: Diffusion,
        prompts: list[list[int]],
        found: list[Any],
        config: GenerationConfig,
        max_tokens: int,
        chat: bool,
    ) -> Response:
        """Several choices: prompt i's j-th (index i * n + j) is an engine request of its own with seed + j (so it
        equals that request sent alone), all queued at once. Answered together, or streamed as their blocks come
        (a chunk is one choice's). One that fails ends them all."""
        service.open_answers += 1
        submits = [
            asyncio.ensure_future(
                _submit(request, req, prompts[k // req.n], config, found[k // req.n], sample=k % req.n, choice=k)
            )
            for k in range(len(prompts) * req.n)
        ]  # handed over together: the engine takes them in at one step
        try:
            subs: list[tuple[str, asyncio.Queue]] = list(await asyncio.gather(*submits))
        except BaseException:  # one refused (or the client left): what was queued is aborted
            await asyncio.gather(*submits, return_exceptions=True)
            for t in submits:
                if not t.cancelled() and t.exception() is None:
                    service.abort(t.result()[0])
            service.open_answers -= 1
            raise
        t0 = time.perf_counter()
        answers = [Answer(model.tokenizer, req.stop, max_tokens, False, t0) for _ in subs]
        owners = [prompts[k // req.n] for k in range(len(subs))]
        cid, n_prompt = new_id("chatcmpl" if chat else "cmpl"), sum(map(len, prompts))
        if req.stream:
            ended = _once(functools.partial(_choices_ended, subs, answers, owners, request.state.request_id, t0))
            events = _choice_events(subs, answers, cid, req, chat, n_prompt, ended)
            return _EventStream(events, ended)
        tasks = [
            asyncio.ensure_future(_collect(request, rid, stream, answer, cid, req, owner, chat))
            for (rid, stream), answer, owner in zip(subs, answers, owners)
        ]
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()  # each aborts its engine request
            await asyncio.gather(*pending, return_exceptions=True)
            errors = [t.exception() for t in tasks if not t.cancelled() and t.exception()]  # (each one retrieved)
            if errors:
                raise errors[0]
        except APIError as e:
            for k, answer in enumerate(answers):
                status, code = (200, None) if answer.finish else (e.status, e.code)
                _logged(f"{request.state.request_id}.{k}", status, len(owners[k]), answer, t0, code)
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers, background=_sent())
        except BaseException:
            for t in tasks:
                t.cancel()
            service.open_answers -= 1
            raise
        bodies = [t.result() for t in tasks]
        left = next((b for b in bodies if isinstance(b, Response)), None)
        if left is not None:  # the client left: every choice was aborted
            left.background = _sent()
            return left
        for k, answer in enumerate(answers):
            _logged(f"{request.state.request_id}.{k}", 200, len(owners[k]), answer, t0)
        body = completion_body(cid, req.model, "", None, usage(n_prompt, sum(len(a.ids) for a in answers)), chat)
        body["choices"] = [{**b["choices"][0], "index": k} for k, b in enumerate(bodies)]
        return JSONResponse(body, background=_sent())

    async def _choice_events(subs, answers, cid, req, chat, n_prompt, ended):
        """The stream of several choices: each choice's blocks as they come, a chunk each (its `index`); then
        ended(status, code)."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, rid: str, stream: asyncio.Queue, answer: Answer) -> None:
            try:
                while answer.finish is None:
                    delta = await _next(stream, rid, answer)
                    merged.put_nowait((k, delta, answer.finish, None))
            except APIError as e:
                merged.put_nowait((k, "", None, e))
            except Exception as e:  # noqa: BLE001  told to the client, never a stream left waiting
                merged.put_nowait((k, "", None, APIError(500, f"choice {k} failed: {e!r}")))

        pumps = [asyncio.ensure_future(pump(k, *sub, a)) for k, (sub, a) in enumerate(zip(subs, answers))]
        first, left, status, code = [True] * len(subs), len(subs), 200, None
        try:
            while left:
                k, delta, finish, error = await merged.get()
                if error is not None:  # an error event, then the end of the stream
                    status, code = error.status, error.code
                    yield json.dumps(error.body())
                    break
                left -= finish is not None
                if delta or finish or first[k]:
                    use = None if left else usage(n_prompt, sum(len(a.ids) for a in answers))  # the last: usage
                    chunk = completion_body(
                        cid, req.model, delta, finish, use, chat, chunk=True, first=first[k], index=k
                    )
                    yield json.dumps(_usage_asked(req, chunk))
                    first[k] = False
            if not left and (last := _usage_chunk(req, cid, chat, use)) is not None:
                yield last
            yield "[DONE]"
        finally:
            for p in pumps:
                p.cancel()
            ended(status, code)

    def _choices_ended(subs, answers, owners, request_id, t0, status=200, code=None) -> None:
        """A stream of several choices ended (or never started): logged, the unfinished aborted, one answer fewer."""
        for k, ((rid, _), answer) in enumerate(zip(subs, answers)):
            done = answer.finish is not None
            _logged(f"{request_id}.{k}", status if done or code else 499, len(owners[k]), answer, t0, code, True)
            if not done:  # the client went away, or a choice failed: free its pages
                service.abort(rid)
        service.open_answers -= 1

    def _sent() -> BackgroundTask:
        """Runs once an answer is sent: one open answer fewer."""

        def one_fewer() -> None:
            service.open_answers -= 1

        return BackgroundTask(one_fewer)

    async def _submit(
        request: Request, req: Diffusion, prompt, config, affix, sample: int = 0, choice: int | None = None
    ) -> tuple[str, asyncio.Queue]:
        """Hand the request to the engine thread (sample: the seed's offset; choice: its index among several);
        its refusals as OpenAI errors."""
        try:
            timeout = req.timeout or settings.request_timeout
            rid = request.state.request_id
            return await service.submit(
                prompt,
                config,
                affix,
                (req.seed or 0) + sample,
                timeout,
                request_id=rid if choice is None else f"{rid}.{choice}",
                auto=_auto(req, settings),
            )
        except QueueFull as e:
            raise APIError(429, f"too many requests waiting ({e}); retry later", code="queue_full") from None
        except RequestError as e:
            raise _refused(e) from None
        except ServiceUnavailable as e:
            raise APIError(503, f"the engine cannot serve: {e}") from None

    async def _next(stream: asyncio.Queue, rid: str, answer: Answer) -> str:
        out = await stream.get()
        if out.finish_reason == "timeout":  # past its deadline: not worth retrying as it is
            raise APIError(
                504,
                "the request ran past its timeout (the request's timeout field, else the server's "
                "--request-timeout); raise it, or ask for fewer tokens",
                param="timeout",
                code="request_timeout",
                headers={"x-should-retry": "false"},  # the openai client would otherwise retry a 5xx
            )
        if out.finish_reason == "error":  # its device call failed (the engine goes on serving the others)
            fault = service.engine.last_fault
            raise APIError(500, f"the device call serving this request failed: {fault}", code="engine_fault")
        if out.finish_reason == "abort" and answer.finish is None:
            raise APIError(503, "the request was stopped by the server (shutting down or a device failure)")
        delta = answer.add(out)
        if answer.finish is not None and not out.finished:
            service.abort(rid)  # cut by a stop string or max_tokens: free its pages now
        return delta

    def _trace(req: Diffusion, answer: Answer, prompt: list[int], blocks: list[dict], first: bool) -> dict:
        """The response's `dllm` field (protocol.Trace): the blocks asked for, and in the first chunk (or the plain
        body) the prompt's tokens, its affix and ACache's anchors."""
        trace: dict[str, Any] = {"blocks": blocks} if req.return_commit_steps else {}
        if req.return_anchors and first:
            span, anchors = answer.affix
            trace.update(prompt_tokens=[model.tokenizer.decode([t], skip_special_tokens=False) for t in prompt])
            trace["anchors"] = list(anchors)
            trace["affix_span"] = list(span) if span is not None else None
        return trace

    async def _collect(request, rid, stream, answer, cid, req, prompt, chat):
        try:
            while answer.finish is None:
                get = asyncio.ensure_future(_next(stream, rid, answer))
                while not get.done():
                    await asyncio.wait({get}, timeout=0.5)
                    if not get.done() and await request.is_disconnected():
                        get.cancel()
                        service.abort(rid)
                        return Response(status_code=499)
                get.result()
        except asyncio.CancelledError:
            service.abort(rid)
            raise
        use = usage(len(prompt), len(answer.ids))
        body = completion_body(cid, req.model, answer.emitted, answer.finish, use, chat)
        if trace := _trace(req, answer, prompt, answer.blocks, True):
            body["dllm"] = trace
        return body

    async def _events(rid, stream, answer, cid, req, prompt, chat, t0, ended):
        """One choice's stream: a chunk per block that adds text (each with the trace asked for); then
        ended(status, code)."""
        first, status, code, n_prompt = True, 200, None, len(prompt)
        try:
            while answer.finish is None:
                blocks = len(answer.blocks)
                delta = await _next(stream, rid, answer)
                done = answer.finish is not None
                if delta or done or first or req.return_commit_steps:  # a traced stream: a chunk per block
                    use = usage(n_prompt, len(answer.ids)) if done else None
                    body = completion_body(cid, req.model, delta, answer.finish, use, chat, chunk=True, first=first)
                    if trace := _trace(req, answer, prompt, answer.blocks[blocks:], first):
                        body["dllm"] = trace
                    first = False
                    yield json.dumps(_usage_asked(req, body))
            if (last := _usage_chunk(req, cid, chat, usage(n_prompt, len(answer.ids)))) is not None:
                yield last
            yield "[DONE]"
        except APIError as e:  # an error event, then the end of the stream
            status, code = e.status, e.code
            yield json.dumps(e.body())
            yield "[DONE]"
        finally:
            ended(status, code)

    def _stream_ended(rid, answer, request_id, n_prompt, t0, status=200, code=None) -> None:
        """A stream ended (or never started): logged, one answer fewer, the request aborted if unfinished."""
        _logged(request_id, status if answer.finish or code else 499, n_prompt, answer, t0, code, stream=True)
        service.open_answers -= 1
        if answer.finish is None:  # the client went away (or the server stopped it): free its pages
            service.abort(rid)

    return app


class _EventStream(EventSourceResponse):
    """An answer's event stream whose bookkeeping (`ended`: its log line, one open answer fewer, its requests aborted
    if unfinished) runs however the response ends: the generator's `finally` calls it, and so does this response
    after it, for a response cancelled or failed before the generator started (a client that leaves while the head
    is sent, a shutdown), whose `finally` never runs. `ended` runs once (`_once`)."""

    def __init__(self, events, ended: Callable[[], None]):
        super().__init__(events, ping=15, sep="\n")
        self.ended = ended

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ended()


def _once(fn: Callable[..., None]) -> Callable[..., None]:
    """fn, run by the first call only (an event stream's bookkeeping: `_EventStream`)."""
    done = False

    def first(*args) -> None:
        nonlocal done
        if not done:
            done = True
            fn(*args)

    return first


def _chat(messages: list[Message]) -> list[dict]:
    """The messages as the chat template reads them (their text parts joined already)."""
    return [{"role": m.role, "content": m.content} for m in messages]


def _include_usage(req: Diffusion) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _usage_asked(req: Diffusion, chunk: dict) -> dict:
    """A stream chunk as sent: with stream_options.include_usage its usage is null (it comes in a chunk of its own,
    `_usage_chunk`); else the last chunk carries it."""
    if _include_usage(req):
        chunk["usage"] = None
    return chunk


def _usage_chunk(req: Diffusion, cid: str, chat: bool, use: dict) -> str | None:
    """With stream_options.include_usage, the stream's usage in a last chunk of no choices (OpenAI's)."""
    if not _include_usage(req):
        return None
    last = completion_body(cid, req.model, "", None, use, chat, chunk=True)
    last["choices"] = []
    return json.dumps(last)


def _logged(rid: str, status: int, n_prompt: int, answer: Answer, t0: float, code=None, stream=False) -> None:
    """One line per finished request (INFO, shown with --verbose): its id, status, tokens and seconds."""
    seconds = time.perf_counter() - t0
    logs.REQUESTS.info(
        "request %s: %d%s, %d prompt + %d completion tokens, %s, %.3f s",
        rid,
        status,
        f" {code}" if code else "",
        n_prompt,
        len(answer.ids),
        f"finish {answer.finish}" if answer.finish else "unfinished",
        seconds,
        extra=dict(
            request_id=rid,
            status=status,
            code=code,
            stream=stream,
            prompt_tokens=n_prompt,
            completion_tokens=len(answer.ids),
            finish_reason=answer.finish,
            seconds=round(seconds, 4),
        ),
    )


MAX_BODY_BYTES = 4 << 20  # a prompt of any served length, as text or token ids, is far below this


async def _json(request: Request, timeout: float) -> Any:
    """The request's JSON body: at most MAX_BODY_BYTES (413), arriving within `timeout` seconds (408: a client
    that trickles its body holds a connection, nothing more), valid JSON of sane depth (400)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body has {size} bytes, more than the {MAX_BODY_BYTES} this server takes")

    async def read() -> bytes:
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is longer than the {MAX_BODY_BYTES} bytes this server takes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise APIError(408, f"the request body took over {timeout:g} s to arrive") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None


def _refused(e: RequestError) -> APIError:
    """The 400 of a request the engine refuses, naming the field where the message does."""
    text = str(e)
    code = "context_length_exceeded" if "maximum length" in text else None
    param = next((p for p in ("block_length", "shallow_depth", "top_p", "top_k", "seed") if text.startswith(p)), None)
    return APIError(400, text, param=param, code=code)


def _config(
    req: Diffusion, s: ServeSettings, model_config, served_depths: tuple[int, ...] = ()
) -> tuple[GenerationConfig, int]:
    """The engine settings of a request: its fields over the server's (resolved) defaults. The block length is
    never shrunk to max_tokens (each block length is a program of its own): the answer runs to whole blocks and
    `Answer` cuts it at max_tokens."""
    max_tokens = req.max_tokens or s.max_tokens
    block = req.block_length or s.block_length
    gen_length = math.ceil(max_tokens / block) * block
    n_blocks = gen_length // block
    steps = req.steps or max(n_blocks, round(gen_length * s.steps_per_token / n_blocks) * n_blocks)
    technique = req.affix_technique or s.affix_technique
    for field, owner in (("anchor_ratio", "anchors"), ("shallow_depth", "shallow")):  # set for another technique
        if getattr(req, field) is not None and technique != owner:
            default = " (the server's default)" if req.affix_technique is None else ""
            raise APIError(
                400,
                f"{field} sets how affix_technique {owner!r} reuses the affix, and this request decodes with "
                f"affix_technique {technique!r}{default}: send affix_technique {owner!r} with it, or leave it out",
                field,
            )
    depth = s.shallow_depth if req.shallow_depth is None else req.shallow_depth
    auto = _auto(req, s)
    if auto == "shallow" and not any(served_depths):
        raise APIError(
            400,
            'shallow_depth "auto" calibrates among the BiCache depths the server serves, and it serves none '
            "(dllm-jax serve --shallow-depths)",
            "shallow_depth",
        )
    if auto == "shallow":  # planned as exact ACache (the affix span found); the calibrator picks the depth
        technique = "anchors"
    depth = None if depth == "auto" else depth  # "auto" where BiCache is not the technique: no depth
    if depth is not None and depth > model_config.n_layers:
        raise APIError(
            400, f"shallow_depth={depth} exceeds the model's {model_config.n_layers} layers", "shallow_depth"
        )
    if technique == "shallow" and depth is None and (model_config.family, model_config.n_layers) not in DEPTH_TABLES:
        raise APIError(
            400,
            f"affix_technique 'shallow' needs shallow_depth on this {model_config.n_layers}-layer model (BiCache's "
            "published depth tables cover LLaDA-8B and Dream-7B)",
            param="shallow_depth",
        )
    try:
        config = GenerationConfig.from_options(
            gen_length=gen_length,
            block_length=block,
            steps=steps,
            threshold=req.threshold,
            factor=req.factor,
            cache="dual",
            affix=technique,
            anchor_ratio=1.0 if auto else _given(req.anchor_ratio, s.anchor_ratio),
            **({"shallow_depth": depth} if technique == "shallow" else {}),
            temperature=s.temperature if req.temperature is None else req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
        )
    except ValueError as e:
        fields = ("steps", "block_length", "threshold", "factor", "temperature", "top_p", "top_k", "shallow_depth")
        param = next((f for f in fields if f in str(e)), None)
        raise APIError(400, str(e), param=param) from None
    return config, max_tokens


def _given(value, default):
    """A request's field, else the server's default; "auto" where ACache is not the technique is any valid ratio."""
    value = default if value is None else value
    return 0.2 if value == "auto" else value


def _auto(req: Diffusion, s: ServeSettings) -> str | None:
    """The technique whose level is calibrated per affix: "anchors" (anchor_ratio "auto"), "shallow"
    (shallow_depth "auto"; the request's field or the server's default), else None."""
    technique = req.affix_technique or s.affix_technique
    if technique == "anchors" and (s.anchor_ratio if req.anchor_ratio is None else req.anchor_ratio) == "auto":
        return "anchors"
    if technique == "shallow" and (s.shallow_depth if req.shallow_depth is None else req.shallow_depth) == "auto":
        return "shallow"
    return None


def _affix(req: Diffusion, prompt: list[int], tokenizer, registered: dict[str, AffixHandle], sent=None) -> Any:
    """The engine's affix argument for one of its prompts (sent: that prompt as sent, a string or token ids; None
    for a chat): "auto", None, a registered handle, or the (start, end) token span the request names."""
    if req.affix == "auto":
        return "auto"
    if req.affix == "none":
        return None
    if isinstance(req.affix, AffixID):
        if req.affix.id not in registered:
            raise APIError(400, f"no affix {req.affix.id!r} is registered (POST /v1/affixes)", param="affix.id")
        return registered[req.affix.id]
    if isinstance(req.affix, AffixSpan):
        return req.affix.start, req.affix.end  # the engine checks it against the prompt
    if isinstance(req.affix, AffixMessage):
        messages = getattr(req, "messages", None)
        if messages is None or req.affix.message >= len(messages):
            raise APIError(
                400, f"affix.message={req.affix.message} names no message of this request", param="affix.message"
            )
        text = messages[req.affix.message].content
    else:
        assert isinstance(req.affix, AffixText)
        text = req.affix.text
        if isinstance(sent, str) and text not in sent:
            raise APIError(400, "affix.text is not part of the prompt", param="affix.text")
        messages = getattr(req, "messages", None)
        if messages is not None and not any(text in (m.content or "") for m in messages):
            raise APIError(400, "affix.text is not part of any message", param="affix.text")
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and unknown in tokenizer.encode(text):  # unknown words all map to one id: no match
        raise APIError(400, "affix.text has words the model's tokenizer does not know", param="affix.text")
    for candidate in (text, " " + text, text.strip()):
        ids = tokenizer.encode(candidate)
        at = _find(prompt, ids)
        if ids and at is not None:
            return at, at + len(ids)
    raise APIError(
        400,
        "the affix's tokens are not a contiguous part of the tokenized prompt (tokenization across "
        "its boundary differs): name a span that starts and ends at word boundaries",
        param="affix",
    )


def _find(hay: list[int], needle: list[int]) -> int | None:
    n = len(needle)
    for i in range(len(hay) - n + 1):
        if hay[i : i + n] == needle:
            return i
    return None
