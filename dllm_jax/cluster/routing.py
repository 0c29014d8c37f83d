"""Which engine replica serves a request: the cluster's affix-aware routing rule, as host logic (no Ray here).

A shared affix saves work only on the replica that stores it, so requests that share one should meet there. The
ingress keys each request by what it can see without an engine's history (`route_key`):
  * a registered affix (its public id, "affix-<len>-<hash>": a content key, the same on every replica),
  * an explicit affix (a span of the prompt, or text / a message the ingress located in it): the same content
    key as registering it would give,
  * else the prompt's leading `lead_tokens` tokens (a discovered prefix: a shared system prompt, few-shot
    examples or a document placed first), hashed;
and no key for prompts shorter than that. A key's owner is the replica that rendezvous hashing (highest random
weight) ranks first among the live ones: every ingress agrees without coordination, and a replica that leaves or
joins moves only the keys it owned or wins. `RoutingRule.choose` sends a keyed request to its owner unless the
owner's queue has reached `spill_queue`, and every other request (no key, or spilled) to the least loaded replica,
so one hot affix cannot starve the cluster: it spreads once its owner is busy, at the cost of storing it again
where it spills.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Collection, Mapping, Sequence

from dllm_jax.audit import affix_id
from dllm_jax.engine.block_manager import affix_key, token_bytes
from dllm_jax.server.protocol import message_text

LEAD_TOKENS = 64  # the leading prompt tokens that key a request without an explicit affix (four 16-token pages)
LEAD_CHARS = 256  # the same for a text prompt (about as many tokens of English)


def route_key(
    prompt: Sequence[int],
    span: tuple[int, int] | None = None,
    registered: str | None = None,
    lead_tokens: int = LEAD_TOKENS,
) -> str | None:
    """The routing key of a request with these prompt tokens: its registered affix's id, else its explicit affix
    span's content key (the id registering it would give), else a hash of its first `lead_tokens` tokens; None for
    a shorter prompt without an affix."""
    if registered is not None:
        return registered
    if span is not None:
        s, e = span
        if not 0 <= s < e <= len(prompt):
            raise ValueError(f"affix span {span} is not a non-empty span of the {len(prompt)}-token prompt")
        return affix_id(affix_key(prompt[s:e]))
    if lead_tokens < 1:
        raise ValueError(f"lead_tokens={lead_tokens} must be positive")
    if len(prompt) < lead_tokens:
        return None
    return "lead-" + hashlib.blake2b(token_bytes(prompt[:lead_tokens]), digest_size=16).hexdigest()


def request_route_key(body: Any, lead_tokens: int = LEAD_TOKENS, lead_chars: int = LEAD_CHARS) -> str | None:
    """The routing key of a completion or chat request's JSON body, read without a tokenizer (the ingress loads
    no model): a registered affix's id; an explicit affix's text (or the message it names) hashed; a token prompt
    by `route_key`; else the first `lead_chars` characters of the prompt (a chat's messages as role: content
    lines; a batch of prompts: its first), hashed; None for a shorter prompt or a body that is not a request (the
    replica answers its 400).
    A key only has to be the same for requests that share an affix: it need not be the engine's own."""
    if not isinstance(body, dict):
        return None
    affix, prompt, messages = body.get("affix"), body.get("prompt"), body.get("messages")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):  # a batch: keyed by its first
        prompt = prompt[0]
    tokens = prompt if isinstance(prompt, list) and all(type(t) is int for t in prompt) else None
    if isinstance(affix, dict):
        if isinstance(affix.get("id"), str):
            return affix["id"]
        if isinstance(affix.get("text"), str):
            return _text_key("affix", affix["text"])
        i = affix.get("message")
        if type(i) is int and isinstance(messages, list) and 0 <= i < len(messages):
            return _text_key("affix", str(_content(messages[i])))
        if tokens is not None and type(affix.get("start")) is int and type(affix.get("end")) is int:
            try:
                return route_key(tokens, (affix["start"], affix["end"]))
            except ValueError:
                return None
    if tokens is not None:
        return route_key(tokens, lead_tokens=lead_tokens) if tokens else None
    if isinstance(messages, list):
        prompt = "".join(f"{m.get('role')}: {_content(m)}\n" for m in messages if isinstance(m, dict))
    if not isinstance(prompt, str) or len(prompt) < lead_chars:
        return None
    return _text_key("lead", prompt[:lead_chars])


def _content(message: Any) -> Any:
    """A message's text as the replica reads it (text parts joined: `message_text`); else its content as sent."""
    content = message.get("content") if isinstance(message, dict) else None
    try:
        return message_text(content) if isinstance(content, list) else content
    except ValueError:  # not text: the replica answers its 400
        return content


def _text_key(kind: str, text: str) -> str:
    return f"{kind}-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def owner(key: str, replicas: Sequence[str]) -> str:
    """The replica rendezvous hashing gives `key`: the highest BLAKE2b score of (key, replica) among `replicas`."""
    if not replicas:
        raise ValueError("no live replica")

    def score(replica: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()

    return max(replicas, key=score)


@dataclasses.dataclass(frozen=True)
class RoutingRule:
    """spill_queue: the requests queued at (sent to and not yet answered by) an affix's owner from which more of
    that affix go to the least loaded replica instead. affinity=False: the control (least loaded for everything,
    round robin among equals), which stores every hot affix on every replica."""

    spill_queue: int = 8
    affinity: bool = True

    def __post_init__(self) -> None:
        if self.spill_queue < 1:
            raise ValueError(f"spill_queue={self.spill_queue} must be positive")

    def choose(
        self, key: str | None, queues: Mapping[str, int], turn: int = 0, warming: Collection[str] = ()
    ) -> tuple[str, bool]:
        """(the replica for a request with this key, given each live replica's queue, whether it spilled past its
        owner). turn breaks ties among the least loaded (a request counter: round robin among equals). warming:
        replicas still compiling their programs (a restarted one), passed over while a warm one is live: a request
        would wait there for the whole warm-up; their keys come back to them once warm."""
        if not queues:
            raise ValueError("no live replica")
        queues = {r: q for r, q in queues.items() if r not in warming} or queues
        live = sorted(queues)
        fewest = min(queues.values())
        tied = [r for r in live if queues[r] == fewest]
        least = tied[turn % len(tied)]
        if key is None or not self.affinity:
            return least, False
        first = owner(key, live)
        if queues[first] < self.spill_queue or queues[first] == fewest:
            return first, False
        return least, least != first
