"""The semi-autoregressive denoising loop, entirely on the device (nested `lax.while_loop`s under one jit).

Blocks of the generation region are finished left to right; inside a block each step runs one forward (through
the cache strategy) and lets the sampler propose tokens for the block's masked positions and commit some of them.
The loop knows neither technique nor algorithm by name. All loop state is one registered dataclass; no host
round trip happens per step.

`BlockRunner.run_block` finishes one block of every row: `run` (generate) loops it over the blocks, the serving
engine calls it once per scheduling iteration (its rows each at their own block, aligned at one buffer column).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.decoding.caches import strategy_for
from dllm_jax.decoding.caches.base import CacheStrategy, DecodeInputs
from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.decoding.samplers.base import Sampler
from dllm_jax.decoding.samplers.commit import commit_first_masked, exclude_token
from dllm_jax.transformer.layers import opaque_loop, stacked

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    x: Array  # [B, T] int32 token buffer
    cache: Any  # the cache strategy's state pytree
    key: Array  # PRNG key (one for the batch), or [B] keys (one per row: the engine)
    nfe: Array  # int32: forward passes so far
    block: Array  # int32: index of the current block
    step: Array  # int32: step inside the current block
    total_steps: Array  # int32
    masked_at_start: Array  # [B] int32: masks of the current block at its first step (the samplers' schedules)
    steps_per_block: Array  # [n_blocks] int32
    committed_per_step: Array  # [max_total_steps] int32: tokens committed (whole batch) at each step
    done: Array  # [B] bool: the row's answer has ended (EOS committed and the rest filled with EOS)
    commit_step: Array  # [B, T] int32: the in-block step that committed each position (-1: not committed by a step)
    rows: Any = None  # RowSettings: per-row sampling settings and step budgets (the engine), with a RowSampler


def fixed_step_count(gc: GenerationConfig, config: ModelConfig) -> bool:
    """Whether every block provably takes exactly `gc.max_steps_per_block()` steps, so that the in-block loop can
    run a known number of times (KernelChoice.step_loop "auto"). At a block start each live row's block is fully
    masked (a finished row's is all EOS, and a block starts only while some row is live); the while loop runs step
    j (1 <= j < spb) when some position is still masked, so the counts agree when the sampler's every step before
    the last leaves a live row a mask (`Sampler.fixed_step_count`)."""
    s = gc.schedule
    return gc.sampler_for(config).fixed_step_count(s.block_length, s.steps_per_block)


@dataclasses.dataclass(frozen=True)
class BlockRunner:
    """One block of denoising steps for every row: the block-start step (the strategy's refresh) then the in-block
    steps. Static (hashable) like everything it is built from."""

    config: ModelConfig
    gc: GenerationConfig
    strategy: CacheStrategy
    sampler: Sampler
    cfg_rows: bool = False  # the batch holds [conditional rows; unconditional rows] (classifier-free guidance)

    @classmethod
    def create(cls, config: ModelConfig, gc: GenerationConfig, depth: int | None = None) -> "BlockRunner":
        return cls(
            config,
            gc,
            strategy_for(gc.cache.mode, gc.cache.affix_name, depth),
            gc.sampler_for(config),
            gc.cfg_scale > 0,
        )

    def model_logits(self, params, inp: DecodeInputs, s: LoopState, block_start: Array, refresh: bool):
        """The block's fp32 logits [B, L, V] ([MASK] excluded) and the new cache state. refresh is static: the
        block-start forward and the in-block forward are traced in separate loop bodies (a lax.cond between them
        would pass the whole cache through the conditional, which costs copies of it at every step)."""
        xs = s.x
        if self.cfg_rows:  # unconditional rows: every prompt token masked (LLaDA's classifier-free guidance)
            prompt_region = (jnp.arange(xs.shape[1]) < inp.prompt_len)[None, :] & inp.key_mask[: xs.shape[0]]
            xs = jnp.concatenate([xs, jnp.where(prompt_region, self.config.mask_token_id, xs)])
        forward_fn = self.strategy.block_start if refresh else self.strategy.step
        logits, cache = forward_fn(params, self.config, inp, s.cache, xs, block_start)
        logits = logits.astype(jnp.float32)
        if self.cfg_rows:
            cond, uncond = jnp.split(logits, 2)
            logits = uncond + (self.gc.cfg_scale + 1.0) * (cond - uncond)
        # [MASK] is never a valid prediction (trained models give it ~0 mass; tiny or random ones may not, and
        # committing it would leave a position masked forever)
        return exclude_token(logits, self.config.mask_token_id), cache

    def commit(self, inp: DecodeInputs, logits, masked, key, step, first_of_block: bool, masked_at_start, rows=None):
        """The sampler's proposal x0 [B, L] and which positions it commits. Batch-invariant mode: one row at a time
        in a loop (a reduction over the vocabulary of B * L rows may be vectorised otherwise than one of L rows,
        which moves a confidence's last bit); rows sharing one key draw noise together, so not then."""
        b = logits.shape[0]
        if not inp.kernels.batch_invariant or (key.ndim == 0 and b > 1):
            return self._commit(inp, logits, masked, key, step, first_of_block, masked_at_start, rows)
        per_row = (logits, masked, masked_at_start, rows) + ((key,) if key.ndim else ())
        per_row = jax.tree.map(lambda a: stacked(a[:, None], b), per_row)

        def row(r, out):
            lg, m, n, settings, *k = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False), per_row)
            x0, commit = self._commit(inp, lg, m, k[0] if k else key, step, first_of_block, n, settings)
            return jax.tree.map(lambda o, y: jax.lax.dynamic_update_index_in_dim(o, y, r, 0), out, (x0, commit))

        shapes = jax.eval_shape(
            lambda: self._commit(inp, logits, masked, key, step, first_of_block, masked_at_start, rows)
        )
        out = jax.tree.map(lambda a: jnp.zeros((max(b, 2), 1, *a.shape[1:]), a.dtype), shapes)
        return jax.tree.map(lambda a: a[:b, 0], opaque_loop(b, row, out))

    def _commit(self, inp: DecodeInputs, logits, masked, key, step, first_of_block: bool, masked_at_start, rows=None):
        spb = self.gc.schedule.steps_per_block
        if rows is not None:  # settings per row (RowSampler): rows past their step budget commit nothing
            x0, commit = self.sampler.commit_rows(logits, masked, key, step, masked_at_start, rows)
        elif key.ndim == 0:
            x0, commit = self.sampler.commit(logits, masked, key, step, masked_at_start, spb)
        else:  # a key per row: each row's randomness is that of the row decoded alone

            def one(lg, m, k, n):
                x0, c = self.sampler.commit(lg[None], m[None], k, step, n[None], spb)
                return x0[0], c[0]

            x0, commit = jax.vmap(one)(logits, masked, key, masked_at_start)
        if inp.shift == 1 and self.strategy.window_steps and self.gc.cache.refresh == "block" and first_of_block:
            # Fast-dLLM (AR-adapted models, i.e. Dream): the block-start forward commits the block's first token
            # unconditionally; in-block windows cannot predict it (its predictor sits before the window). With
            # refresh="step" every forward is full, the rule has no reason, and the cache equals no cache exactly.
            commit = commit_first_masked(masked)
            if rows is not None:
                commit = commit & (step < rows.steps)[:, None]
        return x0, commit

    def run_block(self, params, inp: DecodeInputs, s: LoopState, block_start: Array, static_steps: bool) -> LoopState:
        """Finish the block at buffer column block_start of every row (rows whose block has no mask commit
        nothing). Returns the state after its last step (step = the steps it took)."""
        bl = inp.block_length
        mask_id = self.config.mask_token_id
        spb = self.gc.max_steps_per_block()
        blk = jax.lax.dynamic_slice_in_dim(s.x, block_start, bl, axis=1)
        s = dataclasses.replace(s, step=jnp.int32(0), masked_at_start=(blk == mask_id).sum(axis=-1).astype(jnp.int32))

        def step_cond(s: LoopState):
            blk = jax.lax.dynamic_slice_in_dim(s.x, block_start, bl, axis=1)
            if s.rows is not None:  # a row steps while it has masks and step budget
                return jnp.any((blk == mask_id) & (s.step < s.rows.steps)[:, None]) & (s.step < spb)
            return jnp.any(blk == mask_id) & (s.step < spb)

        def step_body(s: LoopState, first_of_block: bool) -> LoopState:
            refresh = first_of_block or self.gc.cache.refresh == "step"
            logits, cache = self.model_logits(params, inp, s, block_start, refresh)
            blk = jax.lax.dynamic_slice_in_dim(s.x, block_start, bl, axis=1)
            masked = blk == mask_id
            if s.key.ndim == 0:
                key, sub = jax.random.split(s.key)
            else:  # a row's key advances only at its own steps (a row whose block is done waits)
                pairs = jax.vmap(jax.random.split)(s.key)
                stepping = masked.any(axis=-1) if s.rows is None else masked.any(axis=-1) & (s.step < s.rows.steps)
                key = jnp.where(stepping, pairs[:, 0], s.key)
                sub = pairs[:, 1]
            x0, commit = self.commit(inp, logits, masked, sub, s.step, first_of_block, s.masked_at_start, s.rows)
            x = jax.lax.dynamic_update_slice_in_dim(s.x, jnp.where(commit, x0, blk), block_start, axis=1)
            at = jax.lax.dynamic_slice_in_dim(s.commit_step, block_start, bl, axis=1)
            at = jax.lax.dynamic_update_slice_in_dim(s.commit_step, jnp.where(commit, s.step, at), block_start, axis=1)
            per_step = s.committed_per_step.at[s.total_steps].set(commit.sum().astype(jnp.int32))
            return dataclasses.replace(
                s,
                x=x,
                cache=cache,
                key=key,
                nfe=s.nfe + 1,
                step=s.step + 1,
                total_steps=s.total_steps + 1,
                committed_per_step=per_step,
                commit_step=at,
            )

        # The block-start step runs unconditionally: the caller runs a block only while some row still decodes,
        # and such a row's block starts fully masked.
        s = step_body(s, first_of_block=True)
        if static_steps:  # a known trip count: no predicate copied to the host and waited for at each step
            return jax.lax.fori_loop(1, spb, lambda _, s: step_body(s, first_of_block=False), s)
        return jax.lax.while_loop(step_cond, lambda s: step_body(s, first_of_block=False), s)

    def initial_state(self, x: Array, cache: Any, key: Array, max_total_steps: int, rows: Any = None) -> LoopState:
        b = x.shape[0]
        return LoopState(
            x=x,
            cache=cache,
            key=key,
            nfe=jnp.int32(0),
            block=jnp.int32(0),
            step=jnp.int32(0),
            total_steps=jnp.int32(0),
            masked_at_start=jnp.zeros((b,), jnp.int32),
            steps_per_block=jnp.zeros((self.gc.schedule.n_blocks,), jnp.int32),
            committed_per_step=jnp.zeros((max_total_steps,), jnp.int32),
            done=jnp.zeros((b,), bool),
            commit_step=jnp.full(x.shape, -1, jnp.int32),
            rows=rows,
        )


def run(
    params: dict,
    config: ModelConfig,
    gc: GenerationConfig,
    x: Array,
    inp: DecodeInputs,
    key: Array,
    init_cache: Any = None,
    depth: int | None = None,
) -> LoopState:
    """gc: static. x: [B, T] with [MASK] in the generation region. init_cache: a pre-filled cache state (e.g.
    shared-affix K/V) instead of the strategy's empty one. depth: BiCache's reuse depth."""
    runner = BlockRunner.create(config, gc, depth)
    p, bl = inp.prompt_len, inp.block_length
    n_blocks = gc.schedule.n_blocks
    static_steps = gc.kernels.step_loop == "auto" and fixed_step_count(gc, config)
    if runner.cfg_rows:
        inp = dataclasses.replace(
            inp,
            positions=jnp.concatenate([inp.positions] * 2),
            key_mask=jnp.concatenate([inp.key_mask] * 2),
            frozen=jnp.concatenate([inp.frozen] * 2),
        )

    def block_cond(s: LoopState):
        return (s.block < n_blocks) & ~jnp.all(s.done)

    def block_body(s: LoopState) -> LoopState:
        block_start = p + s.block * bl
        s = runner.run_block(params, inp, s, block_start, static_steps)
        s = dataclasses.replace(s, steps_per_block=s.steps_per_block.at[s.block].set(s.step))
        if gc.stop_at_eos:
            s = _fill_after_eos(s, config, p, block_start + bl, gc)
        return dataclasses.replace(s, block=s.block + 1)

    if init_cache is None:
        init_cache = runner.strategy.init(params, config, inp, jnp.concatenate([x] * 2) if runner.cfg_rows else x)
    max_total = max(gc.schedule.gen_length, n_blocks * gc.max_steps_per_block())
    return jax.lax.while_loop(block_cond, block_body, runner.initial_state(x, init_cache, key, max_total))


def _fill_after_eos(s: LoopState, config: ModelConfig, p: int, block_end: Array, gc) -> LoopState:
    """A row whose generated text so far contains a stop token is finished: everything after it becomes EOS."""
    t = s.x.shape[1]
    idx = jnp.arange(t)[None, :]
    in_gen = (idx >= p) & (idx < block_end)
    stop_ids = jnp.asarray(gc.stop_token_ids(config), jnp.int32)
    is_stop = in_gen & jnp.isin(s.x, stop_ids)
    has_stop = jnp.any(is_stop, axis=-1)
    first = jnp.argmax(is_stop, axis=-1)
    fill = has_stop[:, None] & (idx > first[:, None]) & (idx >= p)
    x = jnp.where(fill, config.eos_token_id, s.x)
    return dataclasses.replace(s, x=x, done=s.done | has_stop)
