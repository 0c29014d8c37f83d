"""LLaDA's samplers: x0 = argmax of Gumbel-perturbed logits, then commit the schedule's count of positions per
step, the most confident first (`LowConfidence`) or in random order (`RandomRemasking`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.decoding.samplers.commit import NEG_INF, commit_top_k

Array = jax.Array


def llada_schedule(n_masked: Array, steps: int) -> Array:
    """Tokens per step when a block with n_masked [B] masks is finished in `steps` steps: [B, steps]."""
    base = n_masked // steps
    rem = n_masked % steps
    return base[:, None] + (jnp.arange(steps)[None, :] < rem[:, None]).astype(n_masked.dtype)


def gumbel_argmax(logits: Array, key: Array, temperature: float) -> Array:
    """argmax(l + T * gumbel) == argmax of exp(l) / (-log u)^T (LLaDA's add_gumbel_noise), T = 0: plain argmax."""
    if temperature > 0:
        logits = logits + temperature * jax.random.gumbel(key, logits.shape, jnp.float32)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class LowConfidence:
    """LLaDA's default: confidence = the softmax probability of x0 under the unperturbed logits."""

    temperature: float = 0.0
    uses_steps = True

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")

    def confidence(self, logits: Array, x0: Array, masked: Array, key: Array) -> Array:
        probs = jax.nn.softmax(logits, axis=-1)
        return jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]

    def propose(self, logits: Array, masked: Array, key: Array) -> tuple[Array, Array]:
        k_noise, k_conf = jax.random.split(key)
        logits = logits.astype(jnp.float32)
        x0 = gumbel_argmax(logits, k_noise, self.temperature)
        return x0, jnp.where(masked, self.confidence(logits, x0, masked, k_conf), NEG_INF)

    def commit(self, logits, masked, key, step, masked_at_start, steps_per_block):
        x0, conf = self.propose(logits, masked, jax.random.split(key)[0])
        k = jax.lax.dynamic_index_in_dim(llada_schedule(masked_at_start, steps_per_block), step, axis=1, keepdims=False)
        return x0, commit_top_k(conf, masked, k)

    def fixed_step_count(self, block_length: int, steps_per_block: int) -> bool:
        # every schedule entry is >= 1 when block_length >= steps: the masks run out exactly at the last step
        return block_length >= steps_per_block


@dataclasses.dataclass(frozen=True)
class RandomRemasking(LowConfidence):
    """LLaDA's "random" remasking: uniform random confidence, so the committed positions are a random subset."""

    def confidence(self, logits: Array, x0: Array, masked: Array, key: Array) -> Array:
        return jax.random.uniform(key, masked.shape, jnp.float32)
