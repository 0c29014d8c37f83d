"""Device inputs built from requests, and the jitted calls the engine runs (`ModelRunner`).

A group of running requests (one block length and BiCache depth) finishes one block each in one device call
(`run_block`): the block start (a windowed refresh) and every step, through `decoding.loop.BlockRunner` on a
`PagedKV` view of the pool. The host builds numpy arrays and transfers them once: the token buffer [B, T] (rows
left-padded so that every row's current block starts at one column), the slots each column writes, each row's read
lists (the shared affix's slots, then its own) and its window, run in chunks up to the longest row's (`WindowChunks`).
Every shape comes from the settings (`Ladder`), never the traffic: `programs` lists them all before serving.
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
from dllm_jax.decoding.caches.acache import (
    AnchoredRefresh,
    AnchoredState,
    forward_window,
    rank_anchors,
    row_importance_probe,
)
from dllm_jax.decoding.caches.base import DecodeInputs, gather_rows
from dllm_jax.decoding.caches.bicache import ShallowReuse, ShallowState
from dllm_jax.decoding.caches.dual import DualCache
from dllm_jax.decoding.loop import BlockRunner
from dllm_jax.decoding.samplers.rows import RowSettings, stack_rows
from dllm_jax.engine.kv_pool import PagedKV
from dllm_jax.engine.request import Request
from dllm_jax.transformer import CacheWrite, Kernels, WindowChunks, forward
from dllm_jax.transformer.layers import apply_rope, rope_cos_sin
from dllm_jax.transformer.sharding import kv_sharding, mesh_of

Array = jax.Array
STRATEGY = AnchoredRefresh(DualCache())  # every engine block start is a windowed refresh (all columns when unshared)
CHUNK_TOKENS = 2048  # a block-start chunk of all rows at most this many tokens (see `Ladder.chunk`), halved where the
# halves keep COMPUTE_TOKENS (GEMMs of 512 rows are compute-bound on an H100 / H200) and ROW_CHUNK_MIN a row: a smaller
# chunk pads a row's window less (closed16's probe, H100: 15.5 ms a request at 128 against 17.8 at 256, s39). The
# largest batch's block calls run a short tail as a half chunk (`WindowChunks.half_tail`; not the probes: s44)
COMPUTE_TOKENS, ROW_CHUNK_MIN = 512, 128
# A block step's cost floor in tokens of block-start work (`Ladder.calls`): a step streams every weight once however
# few its rows, which costs what this many tokens' GEMMs cost at a GPU's FLOP-to-byte ratio (LLaDA-8B bf16 on the
# H200: 4.81 ms a batch-1 step, 26.7 ms a batch-32 step of 1024 tokens, so ~185 tokens). On a CPU, where small
# models' calls cost their dispatch as much, it keeps them together all the more.
STEP_FLOOR_TOKENS = 192
SPLIT_GAIN = 0.8  # split a call only where the estimate saves a fifth (it is an estimate)


def round_up(n: int, multiple: int = 16) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Ladder:
    """The shapes every device call is padded to, fixed by the settings. Few on purpose: at LLaDA-8B a program takes
    6-24 s to compile and 1.2-2.9 s to load from the persistent cache (H200), so the program count is start-up time."""

    batch_sizes: tuple[int, ...]  # powers of 4 up to max_batch, and max_batch
    read_len: int  # the one width of the read lists and windows (of block starts, probes, affixes)
    window_chunk: int = 256  # a row's block-start chunk at small batches (`chunk`)
    probe_rows: int = 4  # new ACache requests a probe call takes at most (more: several calls)

    @classmethod
    def for_settings(cls, max_batch: int, max_len: int, batch_sizes: Sequence[int] | None = None, window_chunk=256):
        """The ladder of these settings (batch_sizes: None for the defaults)."""
        cap = round_up(max_len)
        chunk = min(round_up(window_chunk), cap)
        batch_sizes = batch_sizes or {min(4**i, max_batch) for i in range(max_batch.bit_length())}  # 1, 4, 16, ...
        return cls(tuple(sorted(set(batch_sizes))), round_up(cap, chunk), chunk)

    def batch(self, n: int) -> int:
        return next(b for b in self.batch_sizes if b >= n)

    def chunk(self, b: int) -> int:
        """A row's block-start chunk at batch b: window_chunk, halved while a chunk of all b rows exceeds CHUNK_TOKENS
        (a GEMM that size already runs near the H200's peak; a smaller chunk pads less), or while its half stays at
        least COMPUTE_TOKENS for all rows and ROW_CHUNK_MIN a row (fewer, longer chunk loops below that). A divisor
        of read_len. LLaDA-8B's serve defaults: 256, 128, 128 at batch 1, 4, 16."""
        c = self.window_chunk
        while c % 32 == 0 and (c * b > CHUNK_TOKENS or (c > ROW_CHUNK_MIN and c * b // 2 >= COMPUTE_TOKENS)):
            c //= 2
        return c

    def cost(self, windows: Sequence[int], steps: int, block_length: int) -> int:
        """A block call's estimated work in tokens: every row's window padded as the longest one's chunks pad it
        (`WindowChunks`), and each step's rows' block tokens, at least STEP_FLOOR_TOKENS."""
        b = self.batch(len(windows))
        pad = self.chunk(b) // (2 if b == self.batch_sizes[-1] else 1)
        return b * round_up(max(windows), pad) + steps * max(STEP_FLOOR_TOKENS, b * block_length)

    def calls(self, windows: Sequence[int], steps: Sequence[int], block_length: int) -> list[list[int]]:
        """How one program's rows (their block-start windows and steps a block) split into calls, as lists of row
        indices in their order: one call, unless splitting off the longest windows saves more than the other call's
        steps cost (`cost`, by at least 1 - SPLIT_GAIN). Every row of a call pays the longest window's chunks, so one
        long window (an unshared request among ACache ones, an audit's shadow) would make all of them pay it."""
        rows = sorted(range(len(windows)), key=lambda i: -windows[i])

        def cost(ix: list[int]) -> int:
            return self.cost([windows[i] for i in ix], max(steps[i] for i in ix), block_length)

        def split(ix: list[int]) -> list[list[int]]:
            best = min(((cost(ix[:k]) + cost(ix[k:]), k) for k in range(1, len(ix))), default=None)
            if best is None or best[0] > SPLIT_GAIN * cost(ix):
                return [sorted(ix)]
            return split(ix[: best[1]]) + split(ix[best[1] :])

        return split(rows)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """A request's layout in its own logical indices (prompt, then generation region)."""

    private: np.ndarray  # [P + G] the private slot of each index, -1 where the shared copy is read
    shared: np.ndarray  # the shared copy's slots the request reads (its affix's non-anchor tokens, in order)
    delta: int  # the affix's RoPE offset (its start)
    window: np.ndarray  # the logical indices a block start recomputes
    writes: np.ndarray  # which of them write their K/V
    gen_index: int  # where the generation region starts in the window


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of the engine: what it runs and its batch b (every width is the ladder's read_len)."""

    kind: str  # "block", "probe" (ACache's), "affix", "hidden" (BiCache: an affix's layer input), "place"
    b: int = 1
    runner: BlockRunner | None = None
    depth: int = 0  # "hidden": the layer


class ModelRunner:
    """The engine's device side: the KV pool, the programs over it, and BiCache's stored hidden states."""

    def __init__(self, params, config: ModelConfig, num_slots: int, max_len: int, ladder: Ladder, kernels, options=()):
        self.params, self.config, self.num_slots, self.ladder, self.kernels = params, config, num_slots, ladder, kernels
        self._run_block, self._run_window = _block_program(options)  # options: XLA's compiler options
        self.buffer_len = 2 * max_len  # C + the longest remaining region never exceeds it
        shape, mesh = (num_slots, config.n_kv_heads, config.head_dim), mesh_of(params)
        self._zeros = jax.jit(  # tensor parallel: each device holds its KV heads of every page
            lambda: tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(config.n_layers)),
            out_shardings=None if mesh is None else (kv_sharding(mesh, 3),) * config.n_layers,
        )
        self.reset_pool()
        self.host_seconds = self.device_seconds = 0.0  # building inputs (block and probe calls) / running block calls
        self.probe_seconds = 0.0  # ACache's probe calls
        self.hidden: dict[tuple[str, int], Array] = {}  # BiCache: (affix key, depth) -> `store_hidden`'s

    def _empty(self, b: int, col: int = 0, shallow: bool = False) -> dict:
        """The host inputs of a call over b rows that write and read nothing (padding; warm-up); shallow: with BiCache's
        deep window (every real column), where the shallow window's entries and each row's prefix go in it."""
        t, f, end = self.buffer_len, self.ladder.read_len, self.num_slots
        lay = dict(
            x=np.full((b, t), self.config.pad_token_id, np.int32),
            positions=np.zeros((b, t), np.int32),
            col_slots=np.full((b, t), end, np.int32),  # the slot each column writes (num_slots: none)
            shared_slots=np.zeros((b, f), np.int32),  # the read lists: the shared affix's slots...
            shared_len=np.zeros(b, np.int32),
            shared_delta=np.zeros(b, np.int32),  # ... read rotated by its placement
            own_slots=np.zeros((b, f), np.int32),  # ... and the row's private ones
            own_len=np.zeros(b, np.int32),
            window=np.full((b, f), col, np.int32),  # the columns a block start recomputes
            writes=np.zeros((b, f), bool),
            block_col=np.int32(col),  # the buffer column where every row's current block starts
            block_index=np.zeros(b, np.int32),  # where it sits in each row's window
            live=np.int32(0),  # window entries 0..live-1 hold some row's work
            keys=np.zeros((b, 2), np.uint32),
            rows=stack_rows([], b),  # RowSettings' host arrays
            deep_live=np.int32(0),
        )
        if shallow:
            lay.update(deep=np.full((b, f), col, np.int32), deep_writes=np.zeros((b, f), bool))
            lay.update(splice_at=np.full((b, f), f, np.int32), prefix_at=np.full(b, f, np.int32))
        return lay

    def reset_pool(self) -> None:
        """A zeroed pool (at start, and after a failed call consumed the donated one)."""
        self.k, self.v = self._zeros(), self._zeros()

    def pool_lost(self) -> bool:
        """Whether a call consumed the pool's buffers without returning new ones (they are donated to every call)."""
        return any(a.is_deleted() for a in self.k + self.v)

    def programs(self, runners: Sequence[BlockRunner]) -> list[Program]:
        """Every program the engine can run with these block runners (a function of the settings only)."""
        out = [Program("affix")] + [Program("block", b, r) for r in runners for b in self.ladder.batch_sizes]
        if any(not isinstance(r.strategy, ShallowReuse) for r in runners):  # probes of 1..probe_rows requests: a
            new = range(1, min(Ladder.probe_rows, self.ladder.batch_sizes[-1]) + 1)  # lone one not with 3 empty rows
            out += [Program("probe", b) for b in sorted({self.ladder.batch(n) for n in new})]
        if any(isinstance(r.strategy, ShallowReuse) for r in runners):
            depths = sorted({r.strategy.depth for r in runners if isinstance(r.strategy, ShallowReuse)})
            out += [Program("hidden", depth=d) for d in depths] + [Program("place")]
        return out

    def lowered(self, p: Program) -> jax.stages.Lowered:
        """Program p traced and lowered, to compile ahead of time (nothing runs; later calls of its shapes find it)."""
        cfg, f, end = self.config, self.ladder.read_len, self.num_slots
        lay = put(_windowed(self._empty(p.b)))
        if p.kind in ("affix", "probe"):
            static = dict(self._static(p.b), probe=p.kind == "probe")
            return self._run_window.lower(self.params, self.k, self.v, lay, **static)
        if p.kind == "hidden":
            return _prefix_hidden.lower(self.params, self.k, self.v, lay, **self._static(1), depth=p.depth)
        if p.kind == "place":
            zeros, nowhere = put(np.zeros(f, np.int32)), put(np.full(f, end, np.int32))
            return _place.lower(self.k, self.v, zeros, nowhere, put(np.int32(0)), theta=cfg.rope_theta)
        shallow = isinstance(p.runner.strategy, ShallowReuse)
        hidden = [jnp.zeros((f, cfg.d_model), cfg.jnp_dtype)] * p.b if shallow else None
        return self._call(self._empty(p.b, shallow=shallow), p.runner, hidden, lower_only=True)

    def plan(self, r: Request, bm) -> RowPlan:
        """What does not change between a request's blocks (cached on the request until its anchors change: a request
        still to be probed, ACache's, has none yet)."""
        key = tuple(r.anchors)
        if r.plan is not None and r.plan[0] == key:
            return r.plan[1]
        p, g = len(r.prompt), r.gen_length
        # private slots per logical index, in the order they were reserved: own prompt tokens, the anchors, the
        # generation region; -1: read from the shared copy
        slots = np.asarray(bm.slots(r.pages, r.private_tokens()), np.int64)
        own = np.asarray(r.own_prompt_indices() if r.shares_affix else range(p), np.int64)
        priv = np.full(p + g, -1, np.int64)
        priv[own] = slots[: len(own)]
        anchors = np.asarray(r.anchors, np.int64)
        priv[anchors] = slots[len(own) : len(own) + len(anchors)]
        priv[p:] = slots[len(own) + r.anchor_count :]
        shared_idx = np.flatnonzero(priv < 0)
        shared = np.zeros(0, np.int64)
        if len(shared_idx):
            shared = np.asarray(bm.slots(r.affix_entry.pages, r.affix_len), np.int64)[shared_idx - r.affix_span[0]]
        # the window: anchors, own prompt tokens, P - 1 (always: Dream predicts the block's first token from the
        # entry before it; unwritten when shared), then the generation region
        recomputed = np.concatenate([anchors, np.asarray(r.own_prompt_indices(), np.int64)])
        recomputed = recomputed[recomputed != p - 1]
        s, e = r.affix_span if r.technique is not None else (0, 0)
        window = np.concatenate([recomputed, [p - 1], p + np.arange(g)])
        writes = np.ones(len(window), bool)
        writes[len(recomputed)] = not s <= p - 1 < e or (p - 1) in anchors  # a shared P - 1 keeps its K/V
        plan = RowPlan(priv, shared, r.affix_span[0] if len(shared) else 0, window, writes, len(recomputed) + 1)
        r.plan = (key, plan)
        return plan

    def layout(self, reqs: Sequence[Request], bm, shallow: bool = False, b: int | None = None) -> dict:
        """The host inputs of one call over `reqs` (each at its current block; shallow: BiCache rows, with their deep
        window), padded to the ladder's shapes (b: to b rows)."""
        b = self.ladder.batch(len(reqs)) if b is None else b
        plans = [self.plan(r, bm) for r in reqs]
        done = [r.blocks_done for r in reqs]
        starts = [len(r.prompt) + k * r.block_length for r, k in zip(reqs, done)]
        c = max(starts)
        lay = self._empty(b, c, shallow)
        lay["live"] = np.int32(max(len(pl.window) for pl in plans))
        lay["rows"] = stack_rows([r.row_values for r in reqs], b)
        for i, (r, pl) in enumerate(zip(reqs, plans)):
            p, g, gen = len(r.prompt), r.gen_length, r.generated
            pad = c - starts[i]  # every row's current block starts at column c
            lay["x"][i, pad : pad + p + g] = [*r.prompt, *gen] + [self.config.mask_token_id] * (g - len(gen))
            lay["positions"][i, pad : pad + p + g] = np.arange(p + g)
            own = pl.private[pl.private >= 0]
            lay["col_slots"][i, pad + np.flatnonzero(pl.private >= 0)] = own
            lay["own_slots"][i, : len(own)], lay["own_len"][i] = own, len(own)
            lay["shared_slots"][i, : len(pl.shared)] = pl.shared
            lay["shared_len"][i], lay["shared_delta"][i] = len(pl.shared), pl.delta
            lay["window"][i, : len(pl.window)], lay["writes"][i, : len(pl.window)] = pad + pl.window, pl.writes
            lay["block_index"][i] = pl.gen_index + done[i] * r.block_length
            lay["keys"][i] = r.key
        if shallow:  # the deep window is every real column in order: a logical index is its deep-window index
            f = self.ladder.read_len
            lay["deep_live"] = np.int32(max(r.total_len for r in reqs))
            for i, (r, pl) in enumerate(zip(reqs, plans)):
                n, pad = r.total_len, c - starts[i]
                lay["deep"][i, :n], lay["deep_writes"][i, :n] = pad + np.arange(n), True
                spliced = pl.writes | (pl.window == len(r.prompt) - 1)
                lay["splice_at"][i, : len(pl.window)] = np.where(spliced, pl.window, f)
                lay["prefix_at"][i] = r.affix_span[0] if r.affix_span else f
                lay["block_index"][i] = len(r.prompt) + done[i] * r.block_length
        return lay

    def _affix_layout(self, tokens: Sequence[int], slots: Sequence[int], write: bool) -> dict:
        """One row whose window and own read list are an affix at positions 0..A-1 (its entry's slots)."""
        a, lay = len(tokens), self._empty(1)
        lay["x"][0, :a], lay["positions"][0, :a] = tokens, np.arange(a)
        lay["col_slots"][0, :a] = lay["own_slots"][0, :a] = slots
        lay["window"][0, :a], lay["writes"][0, :a], lay["own_len"][0], lay["live"] = np.arange(a), write, a, np.int32(a)
        return put(_windowed(lay))

    def build_affix(self, tokens: Sequence[int], slots: Sequence[int]) -> None:
        """Compute an affix's K/V alone (positions 0..A-1) and store them at its entry's slots: the window forward
        of `_affix_layout` (in chunks: it costs the affix's tokens)."""
        lay = self._affix_layout(tokens, slots, True)
        self.k, self.v, _ = self._run_window(self.params, self.k, self.v, lay, **self._static(1), probe=False)

    def probe(self, reqs: Sequence[Request], bm) -> list[np.ndarray]:
        """ACache's probe of new requests (block 0, no anchors) against their whole shared affix: calls of at most
        `Ladder.probe_rows`, longest window first (a row runs its call's longest), all dispatched before a wait."""
        t0, calls = time.perf_counter(), []
        order = sorted(range(len(reqs)), key=lambda i: -len(self.plan(reqs[i], bm).window))  # (cached for the layouts)
        host = time.perf_counter() - t0  # the plans: host work, as the layouts
        for i in range(0, len(reqs), Ladder.probe_rows):
            t, part = time.perf_counter(), [reqs[j] for j in order[i : i + Ladder.probe_rows]]
            b = self.ladder.batch(len(part))
            lay = put(_windowed(self.layout(part, bm, b=b)))
            host += time.perf_counter() - t
            self.k, self.v, ranks = self._run_window(self.params, self.k, self.v, lay, **self._static(b), probe=True)
            calls.append((ranks, len(part)))
        ranked = dict(zip(order, (row for ranks, n in calls for row in np.asarray(ranks)[:n])))
        self.host_seconds += host  # the plans and layouts; the calls and the wait for their rankings: the probe's
        self.probe_seconds += time.perf_counter() - t0 - host
        return [ranked[i] for i in range(len(reqs))]  # in the order asked

    def run_block(self, reqs: Sequence[Request], bm, runner: BlockRunner) -> tuple:
        """One block of every request: its [block_length] tokens, the step that committed each, its new key data."""
        t0 = time.perf_counter()
        shallow = isinstance(runner.strategy, ShallowReuse)
        lay = self.layout(reqs, bm, shallow=shallow)
        t1 = time.perf_counter()
        hidden = [self.hidden[(r.affix_entry.key, r.depth)] for r in reqs] if shallow else None
        out = self._call(lay, runner, hidden)
        self.host_seconds += t1 - t0
        self.device_seconds += time.perf_counter() - t1  # the call and the wait for its block's tokens
        return tuple(a[: len(reqs)] for a in out)

    def _call(self, lay: dict, runner: BlockRunner, hidden: Sequence[Array] | None, lower_only=False):
        """One block call over `lay` (hidden: each BiCache row's prefix hidden state [A, d] at its depth);
        lower_only: its program lowered for these shapes (jax.stages.Lowered), nothing run."""
        b = lay["x"].shape[0]
        inputs = jax.device_put(lay)
        if hidden is not None:  # the padding rows' prefix (they read and write nothing): any row's
            inputs["hidden"] = tuple(hidden) + (hidden[0],) * (b - len(hidden))
        args, top = (self.params, self.k, self.v, inputs), self.ladder.batch_sizes[-1]
        static = dict(runner=runner, kernels=self.kernels, chunk=self.ladder.chunk(b), half_tail=b == top)
        if lower_only:
            return self._run_block.lower(*args, **static)
        blk, steps, keys, self.k, self.v = self._run_block(*args, **static)
        return np.asarray(blk), np.asarray(steps), np.asarray(keys)

    def _static(self, b: int) -> dict:
        return dict(config=self.config, kernels=self.kernels, chunk=self.ladder.chunk(b))

    def store_hidden(self, key: str, tokens: Sequence[int], slots: Sequence[int], depth: int) -> None:
        """BiCache: keep the hidden state entering layer `depth` of a built affix alone [read_len, d] under its
        entry's key, unless kept already (until `forget`)."""
        if (key, depth) not in self.hidden:
            lay = self._affix_layout(tokens, slots, False)
            self.hidden[(key, depth)] = _prefix_hidden(self.params, self.k, self.v, lay, **self._static(1), depth=depth)

    def forget(self, keys: Sequence[str]) -> None:
        """Drop what is kept for these affix entries (evicted, or lost with the pool)."""
        self.hidden = {k: h for k, h in self.hidden.items() if k[0] not in keys}  # (a few keys a step)

    def place(self, src: Sequence[int], dst: Sequence[int], offset: int) -> None:
        """Copy a stored affix's K/V (every layer) into a request's private slots, K rotated to its offset."""
        s_, d_ = np.zeros(self.ladder.read_len, np.int32), np.full(self.ladder.read_len, self.num_slots, np.int32)
        s_[: len(src)], d_[: len(dst)] = src, dst  # the padding reads slot 0 and writes nowhere
        self.k, self.v = _place(self.k, self.v, put(s_), put(d_), put(np.int32(offset)), theta=self.config.rope_theta)


_PAGED = ("col_slots", "shared_slots", "shared_len", "shared_delta", "own_slots", "own_len")  # PagedKV's read lists


def _windowed(lay: dict) -> dict:
    """What `_window_call` reads of a layout."""
    return {n: lay[n] for n in (*_PAGED, "x", "positions", "window", "writes", "live")}


put = jax.device_put  # host arrays to the device as a transfer (jnp.asarray compiles a small program per new shape)


def _inputs(config, positions, block_length: int, kernels: Kernels) -> DecodeInputs:
    ones, shift = jnp.ones(positions.shape, bool), int(config.family == "dream")
    return DecodeInputs(positions, ones, ~ones, 0, block_length, shift, kernels, padded=False)


@functools.lru_cache(maxsize=None)
def _block_program(options: tuple = ()):
    """The jitted block call and probe call compiled with these XLA options ((name, value) pairs; () = XLA's
    defaults): one jit object each, hence one compilation cache, per set. A bad option fails here, at a trivial
    program, not at warm-up."""
    if options:
        try:
            jax.jit(lambda: jnp.zeros(()), compiler_options=dict(options)).lower().compile()
        except Exception as e:  # noqa: BLE001  XLA says which option, in its own words
            raise ValueError(f"EngineConfig.compiler_options={dict(options)}: {str(e).splitlines()[0]}") from None
    jit = functools.partial(jax.jit, donate_argnames=("k", "v"), compiler_options=dict(options) or None)
    block = jit(_block_call, static_argnames=("runner", "kernels", "chunk", "half_tail"))
    return block, jit(_window_call, static_argnames=("config", "kernels", "chunk", "probe"))


def _block_call(params, k, v, inputs: dict, *, runner: BlockRunner, kernels, chunk: int, half_tail: bool):
    """One block of every row from its block start: the tokens, the new key data and the pool.
    `inputs`: `ModelRunner.layout` on device, plus "hidden" for BiCache rows."""
    config, d = runner.config, dict(inputs)
    inp = _inputs(config, d["positions"], runner.gc.schedule.block_length, kernels)
    shallow = isinstance(runner.strategy, ShallowReuse)
    # shared affixes are read rotated by their placement: a rotation by 0 (a prefix, or no affix) changes no bit, so
    # one program serves every placement (BiCache rows read their affix from their own, placed copy)
    kv = PagedKV(k=k, v=v, **{n: d[n] for n in _PAGED}, rope_theta=config.rope_theta, rotate=not shallow)
    common = {n: d[n] for n in ("window", "writes", "block_col", "block_index")}
    common.update(kv=kv, chunks=WindowChunks(chunk, d["live"], half_tail))
    if shallow:  # each row's prefix hidden states, placed at its prefix in the deep window
        hidden, (b, f) = jnp.stack(d["hidden"]), d["deep"].shape
        at = d["prefix_at"][:, None] + jnp.arange(hidden.shape[1])[None]
        prefix = jnp.zeros((b, f, hidden.shape[-1]), hidden.dtype)
        prefix = prefix.at[jnp.arange(b)[:, None], at].set(hidden, mode="drop")
        deep = {n: d[n] for n in ("deep", "deep_writes", "splice_at")}
        state = ShallowState(**common, **deep, prefix_hidden=prefix, deep_chunks=WindowChunks(chunk, d["deep_live"]))
    else:
        state = AnchoredState(**common, importance=jnp.zeros(kv.shared_slots.shape, jnp.float32))
    key, steps = jax.random.wrap_key_data(d["keys"]), runner.gc.max_steps_per_block()
    s = runner.initial_state(d["x"], state, key, steps, RowSettings(**d["rows"]))
    s = runner.run_block(params, inp, s, d["block_col"], False)
    blk, at = (jax.lax.dynamic_slice_in_dim(a, d["block_col"], inp.block_length, axis=1) for a in (s.x, s.commit_step))
    return blk, at, jax.random.key_data(s.key), s.cache.kv.k, s.cache.kv.v


def _window_call(params, k, v, d: dict, *, config: ModelConfig, kernels: Kernels, chunk: int, probe: bool):
    """A window forward of each row of `d` over the pool, writing the window's K/V (an affix's own K/V, alone; or
    ACache's probe: their block start rewrites them), and with probe its ranking [b, A] of each row's shared
    affix (`acache.row_importance_probe` scores its [MASK] queries; on the slot kernels `PagedKV.key_weights`)."""
    b, a = d["x"].shape[0], d["shared_slots"].shape[1]
    kv = PagedKV(k=k, v=v, **{n: d[n] for n in _PAGED}, rope_theta=config.rope_theta, rotate=probe)
    queries = (gather_rows(d["x"], d["window"]) == config.mask_token_id) & d["writes"]
    if not probe:
        hook = None
    elif kernels.attention in ("xla", "invariant", "invariant_slot"):
        hook = row_importance_probe(kv.shared_mask(), queries)
    else:  # the slot kernels score each row's own list, never the list's padded width
        hook = lambda q, cache, i: cache.key_weights(i, q, queries, kernels)  # noqa: E731

    inp, none = _inputs(config, d["positions"], 1, kernels), jnp.zeros((b, 1), jnp.int32)
    chunks = WindowChunks(chunk, d["live"])
    out = forward_window(params, config, inp, kv, d["x"], d["window"], d["writes"], none, hook, chunks)
    return out.cache.k, out.cache.v, rank_anchors(out.probe, kv.shared_mask(), a) if probe else None


@functools.partial(jax.jit, static_argnames=("config", "kernels", "chunk", "depth"))
def _prefix_hidden(params, k, v, d: dict, *, config: ModelConfig, kernels: Kernels, chunk: int, depth: int):
    """The hidden state entering layer `depth` of the affix that `d`'s one row holds [read_len, d], zero past it:
    layers 0..depth-1 in chunks, reading its stored K/V (computed alone) and writing nothing."""
    kv = PagedKV(k=k, v=v, **{n: d[n] for n in _PAGED}, rope_theta=config.rope_theta, rotate=False)
    x, pos, live = gather_rows(d["x"], d["window"]), gather_rows(d["positions"], d["window"]), d["live"]
    write, chunks = CacheWrite.scatter(d["window"], d["writes"]), WindowChunks(chunk, live)
    out = forward(params, config, x, pos, cache=kv, write=write, layers=(0, depth), output_hidden=True, chunks=chunks)
    return jnp.where((jnp.arange(x.shape[1]) < live)[:, None], out.hidden[0], 0)


@functools.partial(jax.jit, static_argnames=("theta",), donate_argnames=("k", "v"))
def _place(k, v, src, dst, offset, *, theta):
    cos, sin = rope_cos_sin(jnp.broadcast_to(offset, (1, src.shape[0])), k[0].shape[-1], theta)
    new_k, new_v = [], []
    for kl, vl in zip(k, v):
        rotated = apply_rope(kl[src][None].astype(jnp.float32), cos, sin, fp32=True)[0].astype(kl.dtype)
        new_k.append(kl.at[dst].set(rotated, mode="drop"))
        new_v.append(vl.at[dst].set(vl[src], mode="drop"))
    return tuple(new_k), tuple(new_v)
