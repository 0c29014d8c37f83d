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
    """n rounded up to a multiple of an eighth of its power of two (16, 18, ..., 64, 72, ..., 1024, 1152, ...): at
    most an eighth of a shape is padding, and a workload of similar lengths compiles few shapes."""
    if n <= smallest:
        return smallest
    step = max(1 << (int(n - 1).bit_length() - 4), 1)
    return -(-n // step) * step


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
        # the smallest shapes every call uses (set by Engine.warmup): a batch within them runs a warmed program
        self.envelope = dict(A=0, R=0, W=0, rotate=False)

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
        rows_window, rows_read = [], []
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
            # the read lists: the shared affix copy's tokens (in affix order) and the private ones
            shared_idx = np.flatnonzero(priv < 0)
            shared = np.zeros(0, np.int64)
            if len(shared_idx):
                entry_slots = np.asarray(bm.slots(r.affix_entry.pages, r.affix_len), np.int64)
                shared = entry_slots[shared_idx - r.affix_span[0]]
            rows_read.append((shared, r.affix_span[0] if len(shared) else 0, priv[priv >= 0]))
            # the window: anchors, own prompt tokens, then P - 1 right before the generation region, always (Dream
            # predicts the first generated token from the entry before the block), unwritten when it is shared
            anchors = r.anchors if not probe else []
            recomputed = [j for j in anchors + r.own_prompt_indices() if j != p - 1]
            last_written = (p - 1) in anchors or (p - 1) in r.own_prompt_indices()
            entries = [(j, True) for j in recomputed] + [(p - 1, last_written)]
            k = 0 if probe else r.blocks_done
            rows_window.append(([(cols[j], w) for j, w in entries] + [(cols[p + j], True) for j in range(g)],
                                len(entries) + k * r.block_length))
        env = self.envelope
        n_shared = max(len(sh) for sh, _, _ in rows_read)
        a_len = max(bucket(n_shared) if n_shared else 0, env["A"])  # no shared list when nothing in the batch shares
        r_len = max(bucket(max(len(own) for _, _, own in rows_read)), env["R"])
        shared_slots, own_slots = np.zeros((b, a_len), np.int32), np.zeros((b, r_len), np.int32)
        shared_len, own_len, shared_delta = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, (sh, delta, own) in enumerate(rows_read):
            shared_slots[i, :len(sh)], own_slots[i, :len(own)] = sh, own
            shared_len[i], own_len[i], shared_delta[i] = len(sh), len(own), delta
        w = max(bucket(max(len(entries) for entries, _ in rows_window)), env["W"])
        window = np.full((b, w), c, np.int32)  # fillers: the current block's first column, never written
        writes = np.zeros((b, w), bool)
        block_index = np.zeros(b, np.int32)
        for i, (entries, at) in enumerate(rows_window):
            window[i, :len(entries)] = [col for col, _ in entries]
            writes[i, :len(entries)] = [wr for _, wr in entries]
            block_index[i] = at
        keys = np.zeros((b, 2), np.uint32)
        for i, r in enumerate(reqs):
            keys[i] = r.key
        return Layout(x, pos, col_slots, shared_slots, shared_len, shared_delta, own_slots, own_len, window, writes,
                      c, block_index, keys)

    def _paged(self, lay: Layout) -> tuple[dict, bool]:
        arrays = dict(col_slots=lay.col_slots, shared_slots=lay.shared_slots, shared_len=lay.shared_len,
                      shared_delta=lay.shared_delta, own_slots=lay.own_slots, own_len=lay.own_len)
        return ({k: put(v) for k, v in arrays.items()},
                bool((lay.shared_delta != 0).any()) or self.envelope["rotate"])

    def _shape(self, lay: Layout) -> tuple:
        return lay.x.shape[0], lay.shared_slots.shape[1], lay.own_slots.shape[1], lay.window.shape[1]

    def warm(self, runners: Sequence[BlockRunner], probe: bool, affix_len: int) -> None:
        """Run every program of this envelope once on empty rows (nothing is written), at every batch bucket."""
        b, sizes = 1, []
        while b < self.max_batch:
            sizes.append(b)
            b *= 2
        sizes.append(self.max_batch)
        if affix_len:
            self.build_affix([0] * affix_len, [self.num_slots] * affix_len)  # slots past the pool: dropped
        env = self.envelope
        for b in sizes:
            lay = Layout(x=np.full((b, self.buffer_len), self.config.pad_token_id, np.int32),
                         positions=np.zeros((b, self.buffer_len), np.int32),
                         col_slots=np.full((b, self.buffer_len), self.num_slots, np.int32),
                         shared_slots=np.zeros((b, env["A"]), np.int32), shared_len=np.zeros(b, np.int32),
                         shared_delta=np.zeros(b, np.int32), own_slots=np.zeros((b, env["R"]), np.int32),
                         own_len=np.zeros(b, np.int32), window=np.zeros((b, env["W"]), np.int32),
                         writes=np.zeros((b, env["W"]), bool), block_col=0, block_index=np.zeros(b, np.int32),
                         keys=np.zeros((b, 2), np.uint32))
            if probe:
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
        blk, keys, steps = self._block_call(self.layout(reqs, bm), runner)
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
    a = kv.shared_slots.shape[1]
    shared_keys = kv.key_mask() & (jnp.arange(kv.length) < a)[None]  # the shared list leads the key space
    probe = affix_importance_probe(shared_keys, (tokens == config.mask_token_id) & writes)
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
