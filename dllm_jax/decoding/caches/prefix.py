"""Fast-dLLM prefix cache: refresh everything at a block start, then reuse the K/V of [0, block_start).

Later steps forward the whole generation region (a static-length window [P, T), so nothing recompiles per block)
and write fresh K/V only at positions >= block_start; positions before the block read the K/V cached at the block
start. That is exactly Fast-dLLM's prefix cache (its forward of x[:, block_start:]); the window's extra queries
before the block are computed and ignored, the price of one compiled shape for all blocks.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dllm_jax.decoding.caches.base import DecodeInputs, RefreshAtBlockStart, block_logit_index
from dllm_jax.transformer import CacheWrite, forward


@dataclasses.dataclass(frozen=True)
class PrefixCache(RefreshAtBlockStart):
    name: str = "prefix"

    def step(self, params, config, inp: DecodeInputs, state, x, block_start):
        p = inp.prompt_len
        window = x[:, p:]
        write = (jnp.arange(p, x.shape[1]) >= block_start)[None, :] & ~inp.frozen[:, p:]
        at = block_logit_index(inp, block_start, p, x.shape[0])
        out = forward(
            params,
            config,
            window,
            inp.positions[:, p:],
            key_mask=inp.attn_mask,
            cache=state,
            write=CacheWrite.at(p, write),
            logits_at=at,
            kernels=inp.kernels,
        )
        return out.logits, out.cache
