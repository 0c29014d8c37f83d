"""Dream's samplers (its `diffusion_generate` algorithms): temperature and top-p / top-k filtering, x0 sampled or
argmax, then a reveal count per step from Dream's timesteps; which positions are revealed is the algorithm's:
`MaskGitPlus` (the most probable), `TopKMargin` (largest top-1 / top-2 margin), `Entropy` (lowest entropy),
`Origin` (each masked position with the step's probability, at random)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.decoding.samplers.commit import NEG_INF, commit_top_k

Array = jax.Array


def dream_transfer_count(n_masked: Array, step: Array, steps: int, eps: float) -> tuple[Array, Array]:
    """Dream: timesteps linspace(1, eps, steps+1); reveal int(n * (1 - s/t)), all at the last step.
    Returns (count [B], the reveal probability 1 - s/t)."""
    t = 1.0 - step.astype(jnp.float32) * (1.0 - eps) / steps
    s = 1.0 - (step.astype(jnp.float32) + 1.0) * (1.0 - eps) / steps
    prob = jnp.where(step < steps - 1, 1.0 - s / t, 1.0)
    count = jnp.where(step < steps - 1, jnp.floor(n_masked.astype(jnp.float32) * prob).astype(jnp.int32), n_masked)
    return count, prob


def _top_p_filter(logits: Array, top_p: float) -> Array:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # HF/Dream: remove token i (sorted) when the mass before it exceeds top_p; the first is always kept
    remove_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) > top_p
    cutoff = jnp.min(jnp.where(remove_sorted, jnp.inf, sorted_logits), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, NEG_INF, logits)


def _top_k_filter(logits: Array, top_k: int) -> Array:
    kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
    return jnp.where(logits < kth, NEG_INF, logits)


@dataclasses.dataclass(frozen=True)
class MaskGitPlus:
    """Dream's default: confidence = the probability of x0 (the max probability at temperature 0). alg_temp > 0
    samples the revealed positions without replacement from softmax(conf / alg_temp) (Gumbel top-k)."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    alg_temp: float | None = None
    eps: float = 1e-3
    uses_steps = True

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k <= 0:
            raise ValueError(f"top_k={self.top_k} must be positive")
        if not 0.0 < self.eps < 1.0:
            raise ValueError(f"eps={self.eps} must be in (0, 1)")

    def confidence(self, probs: Array, x0_prob: Array) -> Array:
        return x0_prob

    def propose(self, logits: Array, masked: Array, key: Array) -> tuple[Array, Array]:
        logits = logits.astype(jnp.float32)
        if self.temperature > 0:
            logits = logits / self.temperature
        if self.top_p is not None and self.top_p < 1:
            logits = _top_p_filter(logits, self.top_p)
        if self.top_k is not None:
            logits = _top_k_filter(logits, self.top_k)
        probs = jax.nn.softmax(logits, axis=-1)
        if self.temperature > 0:
            x0 = jax.random.categorical(key, logits, axis=-1)
            x0_prob = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
        else:
            x0 = jnp.argmax(probs, axis=-1)
            x0_prob = jnp.max(probs, axis=-1)
        return x0.astype(jnp.int32), jnp.where(masked, self.confidence(probs, x0_prob), NEG_INF)

    def commit(self, logits, masked, key, step, masked_at_start, steps_per_block):
        k_cand, k_commit = jax.random.split(key)
        x0, conf = self.propose(logits, masked, k_cand)
        count, prob = dream_transfer_count(masked.sum(axis=-1).astype(jnp.int32), step, steps_per_block, self.eps)
        return x0, self.reveal(conf, masked, k_commit, count, prob)

    def reveal(self, conf: Array, masked: Array, key: Array, count: Array, prob: Array) -> Array:
        if self.alg_temp and self.alg_temp > 0:
            noisy = jnp.where(masked, conf / self.alg_temp + jax.random.gumbel(key, conf.shape), -jnp.inf)
            return commit_top_k(noisy, masked, count)
        return commit_top_k(conf, masked, count)

    def fixed_step_count(self, block_length: int, steps_per_block: int) -> bool:
        # floor(n * p) with p < 1 leaves >= 1 of n >= 1 masks until the last step reveals all; the first-token
        # commit at a cached block start needs block_length >= 2
        return block_length >= 2


@dataclasses.dataclass(frozen=True)
class TopKMargin(MaskGitPlus):
    """Confidence = the margin between the two most probable tokens."""

    def confidence(self, probs: Array, x0_prob: Array) -> Array:
        top2 = jax.lax.top_k(probs, 2)[0]
        return top2[..., 0] - top2[..., 1]


@dataclasses.dataclass(frozen=True)
class Entropy(MaskGitPlus):
    """Confidence = the negative entropy of the position's distribution (higher = more certain)."""

    def confidence(self, probs: Array, x0_prob: Array) -> Array:
        return jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)


@dataclasses.dataclass(frozen=True)
class Origin(MaskGitPlus):
    """Dream's "origin": each masked position is revealed with the step's probability, whatever its confidence,
    so a block finishes after a data-dependent number of steps."""

    def reveal(self, conf: Array, masked: Array, key: Array, count: Array, prob: Array) -> Array:
        return masked & (jax.random.uniform(key, masked.shape) < prob)

    def fixed_step_count(self, block_length: int, steps_per_block: int) -> bool:
        return False
