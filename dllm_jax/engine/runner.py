"""The one place that builds device inputs from requests and runs the model for the engine.

Per scheduling iteration a group of running requests (same schedule and sampler) finishes one block each in one
device call (`run_block`): the block start (the cache technique's refresh) and then every step of the block,
through `decoding.loop.BlockRunner` and the techniques of `decoding/caches` on a `PagedKV` view of the pool.

Layout of a call (host numpy, then one transfer):
  * the token buffer [B, T]: each row's prompt and generation region, left-padded so that every row's *current*
    block starts at one column C (rows may be at different blocks: continuous batching). T is fixed (twice the
    longest request) so the buffer never changes shape;
  * `col_slots` [B, T]: the private slot each column writes; the read list [B, R] of each row's keys (shared affix
    slots, rotated at read time by the affix's placement offset, then private ones);
  * the block-start window [B, W]: the columns the refresh recomputes (anchors, the request's own prompt tokens
    and its generation region), every row's current block at one window index.
R and W are rounded up to a ladder of buckets and B to a power of two, so a served workload compiles a handful of
programs once (`compiles` counts them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.decoding.caches.acache import AnchoredRefresh, AnchoredState, affix_importance_probe, _forward_window
from dllm_jax.decoding.caches.base import DecodeInputs
from dllm_jax.decoding.caches.dual import DualCache
from dllm_jax.decoding.loop import BlockRunner, fixed_step_count
from dllm_jax.engine.kv_pool import PagedKV
from dllm_jax.engine.request import Request
from dllm_jax.transformer import XLA, Kernels, forward

Array = jax.Array
STRATEGY = AnchoredRefresh(DualCache())  # every engine block start is a windowed refresh (all columns when unshared)


def bucket(n: int, smallest: int = 16) -> int:
    """n rounded up to the ladder 16, 24, 32, 48, 64, 96, ... (powers of two and their 1.5x: at most a third of a
    shape is padding)."""
    size = smallest
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def batch_bucket(n: int, max_batch: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return min(b, max(max_batch, n))


@dataclasses.dataclass
class Layout:
    """Host arrays of one device call."""

    x: np.ndarray
    positions: np.ndarray
    col_slots: np.ndarray
    read_slots: np.ndarray
    read_len: np.ndarray
    read_delta: np.ndarray
    read_shared: np.ndarray  # [B, R] bool: the entry reads the shared affix copy
    window: np.ndarray
    writes: np.ndarray
    block_col: int
    block_index: int
    keys: np.ndarray  # [B, 2] uint32 key data


class ModelRunner:
    def __init__(self, params: dict, config: ModelConfig, num_slots: int, max_len: int, max_batch: int,
                 kernels: Kernels):
        self.params, self.config = params, config
        self.num_slots, self.max_len, self.max_batch = num_slots, max_len, max_batch
        self.buffer_len = 2 * max_len  # C + the longest remaining region never exceeds it
        self.kernels = kernels
        shape = (num_slots, config.n_kv_heads, config.head_dim)
        zeros = jax.jit(lambda: tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(config.n_layers)))
        self.k, self.v = zeros(), zeros()
        self.shapes_seen: set = set()
        self.compiles = 0

    # ---- bookkeeping of compiled shapes ----------------------------------------------------------------------------
    def _note(self, key) -> None:
        if key not in self.shapes_seen:
            self.shapes_seen.add(key)
            self.compiles += 1

    # ---- layouts ---------------------------------------------------------------------------------------------------
    def _private_slots(self, r: Request, bm) -> np.ndarray:
        """Per logical index of the request (prompt, then generation region): its private slot, or -1 for a shared
        affix token read from the stored copy. Private order: own prompt tokens, the anchor slots, the generation
        region (fixed before the anchors are known)."""
        slots = np.asarray(bm.slots(r.pages, r.private_tokens()), np.int64)
        p = len(r.prompt)
        out = np.full(r.total_len, -1, np.int64)
        own = r.own_prompt_indices() if r.shares_affix else list(range(p))
        out[own] = slots[:len(own)]
        k = r.anchor_count
        if r.anchors:
            out[r.anchors] = slots[len(own):len(own) + len(r.anchors)]
        out[p:] = slots[len(own) + k:]
        return out

    def layout(self, reqs: Sequence[Request], bm, probe: bool = False) -> Layout:
        """The device inputs of one call over `reqs` (each at its current block; for the probe, at block 0 and with
        no anchors yet). The window lists what a block start recomputes."""
        cfg = self.config
        mask_id, pad_id = cfg.mask_token_id, cfg.pad_token_id
        b = batch_bucket(len(reqs), self.max_batch)
        t = self.buffer_len
        starts = [len(r.prompt) + (0 if probe else r.blocks_done) * r.block_length for r in reqs]
        c = max(starts)
        rows_pre, rows_tail, rows_read = [], [], []
        x = np.full((b, t), pad_id, np.int32)
        pos = np.zeros((b, t), np.int32)
        col_slots = np.full((b, t), self.num_slots, np.int32)
        for i, r in enumerate(reqs):
            p, g = len(r.prompt), r.gen_length
            pad = c - starts[i]
            cols = pad + np.arange(p + g)
            gen = r.generated if not probe else []
            x[i, cols] = np.asarray(r.prompt + gen + [mask_id] * (g - len(gen)), np.int32)
            pos[i, cols] = np.arange(p + g)
            priv = self._private_slots(r, bm)
            col_slots[i, cols[priv >= 0]] = priv[priv >= 0]
            # the read list: shared affix tokens (rotated by the affix's start) then private ones
            shared_idx = np.flatnonzero(priv < 0)
            if len(shared_idx):
                s = r.affix_span[0]
                entry_slots = np.asarray(bm.slots(r.affix_entry.pages, r.affix_len), np.int64)
                read = (entry_slots[shared_idx - s], np.full(len(shared_idx), s), np.ones(len(shared_idx), bool))
            else:
                read = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))
            private_idx = np.flatnonzero(priv >= 0)
            rows_read.append((np.concatenate([read[0], priv[private_idx]]),
                              np.concatenate([read[1], np.zeros(len(private_idx), np.int64)]),
                              np.concatenate([read[2], np.zeros(len(private_idx), bool)])))
            # the window: anchors, own prompt tokens, then P - 1 right before the generation region, always (Dream
            # predicts the first generated token from the entry before the block), unwritten when it is shared
            anchors = r.anchors if not probe else []
            recomputed = [j for j in anchors + r.own_prompt_indices() if j != p - 1]
            last_written = (p - 1) in anchors or (p - 1) in r.own_prompt_indices()
            entries = [(j, True) for j in recomputed] + [(p - 1, last_written)]
            k = 0 if probe else r.blocks_done
            head = entries + [(p + j, True) for j in range(k * r.block_length)]
            tail = [(p + j, True) for j in range(k * r.block_length, g)]
            rows_pre.append([(cols[j], w) for j, w in head])
            rows_tail.append([(cols[j], w) for j, w in tail])
        r_len = bucket(max(len(rr[0]) for rr in rows_read))
        read_slots = np.zeros((b, r_len), np.int32)
        read_len = np.zeros(b, np.int32)
        read_delta = np.zeros((b, r_len), np.int32)
        read_shared = np.zeros((b, r_len), bool)
        for i, (sl, de, sh) in enumerate(rows_read):
            read_slots[i, :len(sl)], read_delta[i, :len(de)], read_shared[i, :len(sh)] = sl, de, sh
            read_len[i] = len(sl)
        w_block = max(len(h) for h in rows_pre)
        w = bucket(w_block + max(len(tl) for tl in rows_tail))
        window = np.full((b, w), c, np.int32)  # fillers: the current block's first column, never written
        writes = np.zeros((b, w), bool)
        for i, (head, tail) in enumerate(zip(rows_pre, rows_tail)):
            at = w_block - len(head)
            for j, (col, wr) in enumerate(head + tail):
                window[i, at + j], writes[i, at + j] = col, wr
        keys = np.zeros((b, 2), np.uint32)
        for i, r in enumerate(reqs):
            keys[i] = r.key
        return Layout(x, pos, col_slots, read_slots, read_len, read_delta, read_shared, window, writes, c, w_block,
                      keys)

    def _paged(self, lay: Layout) -> tuple[dict, bool]:
        arrays = dict(col_slots=lay.col_slots, read_slots=lay.read_slots, read_len=lay.read_len,
                      read_delta=lay.read_delta)
        return {k: jnp.asarray(v) for k, v in arrays.items()}, bool((lay.read_delta != 0).any())

    # ---- device calls ---------------------------------------------------------------------------------------------
    def build_affix(self, tokens: Sequence[int], slots: Sequence[int]) -> None:
        """Compute an affix's K/V alone (positions 0..A-1) and store them at its entry's slots."""
        a = len(tokens)
        n = bucket(a)
        ids = np.zeros((1, n), np.int32)
        ids[0, :a] = tokens
        sl = np.full(n, self.num_slots, np.int32)
        sl[:a] = slots
        self._note(("affix", n))
        self.k, self.v = _build_affix(self.params, self.k, self.v, jnp.asarray(ids), jnp.asarray(sl), jnp.int32(a),
                                      config=self.config)

    def probe(self, reqs: Sequence[Request], bm) -> list[np.ndarray]:
        """ACache's one-shot probe of newly admitted requests (one NFE): per request the importance of each affix
        token (the [MASK] queries' softmax mass over the affix keys, summed over heads and layers)."""
        lay = self.layout(reqs, bm, probe=True)
        paged, rotate = self._paged(lay)
        self._note(("probe", lay.x.shape[0], lay.read_slots.shape[1], lay.window.shape[1], rotate))
        imp, self.k, self.v = _probe(self.params, self.k, self.v, jnp.asarray(lay.x), jnp.asarray(lay.positions),
                                     paged, jnp.asarray(lay.window), jnp.asarray(lay.writes),
                                     jnp.asarray(lay.read_shared), config=self.config, rotate=rotate,
                                     kernels=self.kernels)
        imp = np.asarray(imp)
        out = []
        for i, r in enumerate(reqs):
            n_shared = r.affix_len  # the shared entries lead the read list, in affix order
            out.append(imp[i, :n_shared])
        return out

    def run_block(self, reqs: Sequence[Request], bm, runner: BlockRunner) -> tuple[np.ndarray, np.ndarray, int]:
        """One block of every request: ([B, block_length] tokens of each row's block, new key data, steps)."""
        lay = self.layout(reqs, bm)
        paged, rotate = self._paged(lay)
        static_steps = runner.gc.kernels.step_loop == "auto" and fixed_step_count(runner.gc, self.config)
        self._note(("block", runner, lay.x.shape[0], lay.read_slots.shape[1], lay.window.shape[1], rotate))
        blk, keys, steps, self.k, self.v = _run_block(
            self.params, self.k, self.v, jnp.asarray(lay.x), jnp.asarray(lay.positions), paged,
            jnp.asarray(lay.window), jnp.asarray(lay.writes), jnp.asarray(lay.keys), jnp.int32(lay.block_col),
            jnp.int32(lay.block_index), runner=runner, rotate=rotate, kernels=self.kernels,
            static_steps=static_steps)
        return np.asarray(blk)[:len(reqs)], np.asarray(keys)[:len(reqs)], int(steps)


def _inputs(config, positions, block_length: int, kernels: Kernels) -> DecodeInputs:
    shift = 1 if config.family == "dream" else 0
    return DecodeInputs(positions=positions, key_mask=jnp.ones(positions.shape, bool),
                        frozen=jnp.zeros(positions.shape, bool), prompt_len=0, block_length=block_length,
                        shift=shift, kernels=kernels, padded=False, has_frozen=False)


def _view(config, k, v, paged: dict, rotate: bool) -> PagedKV:
    return PagedKV(k=k, v=v, **paged, rope_theta=config.rope_theta, rope_fp32=config.rope_fp32, rotate=rotate)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("k", "v"))
def _build_affix(params, k, v, ids, slots, length, *, config):
    n = ids.shape[1]
    mask = jnp.arange(n)[None] < length
    out = forward(params, config, ids, jnp.arange(n, dtype=jnp.int32)[None], key_mask=mask,
                  logits_at=jnp.zeros((1, 1), jnp.int32), return_kv=True, kernels=XLA)
    fk, fv = out.kv  # [L, 1, n, Hkv, D]
    k = tuple(k[i].at[slots].set(fk[i, 0].astype(k[i].dtype), mode="drop") for i in range(config.n_layers))
    v = tuple(v[i].at[slots].set(fv[i, 0].astype(v[i].dtype), mode="drop") for i in range(config.n_layers))
    return k, v


@functools.partial(jax.jit, static_argnames=("config", "rotate", "kernels"), donate_argnames=("k", "v"))
def _probe(params, k, v, x, positions, paged, window, writes, read_shared, *, config, rotate, kernels):
    inp = _inputs(config, positions, 1, kernels)
    kv = _view(config, k, v, paged, rotate)
    tokens = jnp.take_along_axis(x, window, axis=1)
    probe = affix_importance_probe(read_shared, (tokens == config.mask_token_id) & writes)
    out = _forward_window(params, config, inp, kv, x, window, writes, jnp.zeros((x.shape[0], 1), jnp.int32), probe)
    return out.probe, out.cache.k, out.cache.v


@functools.partial(jax.jit, static_argnames=("runner", "rotate", "kernels", "static_steps"),
                   donate_argnames=("k", "v"))
def _run_block(params, k, v, x, positions, paged, window, writes, keys, block_col, block_index, *, runner, rotate,
               kernels, static_steps):
    config = runner.config
    bl = runner.gc.schedule.block_length
    inp = _inputs(config, positions, bl, kernels)
    kv = _view(config, k, v, paged, rotate)
    state = AnchoredState(kv=kv, window=window, writes=writes, importance=jnp.zeros((x.shape[0], 1), jnp.float32),
                          block_col=block_col, block_index=block_index)
    s = runner.initial_state(x, state, jax.random.wrap_key_data(keys), max(runner.gc.max_steps_per_block(), 1))
    s = runner.run_block(params, inp, s, block_col, static_steps)
    blk = jax.lax.dynamic_slice_in_dim(s.x, block_col, bl, axis=1)
    return blk, jax.random.key_data(s.key), s.step, s.cache.kv.k, s.cache.kv.v
