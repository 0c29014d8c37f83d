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
import time
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
_COMPILES = [0]


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


def backend_compiles() -> int:
    """XLA compilations in this process so far (every program jax compiled, the engine's and anyone's): the count
    that must not move while a warmed-up engine serves."""
    if not _COMPILES[1:]:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _COMPILES.append(True)
    return _COMPILES[0]


def bucket(n: int, smallest: int = 16) -> int:
    """n rounded up to a multiple of 16, or of a sixteenth of its power of two past 512 (..., 512, 544, ..., 1024,
    1088, ...): at most 1/16 of a long shape is padding, and a workload of similar lengths compiles few shapes."""
    step = max(smallest, 1 << max(int(n - 1).bit_length() - 5, 0))
    return max(smallest, -(-n // step) * step)


@dataclasses.dataclass(frozen=True, order=True)
class Shape:
    """The shape of one device call besides its batch: the shared and private read lists (A, R), the block-start
    window (W) and whether a shared affix is read rotated (an infix or suffix placement)."""

    W: int
    R: int
    A: int
    rotate: bool

    def covers(self, other: "Shape") -> bool:
        return (self.W >= other.W and self.R >= other.R and self.A >= other.A
                and (self.rotate or not other.rotate))


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """A request's layout in its own logical indices (prompt, then generation region)."""

    private: np.ndarray  # [P + G] the private slot of each index, -1 where the shared copy is read
    shared: np.ndarray  # the shared copy's slots the request reads (its affix's non-anchor tokens, in order)
    delta: int  # the affix's RoPE offset (its start)
    window: np.ndarray  # the logical indices a block start recomputes
    writes: np.ndarray  # which of them write their K/V
    gen_index: int  # where the generation region starts in the window


@dataclasses.dataclass
class Layout:
    """Host arrays of one device call."""

    x: np.ndarray
    positions: np.ndarray
    col_slots: np.ndarray
    shared_slots: np.ndarray
    shared_len: np.ndarray
    shared_delta: np.ndarray
    own_slots: np.ndarray
    own_len: np.ndarray
    window: np.ndarray
    writes: np.ndarray
    block_col: int  # the buffer column where every row's current block starts
    block_index: np.ndarray  # [B] int32: where it sits in each row's window
    keys: np.ndarray  # [B, 2] uint32 key data
    rotate: bool  # read the shared list rotated (rotation by 0 changes no bit, so a warmed rotating program serves
    # prefix rows too)


class ModelRunner:
    def __init__(self, params: dict, config: ModelConfig, num_slots: int, max_len: int,
                 batch_sizes: Sequence[int], kernels: Kernels):
        self.params, self.config = params, config
        self.num_slots, self.max_len = num_slots, max_len
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.buffer_len = 2 * max_len  # C + the longest remaining region never exceeds it
        self.kernels = kernels
        shape = (num_slots, config.n_kv_heads, config.head_dim)
        zeros = jax.jit(lambda: tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(config.n_layers)))
        self.k, self.v = zeros(), zeros()
        self.shapes_seen: set = set()
        self.compiles = 0
        self.host_seconds = self.device_seconds = 0.0  # block calls: building inputs / running them
        # the shapes compiled at warm-up: a call runs the smallest one that covers what it needs
        self.warmed: list[Shape] = []

    # ---- bookkeeping of compiled shapes ----------------------------------------------------------------------------
    def _note(self, key) -> None:
        if key not in self.shapes_seen:
            self.shapes_seen.add(key)
            self.compiles += 1

    # ---- layouts ---------------------------------------------------------------------------------------------------
    def plan(self, r: Request, bm, probe: bool = False) -> RowPlan:
        """What does not change between a request's blocks (cached on the request until its anchors change)."""
        key = (probe, tuple(r.anchors))
        if r.plan is not None and r.plan[0] == key:
            return r.plan[1]
        p, g = len(r.prompt), r.gen_length
        # private slots per logical index (prompt, then generation region): own prompt tokens, the anchor slots,
        # the generation region (an order fixed before the anchors are known); -1: read from the shared copy
        slots = np.asarray(bm.slots(r.pages, r.private_tokens()), np.int64)
        own = np.asarray(r.own_prompt_indices() if r.shares_affix else range(p), np.int64)
        priv = np.full(p + g, -1, np.int64)
        priv[own] = slots[:len(own)]
        anchors = np.asarray([] if probe else r.anchors, np.int64)
        priv[anchors] = slots[len(own):len(own) + len(anchors)]
        priv[p:] = slots[len(own) + r.anchor_count:]
        shared_idx = np.flatnonzero(priv < 0)
        shared = np.zeros(0, np.int64)
        if len(shared_idx):
            shared = np.asarray(bm.slots(r.affix_entry.pages, r.affix_len), np.int64)[shared_idx - r.affix_span[0]]
        # the block-start window (logical indices): anchors, own prompt tokens, then P - 1 right before the
        # generation region, always (Dream predicts the first generated token from the entry before the block),
        # unwritten when it is shared, then the generation region
        recomputed = np.concatenate([anchors, np.asarray(r.own_prompt_indices(), np.int64)])
        recomputed = recomputed[recomputed != p - 1]
        window = np.concatenate([recomputed, [p - 1], p + np.arange(g)])
        writes = np.ones(len(window), bool)
        writes[len(recomputed)] = priv[p - 1] >= 0
        plan = RowPlan(priv, shared, r.affix_span[0] if len(shared) else 0, window, writes, len(recomputed) + 1)
        r.plan = (key, plan)
        return plan

    def layout(self, reqs: Sequence[Request], bm, probe: bool = False) -> Layout:
        """The device inputs of one call over `reqs` (each at its current block; for the probe, at block 0 and with
        no anchors yet)."""
        cfg = self.config
        b = next((n for n in self.batch_sizes if n >= len(reqs)), len(reqs))
        t = self.buffer_len
        plans = [self.plan(r, bm, probe) for r in reqs]
        done = [0 if probe else r.blocks_done for r in reqs]
        starts = [len(r.prompt) + k * r.block_length for r, k in zip(reqs, done)]
        c = max(starts)
        need = Shape(W=bucket(max(len(pl.window) for pl in plans)),
                     R=bucket(max(int((pl.private >= 0).sum()) for pl in plans)),
                     A=bucket(max(len(pl.shared) for pl in plans)) if any(len(pl.shared) for pl in plans) else 0,
                     rotate=any(pl.delta for pl in plans))
        shape = min((s for s in self.warmed if s.covers(need)), default=need)
        lay = Layout(x=np.full((b, t), cfg.pad_token_id, np.int32), positions=np.zeros((b, t), np.int32),
                     col_slots=np.full((b, t), self.num_slots, np.int32),
                     shared_slots=np.zeros((b, shape.A), np.int32), shared_len=np.zeros(b, np.int32),
                     shared_delta=np.zeros(b, np.int32), own_slots=np.zeros((b, shape.R), np.int32),
                     own_len=np.zeros(b, np.int32),
                     window=np.full((b, shape.W), c, np.int32),  # fillers: the current block's column, unwritten
                     writes=np.zeros((b, shape.W), bool), block_col=c, block_index=np.zeros(b, np.int32),
                     keys=np.zeros((b, 2), np.uint32), rotate=shape.rotate)
        for i, (r, pl) in enumerate(zip(reqs, plans)):
            p, g = len(r.prompt), r.gen_length
            pad = c - starts[i]  # every row's current block starts at column c
            gen = [] if probe else r.generated
            lay.x[i, pad:pad + p] = r.prompt
            lay.x[i, pad + p:pad + p + len(gen)] = gen
            lay.x[i, pad + p + len(gen):pad + p + g] = cfg.mask_token_id
            lay.positions[i, pad:pad + p + g] = np.arange(p + g)
            mine = pl.private >= 0
            lay.col_slots[i, pad + np.flatnonzero(mine)] = pl.private[mine]
            own = pl.private[mine]
            lay.own_slots[i, :len(own)], lay.own_len[i] = own, len(own)
            lay.shared_slots[i, :len(pl.shared)], lay.shared_len[i], lay.shared_delta[i] = pl.shared, len(pl.shared), pl.delta
            lay.window[i, :len(pl.window)], lay.writes[i, :len(pl.window)] = pad + pl.window, pl.writes
            lay.block_index[i] = pl.gen_index + done[i] * r.block_length
            lay.keys[i] = r.key
        return lay

    def _paged(self, lay: Layout) -> tuple[dict, bool]:
        arrays = dict(col_slots=lay.col_slots, shared_slots=lay.shared_slots, shared_len=lay.shared_len,
                      shared_delta=lay.shared_delta, own_slots=lay.own_slots, own_len=lay.own_len)
        return {k: put(v) for k, v in arrays.items()}, lay.rotate

    def _shape(self, lay: Layout) -> tuple:
        return lay.x.shape[0], lay.shared_slots.shape[1], lay.own_slots.shape[1], lay.window.shape[1]

    def warm(self, shapes: Sequence[Shape], runners: Sequence[BlockRunner], probe: bool, affix_len: int) -> None:
        """Run every program of these shapes once on empty rows (nothing is written), at every batch size."""
        if affix_len:
            self.build_affix([0] * affix_len, [self.num_slots] * affix_len)  # slots past the pool: dropped
        for shape in shapes:
            if shape not in self.warmed:
                self.warmed.append(shape)
            for b in self.batch_sizes:
                t = self.buffer_len
                lay = Layout(x=np.full((b, t), self.config.pad_token_id, np.int32), positions=np.zeros((b, t), np.int32),
                             col_slots=np.full((b, t), self.num_slots, np.int32),
                             shared_slots=np.zeros((b, shape.A), np.int32), shared_len=np.zeros(b, np.int32),
                             shared_delta=np.zeros(b, np.int32), own_slots=np.zeros((b, shape.R), np.int32),
                             own_len=np.zeros(b, np.int32), window=np.zeros((b, shape.W), np.int32),
                             writes=np.zeros((b, shape.W), bool), block_col=0, block_index=np.zeros(b, np.int32),
                             keys=np.zeros((b, 2), np.uint32), rotate=shape.rotate)
                if probe and shape.A:
                    self._probe_call(lay)
                for runner in runners:
                    self._block_call(lay, runner)

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
        self.k, self.v = _build_affix(self.params, self.k, self.v, put(ids), put(sl), put(np.int32(a)),
                                      config=self.config)

    def probe(self, reqs: Sequence[Request], bm) -> list[np.ndarray]:
        """ACache's one-shot probe of newly admitted requests (one NFE): per request the importance of each affix
        token (the [MASK] queries' softmax mass over the affix keys, summed over heads and layers)."""
        imp = self._probe_call(self.layout(reqs, bm, probe=True))
        return [imp[i, :r.affix_len] for i, r in enumerate(reqs)]  # the shared list, in affix order

    def _probe_call(self, lay: Layout) -> np.ndarray:
        paged, rotate = self._paged(lay)
        self._note(("probe", *self._shape(lay), rotate))
        imp, self.k, self.v = _probe(self.params, self.k, self.v, put(lay.x), put(lay.positions), paged,
                                     put(lay.window), put(lay.writes), config=self.config, rotate=rotate,
                                     kernels=self.kernels)
        return np.asarray(imp)

    def run_block(self, reqs: Sequence[Request], bm, runner: BlockRunner) -> tuple[np.ndarray, np.ndarray, int]:
        """One block of every request: ([B, block_length] tokens of each row's block, new key data, steps)."""
        t0 = time.perf_counter()
        lay = self.layout(reqs, bm)
        t1 = time.perf_counter()
        blk, keys, steps = self._block_call(lay, runner)
        self.host_seconds += t1 - t0
        self.device_seconds += time.perf_counter() - t1  # the call and the wait for its block's tokens
        return blk[:len(reqs)], keys[:len(reqs)], steps

    def _block_call(self, lay: Layout, runner: BlockRunner) -> tuple[np.ndarray, np.ndarray, int]:
        paged, rotate = self._paged(lay)
        static_steps = runner.gc.kernels.step_loop == "auto" and fixed_step_count(runner.gc, self.config)
        self._note(("block", runner, *self._shape(lay), rotate))
        blk, keys, steps, self.k, self.v = _run_block(
            self.params, self.k, self.v, put(lay.x), put(lay.positions), paged, put(lay.window), put(lay.writes),
            put(lay.keys), put(np.int32(lay.block_col)), put(lay.block_index), runner=runner, rotate=rotate,
            kernels=self.kernels, static_steps=static_steps)
        return np.asarray(blk), np.asarray(keys), int(steps)


def put(a: np.ndarray) -> Array:
    """Host array -> device (a transfer: jnp.asarray would compile a small program per new shape)."""
    return jax.device_put(a)


def _inputs(config, positions, block_length: int, kernels: Kernels) -> DecodeInputs:
    shift = 1 if config.family == "dream" else 0
    return DecodeInputs(positions=positions, key_mask=jnp.ones(positions.shape, bool),
                        frozen=jnp.zeros(positions.shape, bool), prompt_len=0, block_length=block_length,
                        shift=shift, kernels=kernels, padded=False, has_frozen=False)


def _view(config, k, v, paged: dict, rotate: bool) -> PagedKV:
    return PagedKV(k=k, v=v, **paged, rope_theta=config.rope_theta, rotate=rotate)


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
def _probe(params, k, v, x, positions, paged, window, writes, *, config, rotate, kernels):
    inp = _inputs(config, positions, 1, kernels)
    kv = _view(config, k, v, paged, rotate)
    tokens = jnp.take_along_axis(x, window, axis=1)
    probe = affix_importance_probe(kv.shared_mask(), (tokens == config.mask_token_id) & writes)
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
