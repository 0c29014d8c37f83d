"""Commit rules shared by the samplers, and Fast-dLLM's parallel decoding (`Threshold`, `Factor`) as samplers
that wrap another sampler's proposals.

Every rule works on the current block: confidence [B, L] (-inf where not masked), masked [B, L] bool; it returns
a boolean [B, L] of positions to commit now.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dllm_jax.decoding.samplers.base import Sampler

Array = jax.Array
NEG_INF = -jnp.inf


def exclude_token(logits: Array, token_id: int) -> Array:
    """logits with one vocabulary entry at -inf ([MASK] is never a prediction). XLA fuses the scatter into the
    reductions that read the logits (a select on the vocabulary index was slower)."""
    return logits.at[..., token_id].set(NEG_INF)


def rank_desc(conf: Array) -> Array:
    """0 for the most confident position of each row, 1 for the next, ... (stable: lower index first on ties)."""
    order = jnp.argsort(-conf, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def commit_top_k(conf: Array, masked: Array, k: Array) -> Array:
    """Commit the k[b] most confident masked positions of each row."""
    return masked & (rank_desc(conf) < k[:, None])


def commit_threshold(conf: Array, masked: Array, threshold: float) -> Array:
    """Fast-dLLM: every masked position with confidence >= threshold, and always the single most confident."""
    best = masked & (rank_desc(conf) == 0)
    return (masked & (conf >= threshold)) | best


def commit_factor(conf: Array, masked: Array, factor: float) -> Array:
    """Fast-dLLM factor rule: the n-th most confident (1-based) passes if conf > 1 - factor/(n+1), the first
    always; commit the leading run of passes (as the reference's loop does)."""
    rank = rank_desc(conf)
    n = jnp.arange(conf.shape[-1], dtype=jnp.float32) + 1.0
    sorted_conf = -jnp.sort(-conf, axis=-1)
    passes = (sorted_conf >= 1.0 - factor / (n + 1.0)) | (n == 1)
    n_commit = jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=-1), axis=-1)
    # the reference loop's quirk (Fast-dLLM get_transfer_index_dynamic): when only the LAST masked position
    # fails, it commits all of them
    n_masked = masked.sum(axis=-1)
    n_commit = jnp.where(n_commit == n_masked - 1, n_masked, n_commit)
    return masked & (rank < n_commit[:, None])


def commit_first_masked(masked: Array) -> Array:
    """The leftmost masked position of each row (Fast-dLLM Dream's block-start rule)."""
    first = jnp.argmax(masked, axis=-1)
    return masked & (jnp.arange(masked.shape[-1])[None, :] == first[:, None])


class _Parallel:
    """Fast-dLLM's parallel decoding over `base`'s proposals (a subclass's fields): each step commits the masked
    positions its `rule(conf, masked)` passes, so a block takes as many steps as it needs (<= block_length) and
    `steps` is ignored. base None: the model family's default sampler (`GenerationConfig` resolves it)."""

    uses_steps = False

    def propose(self, logits, masked, key):
        return self.base.propose(logits, masked, key)

    def commit(self, logits, masked, key, step, masked_at_start, steps_per_block):
        x0, conf = self.propose(logits, masked, jax.random.split(key)[0])
        return x0, self.rule(conf, masked)

    def fixed_step_count(self, block_length: int, steps_per_block: int) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class Threshold(_Parallel):
    """Commit every masked position whose confidence is >= threshold, and always the most confident one."""

    threshold: float
    base: Sampler | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold={self.threshold} must be in (0, 1]")

    def rule(self, conf: Array, masked: Array) -> Array:
        return commit_threshold(conf, masked, self.threshold)


@dataclasses.dataclass(frozen=True)
class Factor(_Parallel):
    """Fast-dLLM's factor rule: the n-th most confident passes if conf > 1 - factor / (n + 1); the leading run of
    passes is committed (`commit_factor`, with the reference loop's quirk)."""

    factor: float
    base: Sampler | None = None

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"factor={self.factor} must be positive")

    def rule(self, conf: Array, masked: Array) -> Array:
        return commit_factor(conf, masked, self.factor)
