"""Fast-dLLM prefix cache: refresh everything at a block start, then reuse the K/V of [0, block_start).

Later steps forward the whole generation region (a static-length window [P, T), so nothing recompiles per block)
and write fresh K/V only at positions >= block_start; positions before the block read the K/V cached at the block
start. That is exactly Fast-dLLM's prefix cache (its forward of x[:, block_start:]); the window's extra queries
before the block are computed and ignored, the price of one compiled shape for all blocks.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dllm_jax.caches.base import DecodeInputs, block_logit_index
from dllm_jax.modeling import KVCache, forward


def full_refresh(params, config, inp: DecodeInputs, cache: KVCache, x, block_start):
    """A full forward that rewrites every non-frozen slot of the cache: the block-start NFE of every cache mode."""
    at = block_logit_index(inp, block_start, 0, x.shape[0])
    out = forward(params, config, x, inp.positions, key_mask=inp.attn_mask, cache=cache, cache_offset=0,
                  write_mask=~inp.frozen, logits_at=at, attention_backend=inp.backend)
    return out.logits, out.cache


@dataclasses.dataclass(frozen=True)
class PrefixCache:
    name: str = "prefix"

    def init(self, params, config, inp: DecodeInputs, x):
        return KVCache.zeros(config, x.shape[0], x.shape[1])

    def block_start(self, params, config, inp, state, x, block_start):
        return full_refresh(params, config, inp, state, x, block_start)

    def step(self, params, config, inp: DecodeInputs, state, x, block_start):
        p = inp.prompt_len
        window = x[:, p:]
        write = (jnp.arange(p, x.shape[1]) >= block_start)[None, :] & ~inp.frozen[:, p:]
        at = block_logit_index(inp, block_start, p, x.shape[0])
        out = forward(params, config, window, inp.positions[:, p:], key_mask=inp.attn_mask, cache=state,
                      cache_offset=p, write_mask=write, logits_at=at, attention_backend=inp.backend)
        return out.logits, out.cache
