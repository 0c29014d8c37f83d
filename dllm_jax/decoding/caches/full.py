"""No cache (`cache="none"`): every step is a full forward over the whole buffer (the reference behaviour)."""

from __future__ import annotations

import dataclasses

from dllm_jax.decoding.caches.base import DecodeInputs, block_logit_index
from dllm_jax.transformer import forward


@dataclasses.dataclass(frozen=True)
class NoCache:
    name: str = "none"
    window_steps = False

    def init(self, params, config, inp: DecodeInputs, x):
        return ()

    def step(self, params, config, inp: DecodeInputs, state, x, block_start):
        at = block_logit_index(inp, block_start, 0, x.shape[0])
        out = forward(params, config, x, inp.positions, key_mask=inp.attn_mask, logits_at=at, kernels=inp.kernels)
        return out.logits, state

    block_start = step
