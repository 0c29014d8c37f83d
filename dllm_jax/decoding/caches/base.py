"""The interface every cache technique implements, and the per-request inputs they share.

The denoising loop (`decoding/loop.py`) knows nothing about caching: at the first step of a block it calls
`strategy.block_start`, at every other step `strategy.step`; both return the logits of the current block and the
new cache state (an immutable pytree the loop carries). A technique is one module with one frozen (static,
hashable) strategy dataclass; its state is whatever pytree it needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from dllm_jax.config import ModelConfig
from dllm_jax.transformer import CacheWrite, Kernels, KVCache, forward

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """Device inputs fixed for a whole generate call. Buffer layout per row: [left pad][prompt][generation]."""

    positions: Array  # [B, T] int32 RoPE positions (0 at each row's first real token)
    key_mask: Array  # [B, T] bool, False on left padding
    frozen: Array  # [B, T] bool, True where K/V are never rewritten (naive shared-affix reuse)
    prompt_len: int = dataclasses.field(metadata=dict(static=True))  # P: the generation region starts here
    block_length: int = dataclasses.field(metadata=dict(static=True))
    shift: int = dataclasses.field(metadata=dict(static=True))  # 1 for Dream (position i is predicted at i-1)
    kernels: Kernels = dataclasses.field(metadata=dict(static=True))
    padded: bool = dataclasses.field(default=True, metadata=dict(static=True))  # any row left-padded?
    has_frozen: bool = dataclasses.field(default=False, metadata=dict(static=True))  # any frozen position?

    def keep_mask(self, frozen: Array) -> Array | None:
        """write_mask for a window whose frozen slice is `frozen`: None (write everything) when nothing is
        frozen, which spares the hot path a read of the old K/V."""
        return ~frozen if self.has_frozen else None

    @property
    def attn_mask(self) -> Array | None:
        """The key mask attention needs: None when no row is padded (lets cuDNN run its unmasked kernel)."""
        return self.key_mask if self.padded else None


def block_logit_index(inp: DecodeInputs, block_start: Array, window_start: Array | int, batch: int) -> Array:
    """Indices into a forward window of the outputs that predict the current block's tokens, [B, block_length].

    With Dream's shift, block position j is predicted by the output at j - 1; where that lies before the window
    (a dual-cache step's first position) the window's first output is used, as Fast-dLLM does (that position is
    committed at the block start, so it is never sampled from there).
    """
    idx = block_start + jnp.arange(inp.block_length, dtype=jnp.int32) - inp.shift - window_start
    idx = jnp.maximum(idx, 0)
    return jnp.broadcast_to(idx, (batch, inp.block_length))


class CacheStrategy(Protocol):
    name: str
    # True where in-block steps forward only a window that cannot hold the predictor of the block's first token
    # (Dream's shift): the loop then commits that token at the block start (Fast-dLLM's rule). False for the
    # exact strategies, whose every forward is the whole buffer.
    window_steps: bool

    def init(self, params: dict, config: ModelConfig, inp: DecodeInputs, x: Array) -> Any: ...

    def block_start(
        self, params: dict, config: ModelConfig, inp: DecodeInputs, state: Any, x: Array, block_start: Array
    ) -> tuple[Array, Any]: ...

    def step(
        self, params: dict, config: ModelConfig, inp: DecodeInputs, state: Any, x: Array, block_start: Array
    ) -> tuple[Array, Any]: ...


def gather_rows(a: Array, idx: Array) -> Array:
    """a [B, T, ...] at each row's indices idx [B, n] (a gathered window's tokens or positions)."""
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


class BlockStartOnly:
    """Base of the techniques that change only a wrapped Fast-dLLM strategy's block starts (ACache, BiCache):
    in-block steps are `inner`'s, run on the state's `kv` field."""

    inner: "CacheStrategy"

    @property
    def window_steps(self) -> bool:
        return self.inner.window_steps

    def step(self, params, config, inp: DecodeInputs, state, x, block_start):
        logits, kv = self.inner.step(params, config, inp, state.kv, x, block_start)
        return logits, dataclasses.replace(state, kv=kv)


def full_refresh(params, config, inp: DecodeInputs, cache: KVCache, x, block_start):
    """A full forward that rewrites every non-frozen slot of the cache: the block-start NFE of every cache mode."""
    at = block_logit_index(inp, block_start, 0, x.shape[0])
    out = forward(
        params,
        config,
        x,
        inp.positions,
        key_mask=inp.attn_mask,
        cache=cache,
        write=CacheWrite.at(0, inp.keep_mask(inp.frozen)),
        logits_at=at,
        kernels=inp.kernels,
    )
    return out.logits, out.cache


class RefreshAtBlockStart:
    """Fast-dLLM's shared part: a KV buffer over the whole sequence, fully rewritten by the block-start forward."""

    window_steps = True

    def init(self, params, config, inp: DecodeInputs, x):
        return KVCache.for_params(params, config, x.shape[0], x.shape[1])

    def block_start(self, params, config, inp, state, x, block_start):
        return full_refresh(params, config, inp, state, x, block_start)
