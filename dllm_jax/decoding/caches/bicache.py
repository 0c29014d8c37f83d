"""BiCache: a shared prefix's K/V reused in the shallow layers only, to a depth chosen per request.

The K/V of a prefix computed alone stay close to their in-context values in the shallow layers, and the more of
the sequence the prefix is, the more layers stay close (the paper profiles this per model: the depth table).
A block start ("refresh") then runs:
  * layers < b on the request's own positions only (its prompt outside the prefix and the generation region,
    the gathered window of caches/acache.py), attending to the cached prefix-alone K/V;
  * at layer b, the prefix's hidden state computed alone is spliced back in front (but for the prompt's last
    position, whose query predicts Dream's first generated token and always runs in context);
  * layers >= b on the whole sequence (the prefix recomputed with the request), writing every K/V.
In-block steps are the wrapped Fast-dLLM strategy's own (prefix or dual). b = 0 is the plain cache exactly; b = L
is the naive reuse (tests/test_bicache.py).

The paper's shared part is a prefix; nothing here needs that (a hidden state computed alone does not depend on
where the span sits: attention sees only relative RoPE positions; its K are re-rotated when placed), so an infix
or suffix span works the same way. The depth tables were profiled on prefixes only.

Depth: b = table[largest key <= r], r = round(100 * prefix_len / (prompt_len + gen_length)), from the paper's
published tables at threshold 0.97 for LLaDA-8B-Instruct (32 layers) and Dream-v0-7B (28 layers); other models
set `Shallow(depth=...)`. A batch runs at the shallowest depth of its rows that have a prefix (safe for
each of them; one compiled program per depth), which is the paper's rule at batch 1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding.caches.acache import SharedAffix, alone_forward, build_shared_affix
from dllm_jax.decoding.caches.base import BlockStartOnly, CacheStrategy, DecodeInputs, block_logit_index, gather_rows
from dllm_jax.transformer import CacheWrite, KVCache, WindowChunks, forward

Array = jax.Array

# (family, n_layers) -> {r: depth}, arXiv 2606.07571 at similarity threshold 0.97
DEPTH_TABLES: dict[tuple[str, int], dict[int, int]] = {
    ("llada", 32): {
        0: 1,
        5: 2,
        10: 3,
        13: 5,
        15: 7,
        20: 8,
        21: 9,
        30: 10,
        49: 11,
        54: 13,
        66: 14,
        68: 15,
        73: 16,
        87: 17,
        93: 18,
        95: 19,
        97: 20,
        98: 22,
        99: 32,
    },
    ("dream", 28): {
        0: 1,
        9: 2,
        10: 4,
        19: 5,
        32: 6,
        47: 7,
        56: 8,
        63: 9,
        76: 12,
        85: 13,
        86: 14,
        92: 16,
        94: 17,
        95: 18,
        96: 28,
    },
}


def kv_similarity(params, config, x: Array, positions: Array, key_mask: Array, affix: Array) -> Array:
    """The paper's profile statistic, [B, L] float32: per layer, over each row's affix tokens, the mean of
    (cos(K alone, K in context) + cos(V alone, V in context)) / 2; alone = keys restricted to the affix."""
    at = jnp.zeros((x.shape[0], 1), jnp.int32)
    alone = forward(params, config, x, positions, key_mask=affix & key_mask, return_kv=True, logits_at=at).kv
    ctx = forward(params, config, x, positions, key_mask=key_mask, return_kv=True, logits_at=at).kv

    def cos(a, b):  # [L, B, n, H, D] -> [L, B, n]
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        dot = jnp.sum(a * b, axis=(-2, -1))
        return dot / jnp.maximum(jnp.linalg.norm(a, axis=(-2, -1)) * jnp.linalg.norm(b, axis=(-2, -1)), 1e-30)

    per_token = (cos(alone[0], ctx[0]) + cos(alone[1], ctx[1])) / 2
    w = affix.astype(jnp.float32)[None]
    return (jnp.sum(per_token * w, axis=-1) / jnp.maximum(jnp.sum(w, axis=-1), 1)).T


def depth_table_from_profile(
    ratios: Sequence[int], similarity: np.ndarray, threshold: float = 0.97, strict: bool = False
) -> dict[int, int]:
    """The paper's table from profiled rows: per ratio bucket r (percent of the sequence that is affix), the mean
    similarity per layer; b(r) = how many LEADING layers exceed `threshold`; only ratios where b grows are kept
    (a monotone staircase). The smallest profiled ratio's depth is keyed 0: it also serves shorter affixes (depth
    grows with r, so that errs on the safe side).
    strict: one layer fewer. At depth b the affix's hidden state computed alone enters layer b, so layer b's affix
    K/V are the alone ones too: the paper's count never looks at that layer (layer 1 always scores 1.0, so its
    rule never picks depth 0). strict asks layers 0..b all to pass (QUALITY.md: the bundled model needs it)."""
    similarity = np.asarray(similarity)
    table: dict[int, int] = {}
    for r in sorted(set(int(x) for x in ratios)):
        mean = similarity[np.asarray(ratios) == r].mean(axis=0)
        above = mean > threshold
        b = int(np.argmin(above)) if not above.all() else len(above)
        if strict:
            b = max(b - 1, 0) if b < len(above) else b
        if not table:
            table[0] = b
        elif b > max(table.values()):
            table[r] = b
    return table


def depth_from_table(table: dict[int, int], prefix_len: int, prompt_len: int, gen_length: int) -> int:
    """The paper's serving rule: r = round(100 * prefix / (prompt + gen)), depth = table[largest key <= r]."""
    r = round(100 * prefix_len / (prompt_len + gen_length))
    return table[max(k for k in table if k <= r)]


def batch_depth(
    config,
    spans: Sequence[tuple[int, int] | None],
    prompt_lens: Sequence[int],
    gen_length: int,
    depth: int | None,
    table: dict[int, int] | None = None,
) -> int:
    """The depth a batch runs at: `depth` if given, else the shallowest depth of its rows with an affix by
    `table` (`Shallow.table`, e.g. from bench/profile_bicache.py) or the published one."""
    if depth is not None:
        return depth
    table = table or DEPTH_TABLES.get((config.family, config.n_layers))
    if table is None:
        raise ValueError(
            f"no published BiCache depth table for a {config.n_layers}-layer {config.family} model "
            f"(tables: {sorted(DEPTH_TABLES)}); set Shallow(depth=0..{config.n_layers}) or "
            "Shallow(table=...) (bench/profile_bicache.py measures one)"
        )
    depths = [
        depth_from_table(table, e - s, n, gen_length)
        for (s, e), n in ((span, n) for span, n in zip(spans, prompt_lens) if span is not None)
    ]
    return min(depths) if depths else 0


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """A prefix computed once, alone: its per-layer K/V (a SharedAffix, at positions 0..A-1) and the hidden state
    entering every layer, hidden[l] [A, d] (hidden[L]: the last layer's output), for any request and depth."""

    affix: SharedAffix
    hidden: Array  # [L + 1, A, d]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.affix.tokens


def build_shared_prefix(params, config, tokens: Sequence[int]) -> SharedPrefix:
    affix = build_shared_affix(params, config, tokens)  # validates the tokens
    x = jnp.asarray(affix.tokens, jnp.int32)[None]
    return SharedPrefix(affix=affix, hidden=layer_inputs(params, config, x))


@functools.partial(jax.jit, static_argnames=("config",))
def layer_inputs(params, config, x: Array, key_mask: Array | None = None) -> Array:
    """The hidden state entering every layer of a forward over x [1, n] alone [L + 1, n, d]; key_mask [1, n]: the
    real tokens (a padded affix: the padding is never attended)."""
    pos = jnp.arange(x.shape[1], dtype=jnp.int32)[None]
    h = forward(params, config, x, pos, key_mask=key_mask, layers=(0, 0), output_hidden=True).hidden
    out = [h]
    for layer in range(config.n_layers):
        h = forward(params, config, h, pos, key_mask=key_mask, layers=(layer, layer + 1), output_hidden=True).hidden
        out.append(h)
    return jnp.concatenate(out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShallowState:
    kv: KVCache
    prefix_hidden: Array  # [B, T or F, d] the prefix-alone hidden state entering layer `depth` (zero elsewhere)
    window: Array  # [B, W] int32 slots of the request's own positions (acache.anchor_inputs' request part)
    writes: Array  # [B, W] bool
    # The deeper layers run on the whole buffer (`generate`) or on a gathered deep window [B, F] of buffer columns
    # (the serving engine, whose buffer is wider than any row): then prefix_hidden is in the deep window's space,
    # splice_at [B, W] says where each shallow-window entry's hidden state goes there (F: nowhere), and buffer
    # column block_col is at deep-window index block_index [B].
    deep: Array | None = None
    deep_writes: Array | None = None
    splice_at: Array | None = None
    block_col: Array | int = 0
    block_index: Array | int = 0
    # run the shallow window and the deep window in chunks, only their live ones (windows of one fixed width)
    chunks: WindowChunks | None = None
    deep_chunks: WindowChunks | None = None


def prefix_alone_state(
    params, config, inp: DecodeInputs, x: Array, prefix: Array, window: Array, writes: Array, depth: int
) -> ShallowState:
    """Each row's prefix computed alone (keys restricted to it) through layers < depth: their K/V, and the
    hidden state entering layer `depth` at the prefix positions."""
    out = alone_forward(params, config, inp, x, prefix, layers=(0, depth), output_hidden=True)
    return ShallowState(out.cache, jnp.where(prefix[:, :, None], out.hidden, 0), window, writes)


def shared_prefix_state(
    kv: KVCache, hidden_at_depth: Array, starts: Array, has_prefix: Array, window: Array, writes: Array
) -> ShallowState:
    """The same state from a SharedPrefix (built once): its K/V already placed at each row's prefix slots
    (`acache.place_shared_affix`; a prefix starts at RoPE position 0, so K is copied unrotated) and the hidden state
    entering layer `depth` [A, d], placed likewise."""
    batch, length = window.shape[0], kv.length
    a = hidden_at_depth.shape[0]
    slots = jnp.where(has_prefix[:, None], starts[:, None] + jnp.arange(a)[None], length)  # past the end: dropped
    hidden = jnp.zeros((batch, length, hidden_at_depth.shape[-1]), hidden_at_depth.dtype)
    hidden = hidden.at[jnp.arange(batch)[:, None], slots].set(
        jnp.broadcast_to(hidden_at_depth, (batch,) + hidden_at_depth.shape), mode="drop"
    )
    return ShallowState(kv, hidden, window, writes)


@dataclasses.dataclass(frozen=True)
class ShallowReuse(BlockStartOnly):
    """Wraps a Fast-dLLM strategy (prefix or dual): block starts reuse the prefix's K/V in layers < depth;
    in-block steps are the wrapped strategy's. Its state comes from `prefix_alone_state` / `shared_prefix_state`."""

    inner: CacheStrategy
    depth: int
    name: str = "shallow"

    def init(self, params, config, inp: DecodeInputs, x):
        raise ValueError("BiCache's state comes from bicache.prefix_alone_state (it needs the prefix spans)")

    def block_start(self, params, config, inp: DecodeInputs, state: ShallowState, x, block_start):
        b = x.shape[0]
        window = state.window
        shallow = forward(
            params,
            config,
            gather_rows(x, window),
            gather_rows(inp.positions, window),
            key_mask=inp.attn_mask,
            cache=state.kv,
            write=CacheWrite.scatter(window, state.writes),
            layers=(0, self.depth),
            output_hidden=True,
            chunks=state.chunks,
            kernels=inp.kernels,
        )
        # the window's hidden states replace the buffer's where it wrote, and at P - 1 even when that is affix:
        # Dream predicts the first generated token there, so its query runs in context in every layer (as with
        # the naive reuse); filler entries are dropped
        rows = jnp.arange(b)[:, None]
        if state.deep is None:
            splice = state.writes | (state.window == inp.prompt_len - 1)
            at = jnp.where(splice, state.window, x.shape[1])
        else:
            at = state.splice_at
        full = state.prefix_hidden.at[rows, at].set(shallow.hidden.astype(state.prefix_hidden.dtype), mode="drop")
        if state.deep is None:
            deep = forward(
                params,
                config,
                full,
                inp.positions,
                key_mask=inp.attn_mask,
                cache=shallow.cache,
                layers=(self.depth, config.n_layers),
                logits_at=block_logit_index(inp, block_start, 0, b),
                kernels=inp.kernels,
            )
        else:
            first = jnp.reshape(state.block_index + (block_start - state.block_col), (-1, 1))
            logits_at = jnp.maximum(first + jnp.arange(inp.block_length) - inp.shift, 0)
            deep = forward(
                params,
                config,
                full,
                gather_rows(inp.positions, state.deep),
                key_mask=inp.attn_mask,
                cache=shallow.cache,
                write=CacheWrite.scatter(state.deep, state.deep_writes),
                layers=(self.depth, config.n_layers),
                logits_at=logits_at,
                chunks=state.deep_chunks,
                kernels=inp.kernels,
            )
        return deep.logits, dataclasses.replace(state, kv=deep.cache)
