"""What `generate` needs for the shared-affix techniques (`CacheConfig.affix`: naive, anchors, shallow), in one
place: the host-side checks and device inputs (`affix_inputs`), and the loop's initial state (`initial_state`).

Each row's affix is either computed alone inside the call (from `affix_spans`) or placed from a shared build made
once (`acache.build_shared_affix`; `bicache.build_shared_prefix` for "shallow", which also needs hidden states).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding.caches import acache, bicache
from dllm_jax.decoding.caches.base import DecodeInputs
from dllm_jax.decoding.config import Anchors, NaiveReuse, Shallow

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AffixInputs:
    """Device inputs of one generate call's affix technique (a jit argument: its static fields are part of the
    compiled program's key)."""

    window: acache.AnchorInputs | None  # anchors / shallow: the affix mask and the request's own positions
    shared: tuple[Array, ...] | None  # a shared build: (k, v, first slots, RoPE offsets, has-affix) per row
    shared_hidden: Array | None  # shallow with a shared build: the hidden state entering layer `depth` [A, d]
    kind: str = dataclasses.field(metadata=dict(static=True))  # CacheConfig.affix_name
    depth: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # shallow: the reuse depth


def _spans_of_shared(prompts, tokens: Sequence[int], spans):
    """Each row's span of the shared affix: checked against the given spans, or found in the prompts."""
    want = list(tokens)
    if spans is None:
        found = []
        for i, p in enumerate(prompts):
            p = list(p)
            at = next((j for j in range(len(p) - len(want) + 1) if p[j : j + len(want)] == want), None)
            if at is None:
                raise ValueError(
                    f"prompt {i} does not contain the shared affix ({len(want)} tokens); pass "
                    "affix_spans with None for rows without it"
                )
            found.append((at, at + len(want)))
        return found
    for i, (p, span) in enumerate(zip(prompts, spans)):
        if span is not None and list(p[span[0] : span[1]]) != want:
            raise ValueError(f"affix span {span} of prompt {i} does not hold the shared affix's {len(want)} tokens")
    return spans


def resolve_spans(gc, config, prompts, spans, shared: Any) -> tuple[Sequence | None, Any, Any]:
    """Checks before any device work: (spans, the shared K/V build or None, the shared prefix build or None)."""
    prefix_entry = None
    if isinstance(shared, bicache.SharedPrefix):
        prefix_entry, shared = shared, shared.affix
    elif shared is not None and isinstance(gc.cache.affix, Shallow):
        raise ValueError(
            "affix='shallow' needs the prefix's hidden states too: build the shared part with "
            "bicache.build_shared_prefix"
        )
    if shared is not None:
        if gc.cache.affix is None:
            raise ValueError(
                "shared_affix needs an affix technique: CacheConfig(affix=NaiveReuse() | Anchors(ratio) "
                "| Shallow(depth))"
            )
        if shared.k.shape[0] != config.n_layers or shared.k.shape[2:] != (config.n_kv_heads, config.head_dim):
            raise ValueError(
                f"shared_affix K/V {shared.k.shape} do not fit this model ({config.n_layers} layers, "
                f"{config.n_kv_heads} K/V heads of {config.head_dim})"
            )
        spans = _spans_of_shared(prompts, shared.tokens, spans)
    if gc.cache.affix is not None and spans is None:
        raise ValueError(f"affix={gc.cache.affix_name!r} needs affix_spans (one (start, end) or None per prompt)")
    if spans is not None and len(spans) != len(prompts):
        raise ValueError(f"affix_spans has {len(spans)} entries for {len(prompts)} prompts")
    return spans, shared, prefix_entry


def affix_inputs(
    gc, config, prompts, spans, shared, prefix_entry, key_mask: np.ndarray, prompt_len: int, total_len: int
) -> AffixInputs:
    """The device inputs, from the laid-out batch (its key mask gives each row's left padding)."""
    pads = (~key_mask).sum(axis=1)
    window, depth, shared_hidden, placed = None, None, None, None
    technique = gc.cache.affix
    if isinstance(technique, (Anchors, Shallow)):
        ratio = technique.ratio if isinstance(technique, Anchors) else 0.0  # shallow: the request's positions only
        window = acache.anchor_inputs(spans, pads, prompt_len, total_len, ratio)
    if isinstance(technique, Shallow):
        depth = bicache.batch_depth(
            config,
            spans,
            [len(p) for p in prompts],
            gc.schedule.gen_length,
            technique.depth,
            dict(technique.table) if technique.table else None,
        )
        shared_hidden = None if prefix_entry is None else prefix_entry.hidden[depth]
    if shared is not None:
        starts = np.array([0 if s is None else s[0] for s in spans], np.int32)  # RoPE position = prompt index
        placed = (
            shared.k,
            shared.v,
            jnp.asarray(pads + starts, jnp.int32),
            jnp.asarray(starts),
            jnp.asarray(np.array([s is not None for s in spans])),
        )
    return AffixInputs(window, placed, shared_hidden, technique.name, depth)


def initial_state(params, config, inp: DecodeInputs, x: Array, frozen: Array, a: AffixInputs) -> tuple[Any, int]:
    """(the loop's initial cache state, NFEs spent before the loop) for the technique."""
    placed = None if a.shared is None else acache.place_shared_affix(params, config, *a.shared, *x.shape)
    if a.kind == NaiveReuse.name:
        return (placed if placed is not None else acache.affix_alone_cache(params, config, inp, x, frozen)), 0
    if a.kind == Anchors.name:
        return acache.prepare(params, config, inp, a.window, x, placed), 1  # the probe
    w = a.window
    if placed is not None:
        return bicache.shared_prefix_state(
            placed, a.shared_hidden, a.shared[2], a.shared[4], w.request, w.request_writes
        ), 0
    return bicache.prefix_alone_state(params, config, inp, x, w.affix, w.request, w.request_writes, a.depth), 0
