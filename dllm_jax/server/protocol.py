"""The OpenAI API's request and response shapes, with the diffusion settings as extra body fields.

Extra fields (what `extra_body` of the official client sends), each optional with a server-side default:
  steps            denoising steps over the whole answer (default: the model's steps per token, else one per token)
  block_length     semi-autoregressive block, one the server serves (`--block-lengths`; default: the model's
                   generation_config.json if served, else the first served); max_tokens is cut from whole blocks
  threshold        Fast-dLLM parallel decoding: commit every token at least this confident (then steps is ignored)
  factor           Fast-dLLM's factor rule instead: commit the n most confident while the n-th is above
                   1 - factor / (n + 1) (then steps is ignored; not with threshold)
  top_k            sample among the k likeliest tokens (Dream's sampler, as top_p; LLaDA's has neither: a 400)
  affix_technique  "none" (exact: the dual cache), "naive", "anchors" (ACache) or "shallow" (BiCache): how a
                   shared affix is reused
  anchor_ratio     ACache's share of the affix recomputed per request (0 = naive reuse, 1 = exact), or "auto": the
                   smallest ratio whose answers agree with the exact ones at the server's target, per affix
                   (calibrated online: see `dllm_jax.audit.Calibrator`; exact while it calibrates)
  shallow_depth    BiCache's depth: the affix's stored K/V serve the layers below it (0 = exact); default: the
                   published table for LLaDA-8B / Dream-7B shapes (other models must set it); or "auto": the
                   deepest served depth whose answers agree with the exact ones at the target, per affix
                   (anchor_ratio / shallow_depth with another affix_technique than theirs: a 400, not ignored)
  timeout          seconds after which the request ends unfinished with a 504 (default: --request-timeout)
  affix            which part of the prompt is the shared affix: "auto" (found by the engine: registered or
                   repeated across requests), "none", {"text": "..."} (completions: a part of the prompt),
                   {"message": i} (chat: the content of message i), {"start": s, "end": e} (token positions) or
                   {"id": ...} (one registered with POST /v1/affixes)
  return_commit_steps  true: the answer's blocks as decoded (`dllm.blocks`: each block's token ids and texts, the
                   step inside the block that committed each token, the seconds since the request came); streamed,
                   one chunk per block carries its block, even when its text is empty or held back for a stop string
  return_anchors   true: the prompt's tokens, the shared affix's span in them and the prompt positions ACache's
                   probe chose as anchors (`dllm.prompt_tokens`, `dllm.affix_span`, `dllm.anchors`; streamed: in
                   the first block's chunk)
`n` choices per prompt and (completions) a list of prompts, at most MAX_CHOICES choices a request: prompt i's j-th
choice, index i * n + j, is decoded with seed + j (the server's `_serve_choices`). A stream's usage comes in its
last chunk, or with stream_options {"include_usage": true} in a chunk of no choices after it (OpenAI's). A chat
message's content is a string or a list of text parts, read joined by newlines.
OpenAI fields this engine has no use for are accepted at their neutral values (logprobs null, echo false,
penalties 0, ...) and refused otherwise; unknown fields are refused, naming them (a typo never passes silently).
`temperature` defaults to 0 (greedy, as LLaDA's and Dream's own generate), not the API's 1: set it to sample.
`top_p` and `top_k` filter Dream's sampler; LLaDA's remasking sampler has no such filter, so on a LLaDA model a
`top_p` below 1 or any `top_k` is a 400 rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    WithJsonSchema,
    field_validator,
)

# OpenAI fields accepted at these values only (anything else is a 400 naming the field)
NEUTRAL = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (False, None),
    "best_of": (1, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "suffix": (None,),
    "user": "any",
    "service_tier": "any",
    "store": "any",
    "metadata": "any",
    "parallel_tool_calls": "any",
    "tool_choice": ("none", None),
    "tools": (None, []),
}


MAX_CHOICES = 64  # choices a request may ask for (prompts x n): each is a request to the engine

# JSON types as the schema states them: no true for 1, no 3.0 for 3, no "0.5" for 0.5 (pydantic's lax mode would
# take them)
Int = StrictInt
Float = StrictFloat  # strict: an int is a float, true is not
TokenId = Annotated[StrictInt, Field(ge=0)]
NonEmpty = Annotated[str, Field(min_length=1)]


class AffixText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1)


class AffixMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: Int = Field(ge=0)


class AffixID(BaseModel):
    """An affix registered with POST /v1/affixes."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)


class AffixCreate(BaseModel):
    """POST /v1/affixes: a span many prompts will contain, as text or token ids (exactly one)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = Field(None, min_length=1)
    tokens: Annotated[list[TokenId], Field(min_length=1)] | None = None


class Affix(BaseModel):
    """A registered affix: name it in requests as {"affix": {"id": ...}}; DELETE /v1/affixes/{id} drops it."""

    id: str
    object: Literal["affix"]
    tokens: int = Field(description="its length in tokens")
    deleted: bool | None = None


class AuditGroup(BaseModel):
    """The audit of one affix at one technique setting."""

    affix: str = Field(description="the affix's id (as POST /v1/affixes names it)")
    setting: str = Field(description='"naive", "anchors:<ratio>" or "shallow:<depth>"')
    requests: int = Field(description="audited requests: answers compared with their exact twins")
    exact_matches: int
    exact_match_rate: float
    exact_match_interval: list[float] = Field(description="its 95% Wilson interval")
    mean_token_agreement: float = Field(description="the mean share of answer positions where the two agree")
    first_divergence: dict[str, int] = Field(description="block index -> audits whose answers first differ there")


class Calibration(BaseModel):
    """anchor_ratio or shallow_depth "auto" for one affix (`dllm_jax.audit.Calibrator` states the rule)."""

    affix: str
    technique: Literal["anchors", "shallow"] = Field(description="ACache's ratio or BiCache's depth is calibrated")
    ratio: float | None = Field(
        None, description="anchors: the ratio its requests are served at now (1: exactly, while it calibrates)"
    )
    depth: int | None = Field(
        None, description="shallow: the depth its requests are served at now (0: exactly, while it calibrates)"
    )
    calibrating_at: float | None = Field(None, description="the ratio or depth its calibration shadows decode at")
    samples: dict[str, dict[str, int]] = Field(
        description="ratio or depth -> {agree, n}: its comparisons with exact answers"
    )


class AuditReport(BaseModel):
    """GET /v1/audit. Shadow requests are the exact twins; they never reach a client."""

    fraction: float = Field(description="the share of affix-technique requests audited (--audit-fraction)")
    batch_invariant: bool = Field(
        description="answers are compared bit for bit (serve --batch-invariant); without it a mismatch may also be "
        "batching noise at a near tie"
    )
    audited: int
    shadows: int = Field(description="shadow requests queued")
    shadows_finished: int
    dropped: int = Field(description="shadows dropped for a user request that waited")
    skipped: int = Field(description="audits not started: too many waiting")
    incomplete: int = Field(description="audits given up: the served request was cut short (stop string, client)")
    shadow_tokens: int = Field(description="answer tokens the shadows generated (not in the users' counters)")
    shadow_abort: int = Field(description="shadows aborted (dropped, or no longer needed)")
    shadow_error: int = Field(description="shadows whose device call failed")
    pending: int = Field(description="audits waiting for room")
    groups: list[AuditGroup]
    target: float = Field(description='"auto": the share of answers that must equal the exact ones')
    calibration: list[Calibration]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI's later options: taken, nothing to do with them here
    include_usage: StrictBool = Field(
        False, description="usage in a last chunk of no choices (every other chunk's usage null), as OpenAI sends it"
    )


class AffixSpan(BaseModel):
    """Token positions [start, end) of the prompt (for prompts sent as token ids)."""

    model_config = ConfigDict(extra="forbid")
    start: Int = Field(ge=0)
    end: Int = Field(ge=1)


class Diffusion(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="allow")  # checked against NEUTRAL in `check_extra`
    model: str
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=4)] | None = Field(None, validate_default=True)
    seed: Int | None = Field(None, description="an integer in [-2**63, 2**63) (the engine checks it: `seed_key`)")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(
        1,
        ge=1,
        le=MAX_CHOICES,
        description="choices per prompt: the j-th decoded with seed + j (all equal at temperature 0)",
    )
    steps: Int | None = Field(None, ge=1)
    block_length: Int | None = Field(None, ge=1)
    threshold: Float | None = Field(None, gt=0, le=1)
    factor: Float | None = Field(None, gt=0)
    top_k: Int | None = Field(None, ge=1)
    affix_technique: Literal["none", "naive", "anchors", "shallow"] | None = None
    anchor_ratio: Annotated[Float, Field(ge=0, le=1)] | Literal["auto"] | None = None
    shallow_depth: Annotated[Int, Field(ge=0)] | Literal["auto"] | None = None
    timeout: Float | None = Field(
        None, gt=0, description="seconds after which the request ends unfinished (504); default: --request-timeout"
    )
    affix: Literal["auto", "none"] | AffixText | AffixMessage | AffixSpan | AffixID = "auto"
    return_commit_steps: StrictBool = False
    return_anchors: StrictBool = False

    @field_validator("anchor_ratio", mode="before")  # before the types: this message rather than a union's
    @classmethod
    def _ratio(cls, v):
        if v is not None and v != "auto" and (isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1):
            raise ValueError('anchor_ratio takes a number in [0, 1] or "auto"')
        return v

    @field_validator("shallow_depth", mode="before")
    @classmethod
    def _depth(cls, v):
        if v is not None and v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError('shallow_depth takes an integer >= 0 or "auto"')
        return v

    @field_validator("stop", mode="before")  # before the types: this message rather than a union's
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v if isinstance(v, list) else [] if v is None else None
        if stops is None or len(stops) > 4 or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def check_extra(self) -> None:
        for name, value in (self.model_extra or {}).items():
            allowed = NEUTRAL.get(name)
            if allowed is None:
                raise ValueError(f"unrecognized request argument: {name}")
            if allowed != "any" and not any(_same(value, a) for a in allowed):
                raise ValueError(f"{name}={value!r} is not supported by this engine")


def _same(value, neutral) -> bool:
    """JSON equality: false is not 0."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


class CompletionRequest(Diffusion):
    prompt: (
        NonEmpty
        | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]
    )

    @field_validator("prompt", mode="before")  # before the types: these messages rather than a union's
    @classmethod
    def _prompts(cls, v):
        if v == "" or v == [] or (isinstance(v, list) and any(p == "" or p == [] for p in v)):
            raise ValueError("a prompt is empty")
        token_ids = lambda p: isinstance(p, list) and all(type(t) is int for t in p)  # noqa: E731
        if not (
            isinstance(v, str)
            or token_ids(v)
            or (isinstance(v, list) and (all(isinstance(p, str) for p in v) or all(token_ids(p) for p in v)))
        ):
            raise ValueError("prompt takes a string, a list of strings, token ids, or a list of token id lists")
        if isinstance(v, list) and isinstance(v[0], str | list) and len(v) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts a request")
        if any(
            t < 0 for p in (v if isinstance(v, list) and isinstance(v[0], list) else [v]) if token_ids(p) for t in p
        ):
            raise ValueError("token ids are >= 0")
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
            v = v[0]
        return v

    def prompts(self) -> list:
        """The prompts, each a string or a list of token ids."""
        batch = isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list)
        return list(self.prompt) if batch else [self.prompt]


def message_text(content: str | list) -> str:
    """A message's content as one string: text parts joined by newlines (as vLLM joins them); other parts (images,
    audio, files) are refused by name (ValueError): the model reads text only."""
    if isinstance(content, str):
        return content
    if not content:
        raise ValueError("a content list needs at least one text part")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise ValueError(f"content part {i} is of type {kind!r}: this model reads text only")
        if kind != "text" or set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise ValueError(f'content part {i} is not a text part {{"type": "text", "text": "..."}}')
        texts.append(part["text"])
    return "\n".join(texts)


# a message's content as the API takes it (held as one string: `Message._text_parts`)
CONTENT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                "required": ["type", "text"],
                "additionalProperties": False,
            },
        },
    ],
    "description": 'a string, or text parts ({"type": "text", "text": ...}), read joined by newlines',
}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: Annotated[str, WithJsonSchema(CONTENT_SCHEMA)]

    @field_validator("content", mode="before")  # before the types: these messages rather than a union's
    @classmethod
    def _text_parts(cls, v):
        return message_text(v) if isinstance(v, list) else v


class ChatRequest(Diffusion):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt's or a chat's token ids, as the server reads them; e.g. to name an
    affix by its token span ({"affix": {"start": s, "end": e}})."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = Field(None, description="a prompt, or messages")
    messages: list[Message] | None = Field(None, min_length=1, description="a chat, or a prompt")
    add_generation_prompt: StrictBool = Field(True, description="chat: end with the assistant's turn, as served")


class Tokenized(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int = Field(description="the longest prompt + answer the server takes")


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text (special tokens kept)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


class Detokenized(BaseModel):
    prompt: str


class APIError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type_ or {
            400: "invalid_request_error",
            401: "authentication_error",
            408: "timeout_error",
            413: "invalid_request_error",
            404: "not_found_error",
            405: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
            504: "timeout_error",
        }.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- response shapes (what the OpenAPI schema documents; the handlers build the same dicts) -------------------
class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error, server_error, ...")
    param: str | None = Field(None, description="the request field at fault, where there is one")
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionChoice(_Choice):
    text: str


class BlockTrace(BaseModel):
    """One block of the answer as the denoising loop wrote it (return_commit_steps)."""

    block: int = Field(description="the block's index in the answer")
    token_ids: list[int] = Field(description="its tokens within max_tokens (stop strings cut the text, not these)")
    tokens: list[str] = Field(description="each token's text")
    commit_steps: list[int] = Field(description="per token, the step inside the block that committed it (0 first)")
    elapsed_s: float = Field(description="seconds from the request's arrival to the block's commit reaching it")


class Trace(BaseModel):
    """How the answer was decoded (`dllm`, with return_commit_steps or return_anchors)."""

    blocks: list[BlockTrace] | None = None
    prompt_tokens: list[str] | None = Field(None, description="return_anchors: each prompt token's text")
    affix_span: list[int] | None = Field(None, description="[start, end) of the shared affix in the prompt's tokens")
    anchors: list[int] | None = Field(None, description="the prompt positions ACache recomputes for this request")


class Completion(BaseModel):
    """POST /v1/completions; with stream: true, chunks of this shape (the last with usage), then [DONE]."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    dllm: Trace | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: ChatMessage


class ChatCompletion(BaseModel):
    """POST /v1/chat/completions without stream (streamed: chat.completion.chunk objects with a delta, then
    [DONE])."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    dllm: Trace | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "failed"]
    error: str | None = Field(None, description="why the server cannot serve (with 503)")


class Readiness(BaseModel):
    status: Literal["ready", "warming", "draining", "failed"]
    programs: int | None = Field(None, description="while warming: the programs being compiled")
    seconds: float | None = Field(None, description="while warming: seconds so far")
    error: str | None = None


def parse(model_cls: type[BaseModel], body: Any) -> Any:
    """The request, or an APIError 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model_cls.model_validate(body)
        if isinstance(req, Diffusion):
            req.check_extra()
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix to our validators' own messages
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from None
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(":")[-1].strip().split("=")[0]) from None
    return req


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    use: dict | None,
    chat: bool,
    chunk: bool = False,
    first: bool = False,
    index: int = 0,
) -> dict:
    """A response or a stream chunk of either endpoint (index: its choice's)."""
    if chat:
        if chunk:
            delta = {"content": text} if not first else {"role": "assistant", "content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body
