"""The server's OpenAPI document: the request bodies, which the handlers parse themselves (so that every error keeps
OpenAI's shape), attached the way FastAPI documents a body it does not parse (`openapi_extra`), and every
endpoint's responses, error responses and content types. Served at /openapi.json, browsable at /docs."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from dllm_jax.server.protocol import ChatRequest, CompletionRequest, ErrorResponse

REF = "#/components/schemas/{model}"
BODIES = (CompletionRequest, ChatRequest)  # their JSON schemas join the document's components

ERRORS = {
    400: "A bad field (`param` names it), an unknown model, a request longer than the server's maximum length, or "
    "a block length / BiCache depth the server does not serve",
    401: "A missing or wrong API key (servers started with --api-key)",
    408: "The request body took too long to arrive",
    413: "The request body is too large (over 4 MiB)",
    429: "Too many requests waiting: retry later",
    500: "The device call serving this request failed (`code`: engine_fault); the server serves on",
    503: "The server is shutting down, or its engine cannot serve",
    504: "The request ran past its timeout (`code`: request_timeout); its pages are freed",
}


def body(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra of a POST whose JSON body is `model`."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def errors(*codes: int) -> dict[int, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}


def answer(model: type[BaseModel], streamed: str) -> dict[int, dict[str, Any]]:
    """The 200 of a generation endpoint: JSON, or server-sent events with stream: true."""
    events = {"schema": {"type": "string"}, "example": 'data: {"id": ..., "choices": [...]}\n\ndata: [DONE]\n\n'}
    return {
        200: {
            "model": model,
            "description": f"The answer; with stream: true, server-sent events: {streamed}, then `data: [DONE]` "
            "(after an error, an event with the error's JSON, then [DONE])",
            "content": {"text/event-stream": events},
        }
    }


def install(app: FastAPI) -> None:
    """Serve the document with the request bodies' schemas among its components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in BODIES], ref_template=REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
