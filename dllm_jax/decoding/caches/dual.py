"""Fast-dLLM dual cache: refresh everything at a block start; later steps forward only the current block.

The block's fresh K/V overwrite its cache slots; every other position (prompt, earlier blocks, the still-masked
suffix) is read from the cache written at the block start. Queries keep their absolute RoPE positions.
"""

from __future__ import annotations

import dataclasses

import jax

from dllm_jax.decoding.caches.base import DecodeInputs, RefreshAtBlockStart, block_logit_index
from dllm_jax.transformer import CacheWrite, forward


@dataclasses.dataclass(frozen=True)
class DualCache(RefreshAtBlockStart):
    name: str = "dual"

    def step(self, params, config, inp: DecodeInputs, state, x, block_start):
        bl = inp.block_length
        window = jax.lax.dynamic_slice_in_dim(x, block_start, bl, axis=1)
        positions = jax.lax.dynamic_slice_in_dim(inp.positions, block_start, bl, axis=1)
        frozen = jax.lax.dynamic_slice_in_dim(inp.frozen, block_start, bl, axis=1)
        at = block_logit_index(inp, block_start, block_start, x.shape[0])
        out = forward(
            params,
            config,
            window,
            positions,
            key_mask=inp.attn_mask,
            cache=state,
            write=CacheWrite.at(block_start, inp.keep_mask(frozen)),
            logits_at=at,
            kernels=inp.kernels,
        )
        return out.logits, out.cache
