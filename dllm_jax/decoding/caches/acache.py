"""ACache (Affix Cache for DLLMs): a shared affix's K/V computed alone, plus per-request anchors.

A request's prompt contains a shared affix (a prefix, infix or suffix span: few-shot examples, a document). With
bidirectional attention the affix's K/V depend on the rest of the request, so reusing the K/V computed from the
affix alone is stale (the "naive" reuse, `affix="naive"`); recomputing them costs a forward over the whole affix.
ACache recomputes only a few affix tokens, the anchors:

1. Shared cache: every affix slot holds the K/V of a forward over the affix alone (`affix_alone_cache`).
2. Probe (once per request, one NFE): forward the request's own positions (its prompt tokens outside the affix
   and the whole generation region) against [shared affix K/V + their own fresh K/V]. In every layer and head,
   each [MASK] query's softmax over the affix keys only is summed over queries, heads and layers (fp32):
   an importance per affix token. The top K = min(ceil(ratio * affix_len), affix_len) are the anchors.
3. Decoding: every block start forwards only the gathered window [anchors | request prompt | generation region]
   and writes its K/V through a scattered `CacheWrite`; the other affix slots keep the shared K/V for the whole request.
   In-block steps are the wrapped Fast-dLLM strategy's own (prefix or dual), which never touch the prompt.

Identities (tests/test_acache.py): ratio 0 decodes as the naive reuse, ratio 1 as the plain cache (plus the probe).
The window is built on the host (`anchor_inputs`): a fixed width per batch, so nothing recompiles per block; a row
with a shorter window repeats the first generation slot with its write disabled (never a sentinel index).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding.caches.base import BlockStartOnly, CacheStrategy, DecodeInputs, gather_rows
from dllm_jax.transformer import XLA, CacheWrite, ForwardOutput, KVCache, WindowChunks, forward
from dllm_jax.transformer.attention import grouped_scores
from dllm_jax.transformer.layers import apply_rope, rope_cos_sin

Array = jax.Array


def anchor_count(affix_len: int, ratio: float) -> int:
    """How many of an affix's tokens are recomputed: min(ceil(ratio * len), len) (the paper's rule)."""
    return min(math.ceil(ratio * affix_len - 1e-9), affix_len)


def rank_anchors(scores: Array, affix: Array, k: int) -> Array:
    """[B, k] int32: each row's k highest-scoring affix positions (`affix` True), best first, ties to the lower
    position: the one anchor choice, of `prepare` and of the serving engine's probe (its first K of them)."""
    return jax.lax.top_k(jnp.where(affix, scores, -jnp.inf), k)[1].astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AnchorInputs:
    """Per-request device inputs of the affix cache, built on the host by `anchor_inputs`."""

    affix: Array  # [B, T] bool: the row's shared-affix positions
    request: Array  # [B, R] int32 slots of the request's own positions (prompt outside the affix, then generation)
    request_writes: Array  # [B, R] bool: False on the repeated filler slots
    anchor_counts: Array  # [B] int32: K per row
    max_anchors: int = dataclasses.field(metadata=dict(static=True))  # max K over the batch (window width part)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AnchoredState:
    kv: KVCache
    window: Array  # [B, W] int32 slots forwarded at every block start: [anchors | request prompt | generation]
    writes: Array  # [B, W] bool: False on filler slots (and on a suffix affix's last token, see anchor_inputs)
    importance: Array  # [B, T] float32: the probe's score per position (0 outside the affix), for inspection
    # where the blocks sit in the window: buffer column `block_col` is at window index `block_index`, one for every
    # row (the generation region's start in `generate`) or one per row [B] (the current block in the serving engine)
    block_col: Array | int = 0
    block_index: Array | int = 0
    # run the window in chunks, only its live ones (a window padded to one width for every call)
    chunks: WindowChunks | None = None


def anchor_inputs(
    spans: Sequence[tuple[int, int] | None], pads: np.ndarray, prompt_len: int, total_len: int, ratio: float
) -> AnchorInputs:
    """Host-side layout of the affix cache for a batch laid out as [left pad][prompt][generation].

    spans: per row the affix [start, end) in prompt coordinates (None: no affix); pads: per row left padding.
    The request part of each row lists its real prompt positions outside the affix in order, and always the
    prompt's last position P - 1 (Dream predicts the first generated token from there; when it is affix it is
    forwarded but not written, so its shared K/V stay), then the generation region P..T-1, which therefore sits
    at the same offset of every row's window.
    """
    b = len(spans)
    affix = np.zeros((b, total_len), bool)
    prompt_parts, writes, counts = [], [], []
    for i, span in enumerate(spans):
        if span is not None:
            s, e = span
            affix[i, pads[i] + s : pads[i] + e] = True
        own = [j for j in range(int(pads[i]), prompt_len) if not affix[i, j] or j == prompt_len - 1]
        prompt_parts.append(own)
        writes.append([not affix[i, j] for j in own])
        counts.append(anchor_count(int(affix[i].sum()), ratio))
    width = max(len(p) for p in prompt_parts)
    gen = list(range(prompt_len, total_len))
    # fillers go first and repeat slot P (the first generation position, present in every row) unwritten
    request = np.array([[prompt_len] * (width - len(p)) + p + gen for p in prompt_parts], np.int32)
    request_writes = np.array(
        [[False] * (width - len(p)) + w + [True] * len(gen) for p, w in zip(prompt_parts, writes)], bool
    )
    return AnchorInputs(
        affix=jnp.asarray(affix),
        request=jnp.asarray(request),
        request_writes=jnp.asarray(request_writes),
        anchor_counts=jnp.asarray(np.array(counts, np.int32)),
        max_anchors=max(counts),
    )


def alone_forward(params, config, inp: DecodeInputs, x: Array, part: Array, **kwargs) -> ForwardOutput:
    """A forward in which every query attends only each row's `part` keys, writing K/V only there: at `part` they
    are exactly those of a forward over the part by itself, at its absolute positions; other slots stay zero."""
    cache = KVCache.for_params(params, config, x.shape[0], x.shape[1])
    # a masked forward: XLA's attention (cuDNN's masked path is not validated)
    return forward(
        params,
        config,
        x,
        inp.positions,
        key_mask=part & inp.key_mask,
        cache=cache,
        write=CacheWrite.at(0, part),
        kernels=dataclasses.replace(inp.kernels, attention="xla"),
        **kwargs,
    )


def affix_alone_cache(params, config, inp: DecodeInputs, x: Array, affix: Array) -> KVCache:
    """K/V of each row's affix computed from the affix ALONE (keys restricted to it), at its absolute positions."""
    return alone_forward(params, config, inp, x, affix, logits_at=jnp.zeros((x.shape[0], 1), jnp.int32)).cache


@dataclasses.dataclass(frozen=True)
class SharedAffix:
    """An affix's K/V computed ONCE, from the affix alone at RoPE positions 0..A-1, for any number of requests
    (`build_shared_affix`; `generate(..., shared_affix=...)` places it into every row that has an affix span
    instead of running the affix-alone forward per call).

    Placing it at a row whose affix starts at RoPE position o rotates K by o more (RoPE rotations compose:
    R(o) R(p) = R(o + p)), in fp32 with one rounding (a copy at o = 0: a prefix affix); V carries no position.
    The result equals the affix-alone forward at that offset up to that rounding and the forward's own."""

    tokens: tuple[int, ...]
    k: Array  # [L, A, Hkv, D] rotated at positions 0..A-1
    v: Array  # [L, A, Hkv, D]

    def __len__(self) -> int:
        return len(self.tokens)


def build_shared_affix(params, config, tokens: Sequence[int]) -> SharedAffix:
    """One forward over the affix alone (bidirectional among its own tokens): its per-layer K/V."""
    ids = np.asarray(tokens)
    if ids.ndim != 1 or len(ids) == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"the shared affix must be a non-empty list of token ids, got {tokens!r:.80}")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"the shared affix has token ids outside [0, {config.vocab_size})")
    if len(ids) > config.max_seq_len:
        raise ValueError(f"the shared affix has {len(ids)} tokens, more than the model's maximum {config.max_seq_len}")
    x = jnp.asarray(ids, jnp.int32)[None]
    out = _affix_forward(params, config, x, jnp.arange(len(ids), dtype=jnp.int32)[None])
    k, v = out.kv
    return SharedAffix(tokens=tuple(int(t) for t in ids), k=k[:, 0], v=v[:, 0])


@functools.partial(jax.jit, static_argnames=("config",))
def _affix_forward(params, config, x, positions):
    return forward(params, config, x, positions, logits_at=jnp.zeros((1, 1), jnp.int32), return_kv=True, kernels=XLA)


def place_shared_affix(
    params,
    config,
    shared_k: Array,
    shared_v: Array,
    starts: Array,
    rope_offsets: Array,
    has_affix: Array,
    batch: int,
    length: int,
) -> KVCache:
    """A cache [B, T] (the params' layout) holding the shared affix's K/V at slots starts[r] + 0..A-1 of every
    row with has_affix, K rotated by rope_offsets[r]; everything else zero (the decoding forwards write it)."""
    n_layers, a = shared_k.shape[:2]
    cos, sin = rope_cos_sin(rope_offsets[:, None], config.head_dim, config.rope_theta)  # [B, 1, D]
    slots = jnp.where(has_affix[:, None], starts[:, None] + jnp.arange(a)[None], length)  # past the end: dropped
    rows = jnp.arange(batch)[:, None]
    cache = KVCache.for_params(params, config, batch, length)
    ks, vs = list(cache.k), list(cache.v)  # per layer (a stacked cache's leading axis)

    # one layer at a time: the rotated fp32 copy of a whole [L, B, A, Hkv, D] affix would be GBs at LLaDA-8B
    for i in range(n_layers):
        k = apply_rope(jnp.broadcast_to(shared_k[i], (batch,) + shared_k.shape[1:]), cos, sin, fp32=True)
        v = jnp.broadcast_to(shared_v[i], k.shape)
        ks[i] = ks[i].at[rows, slots].set(k.astype(ks[i].dtype), mode="drop")
        vs[i] = vs[i].at[rows, slots].set(v.astype(vs[i].dtype), mode="drop")
    if cache.per_layer:
        return KVCache(tuple(ks), tuple(vs))
    return KVCache(jnp.stack(ks), jnp.stack(vs))


PROBE_CHUNK = 512  # queries scored at once by the probe (longer windows: a loop over chunks)
SPAN_CHUNK = 256  # the serving engine's probe: a probed row's [MASK] queries scored this many at a time


def _probe_part(affix_keys: Array, q: Array, k: Array, queries: Array) -> Array:
    """[B, S]: the softmax over the affix keys only of q.k / sqrt(d), summed over the `queries` [B, n] and heads.
    Each probability is exp(score - logsumexp): the fp32 scores are read three times (max, sum, the weighted sum)
    and no probability array is written (at the serving engine's widths the scores are the probe's cost)."""
    scores = grouped_scores(q, k)  # fp32 accumulation (exact bf16 products on the GPU's tensor cores)
    scores = jnp.where(affix_keys[:, None, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row without affix keys: all zeros
    lse = m + jnp.log(jnp.maximum(jnp.sum(jnp.exp(scores - m), axis=-1, keepdims=True), 1e-30))
    weights = jnp.where(queries[:, None, None, :, None], jnp.exp(scores - lse), 0.0)
    return jnp.sum(weights, axis=(1, 2, 3))


def _chunked(affix_keys: Array, q: Array, k: Array, queries: Array) -> Array:
    """_probe_part over PROBE_CHUNK queries at a time, so the fp32 scores [B, H, chunk, S] stay bounded (a whole
    4096-token window of 8 rows against a 4096-key list would take ~70 GiB)."""
    n = q.shape[1]
    if n <= PROBE_CHUNK:
        return _probe_part(affix_keys, q, k, queries)
    pad = -n % PROBE_CHUNK
    qc = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(q.shape[0], -1, PROBE_CHUNK, *q.shape[2:])
    mc = jnp.pad(queries, ((0, 0), (0, pad))).reshape(q.shape[0], -1, PROBE_CHUNK)
    chunk = lambda c: _probe_part(affix_keys, c[0], k, c[1])  # noqa: E731
    return jax.lax.map(chunk, (jnp.moveaxis(qc, 1, 0), jnp.moveaxis(mc, 1, 0))).sum(axis=0)


def _spans(affix_keys: Array, q: Array, k: Array, queries: Array) -> Array:
    """_probe_part of q [B, n, H, D] over only the span of each row's `queries` [B, n], SPAN_CHUNK at a time: a
    probed row's queries are its generation region, a few hundred of the window's thousands."""
    n = queries.shape[1]
    has = queries.any(axis=1)
    first = jnp.where(has, jnp.argmax(queries, axis=1), 0)
    end = jnp.where(has, n - jnp.argmax(queries[:, ::-1], axis=1), 0)
    count = jnp.max(-(-(end - first) // SPAN_CHUNK))
    offsets = jnp.arange(SPAN_CHUNK, dtype=jnp.int32)

    def chunk(j, total):
        at = (first + j * SPAN_CHUNK)[:, None] + offsets[None]  # [P, chunk]; past a row's span: masked out
        idx = jnp.minimum(at, n - 1)
        mask = jnp.take_along_axis(queries, idx, axis=1) & (at < end[:, None])
        return total + _probe_part(affix_keys, q[jnp.arange(q.shape[0])[:, None], idx], k, mask)

    return jax.lax.fori_loop(0, count, chunk, jnp.zeros(affix_keys.shape, jnp.float32))


def affix_importance_probe(affix_keys: Array, mask_queries: Array):
    """The probe hook for `modeling.forward`: per layer, for every head, the softmax over the affix keys only of
    q.k / sqrt(d) at the [MASK] queries, summed over those queries and heads -> [B, S] float32.

    affix_keys: [B, S] bool; mask_queries: [B, n] bool (the window's [MASK] positions, fillers excluded)."""

    def probe(q: Array, cache, i) -> Array:
        return _chunked(affix_keys, q, cache.keys(i), mask_queries)

    return probe


def row_importance_probe(affix_keys: Array, mask_queries: Array):
    """What `affix_importance_probe` gives, each row scored over only the span of its own [MASK] queries (the
    serving engine's probe, whose windows are padded to max_model_len: a fixed-width window would score them all)."""

    def probe(q: Array, cache, i) -> Array:
        return _spans(affix_keys, q, cache.keys(i), mask_queries)

    return probe


def forward_window(
    params,
    config,
    inp: DecodeInputs,
    kv: KVCache,
    x: Array,
    window: Array,
    writes: Array,
    logits_at: Array,
    probe=None,
    chunks: WindowChunks | None = None,
):
    return forward(
        params,
        config,
        gather_rows(x, window),
        gather_rows(inp.positions, window),
        key_mask=inp.attn_mask,
        cache=kv,
        write=CacheWrite.scatter(window, writes),
        logits_at=logits_at,
        probe=probe,
        chunks=chunks,
        kernels=inp.kernels,
    )


def prepare(params, config, inp: DecodeInputs, a: AnchorInputs, x: Array, kv: KVCache | None = None) -> AnchoredState:
    """Shared affix K/V (`kv`: already placed, e.g. by `place_shared_affix`; None: computed here from each row's
    affix alone), the probe forward (one NFE) and the anchor choice: the state decoding starts from."""
    if kv is None:
        kv = affix_alone_cache(params, config, inp, x, a.affix)
    req_tokens = gather_rows(x, a.request)
    probe = affix_importance_probe(a.affix & inp.key_mask, (req_tokens == config.mask_token_id) & a.request_writes)
    out = forward_window(
        params, config, inp, kv, x, a.request, a.request_writes, jnp.zeros((x.shape[0], 1), jnp.int32), probe
    )
    importance = jnp.where(a.affix, out.probe, 0.0)
    b = x.shape[0]
    if a.max_anchors == 0:
        anchors = jnp.zeros((b, 0), jnp.int32)
        anchor_writes = jnp.zeros((b, 0), bool)
    else:
        # top-K of the affix positions (ties: the lower position), then ranks past the row's own K are fillers
        top = rank_anchors(out.probe, a.affix, a.max_anchors)
        anchor_writes = jnp.arange(a.max_anchors)[None, :] < a.anchor_counts[:, None]
        # in position order; the fillers (marked past the end) sort last, where anchor_writes is already False
        anchors = jnp.sort(jnp.where(anchor_writes, top, x.shape[1]), axis=1)
        anchors = jnp.where(anchor_writes, anchors, inp.prompt_len).astype(jnp.int32)
    window = jnp.concatenate([anchors, a.request], axis=1)
    gen_index = window.shape[1] - (x.shape[1] - inp.prompt_len)  # the generation region ends every row's window
    return AnchoredState(
        kv=out.cache,
        window=window,
        writes=jnp.concatenate([anchor_writes, a.request_writes], axis=1),
        importance=importance,
        block_col=inp.prompt_len,
        block_index=gen_index,
    )


@dataclasses.dataclass(frozen=True)
class AnchoredRefresh(BlockStartOnly):
    """Wraps a Fast-dLLM strategy (prefix or dual): block starts forward only [anchors | request]; in-block steps
    are the wrapped strategy's. Its state is built by `prepare` (generate passes it as the loop's initial cache)."""

    inner: CacheStrategy
    name: str = "anchors"

    def init(self, params, config, inp: DecodeInputs, x):
        raise ValueError("the affix cache's state comes from acache.prepare (it needs the affix spans)")

    def block_start(self, params, config, inp: DecodeInputs, state: AnchoredState, x, block_start):
        first = jnp.reshape(state.block_index + (block_start - state.block_col), (-1, 1))  # per row, or one for all
        idx = first + jnp.arange(inp.block_length) - inp.shift
        at = jnp.broadcast_to(jnp.maximum(idx, 0), (x.shape[0], inp.block_length))
        out = forward_window(params, config, inp, state.kv, x, state.window, state.writes, at, None, state.chunks)
        return out.logits, dataclasses.replace(state, kv=out.cache)
