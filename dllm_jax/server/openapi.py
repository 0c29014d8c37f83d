"""The server's OpenAPI document: the request bodies, which the handlers parse themselves (so that every error keeps
OpenAI's shape), attached the way FastAPI documents a body it does not parse (`openapi_extra`), and every
endpoint's responses, error responses and content types. Served at /openapi.json, browsable at /docs."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from dllm_jax.server.protocol import (
    NEUTRAL,
    AffixCreate,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)

REF = "#/components/schemas/{model}"
BODIES = (CompletionRequest, ChatRequest)  # the generation bodies: their JSON schemas join the document's components
OTHER_BODIES = (AffixCreate, TokenizeRequest, DetokenizeRequest)  # and these

ERRORS = {
    400: "A bad field (`param` names it), an unknown model, a request longer than the server's maximum length, or "
    "a block length / BiCache depth the server does not serve",
    401: "A missing or wrong API key (servers started with --api-key)",
    404: "No such affix is registered (`code`: affix_not_found), or model (`code`: model_not_found)",
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
    event = {  # one server-sent event: its data is a chunk's JSON, an error's JSON, or [DONE]
        "type": "object",
        "properties": {"data": {"type": "string", "description": "a chunk's JSON, an error's JSON, or [DONE]"}},
        "required": ["data"],
    }
    events = {"schema": event, "example": 'data: {"id": ..., "choices": [...]}\n\ndata: [DONE]\n\n'}
    return {
        200: {
            "model": model,
            "description": f"The answer; with stream: true, server-sent events: {streamed}, then `data: [DONE]` "
            "(after an error, an event with the error's JSON, then [DONE])",
            "content": {"text/event-stream": events},
        }
    }


def _neutral_fields() -> dict[str, Any]:
    """OpenAI's fields this engine has no use for, documented at the values it accepts (protocol.NEUTRAL)."""
    out = {}
    for name, allowed in NEUTRAL.items():
        note = "accepted, ignored" if allowed == "any" else "accepted at its neutral value only"
        out[name] = {"description": f"OpenAI's field: {note}"}
        if allowed != "any":
            out[name]["enum"] = [v for i, v in enumerate(allowed) if v not in allowed[:i]]  # 0 and 0.0: one JSON 0
    return out


def install(app: FastAPI, model_name: str, vocab_size: int) -> None:
    """Serve the document with the request bodies' schemas among its components; their `model` is the one name
    this server answers to and token ids are below its vocabulary size (anything else is a 400)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in BODIES + OTHER_BODIES], ref_template=REF)
            for m in BODIES:  # what the handlers accept, exactly: any other field or model is a 400
                body = defs["$defs"][m.__name__]
                body["properties"]["model"]["enum"] = [model_name]
                for alt in body["properties"].get("prompt", {}).get("anyOf", []):
                    if alt.get("items", {}).get("type") == "integer":  # token ids
                        alt["items"]["maximum"] = vocab_size - 1
                body["properties"].update(_neutral_fields())
                body["additionalProperties"] = False
            for alt in defs["$defs"]["AffixCreate"]["properties"]["tokens"]["anyOf"]:
                if alt.get("type") == "array":
                    alt["items"]["maximum"] = vocab_size - 1
            defs["$defs"]["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = vocab_size - 1
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
