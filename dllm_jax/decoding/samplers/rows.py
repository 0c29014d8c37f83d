"""Per-row sampling settings as data: one compiled program decodes rows with different temperatures, top-p / top-k,
commit rules (the family's step schedule, a confidence threshold or Fast-dLLM's factor) and steps per block.

The serving engine batches requests whatever their settings, so those settings cannot be static (each new value
would compile a new program). `RowSampler` wraps the family's sampler (static: LLaDA's remasking rule, Dream's
algorithm, alg_temp and eps) and takes the rest per row (`RowSettings`). A row's tokens are those of the static
sampler with the same values (`GenerationConfig.sampler_for`) decoding that row alone: the same keys, the same
random draws (one per row, of the shape a batch-1 call draws) and the same arithmetic (tests/test_engine.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.decoding.samplers.base import Sampler
from dllm_jax.decoding.samplers.commit import NEG_INF, Factor, Threshold, commit_factor, commit_threshold, commit_top_k
from dllm_jax.decoding.samplers.dream import MaskGitPlus, dream_transfer_count

Array = jax.Array
SCHEDULE, THRESHOLD, FACTOR = 0, 1, 2  # RowSettings.rule


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
    """Each row's sampling settings [B]. A padding row has steps 0: it commits nothing."""

    temperature: Array  # float32, 0: greedy
    top_p: Array  # float32, 1: off
    top_k: Array  # int32, 0: off
    rule: Array  # int32: SCHEDULE, THRESHOLD or FACTOR
    value: Array  # float32: the threshold or the factor
    steps: Array  # int32: the row's step budget in a block (its schedule's steps per block; block_length otherwise)


@dataclasses.dataclass(frozen=True)
class RowValues:
    """One row's settings on the host (what `RowSettings` stacks)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    rule: int = SCHEDULE
    value: float = 0.0
    steps: int = 0

    @classmethod
    def of(cls, sampler: Sampler, steps_per_block: int, block_length: int) -> "RowValues":
        """A resolved static sampler (`GenerationConfig.sampler_for`) as row values."""
        rule, value, base = SCHEDULE, 0.0, sampler
        if isinstance(sampler, Threshold):
            rule, value, base = THRESHOLD, sampler.threshold, sampler.base
        elif isinstance(sampler, Factor):
            rule, value, base = FACTOR, sampler.factor, sampler.base
        top_p = getattr(base, "top_p", None)
        # saturated to the arrays' types: a top-k past the vocabulary filters nothing, a factor past float32's
        # range commits as one at its maximum does (a value that overflowed would fail every row of its call)
        return cls(
            temperature=float(base.temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=min(int(getattr(base, "top_k", None) or 0), np.iinfo(np.int32).max),
            rule=rule,
            value=min(float(value), float(np.finfo(np.float32).max)),
            steps=steps_per_block if rule == SCHEDULE else block_length,
        )


def static_part(sampler: Sampler) -> Sampler:
    """The static family sampler under a resolved sampler: its per-row fields at their neutral values (the key a
    `RowSampler` is compiled for)."""
    base = sampler.base if isinstance(sampler, (Threshold, Factor)) else sampler
    neutral = dict(temperature=0.0)
    if isinstance(base, MaskGitPlus):
        neutral.update(top_p=None, top_k=None)
    return dataclasses.replace(base, **neutral)


def stack_rows(values: list[RowValues], batch: int) -> dict[str, np.ndarray]:
    """Host arrays of `RowSettings` for `values`, padded to `batch` rows (padding rows: steps 0)."""
    pad = [RowValues()] * (batch - len(values))
    rows = list(values) + pad
    f32, i32 = np.float32, np.int32
    return dict(
        temperature=np.asarray([r.temperature for r in rows], f32),
        top_p=np.asarray([r.top_p for r in rows], f32),
        top_k=np.asarray([r.top_k for r in rows], i32),
        rule=np.asarray([r.rule for r in rows], i32),
        value=np.asarray([r.value for r in rows], f32),
        steps=np.asarray([r.steps for r in rows], i32),
    )


def _per_row(fn, keys: Array, shape: tuple[int, ...]) -> Array:
    """A random draw per row of the shape a batch-1 call draws ([1, *shape]), stacked [B, *shape]."""
    return jax.vmap(lambda k: fn(k, (1,) + shape)[0])(keys)


@dataclasses.dataclass(frozen=True)
class RowSampler:
    """The family sampler `base` (static) with temperature, top-p / top-k, the commit rule and the step budget per
    row (`RowSettings`). Keys are per row."""

    base: Sampler
    uses_steps = True

    def propose(self, logits: Array, masked: Array, keys: Array, rows: RowSettings) -> tuple[Array, Array]:
        logits = logits.astype(jnp.float32)
        shape = logits.shape[1:]
        if isinstance(self.base, MaskGitPlus):
            return self._propose_dream(logits, masked, keys, rows)
        noise, conf_keys = _split(keys)
        # LLaDA: x0 = argmax(logits + T * gumbel); confidence from the unperturbed logits
        t = rows.temperature[:, None, None]

        def sampled():
            g = _per_row(lambda k, s: jax.random.gumbel(k, s, jnp.float32), noise, shape)
            return jnp.where(t > 0, logits + t * g, logits)

        perturbed = jax.lax.cond(jnp.any(rows.temperature > 0), sampled, lambda: logits)
        x0 = jnp.argmax(perturbed, axis=-1).astype(jnp.int32)
        conf = jax.vmap(lambda lg, x, m, k: self.base.confidence(lg[None], x[None], m[None], k)[0])(
            logits, x0, masked, conf_keys
        )
        return x0, jnp.where(masked, conf, NEG_INF)

    def _propose_dream(self, logits, masked, keys, rows: RowSettings):
        t = rows.temperature[:, None, None]
        lt = jnp.where(t > 0, logits / jnp.where(t > 0, t, 1.0), logits)
        p = rows.top_p[:, None, None]
        lt = jax.lax.cond(jnp.any(rows.top_p < 1), lambda: jnp.where(p < 1, _top_p(lt, p), lt), lambda: lt)
        k = rows.top_k[:, None, None]
        lt = jax.lax.cond(jnp.any(rows.top_k > 0), lambda: jnp.where(k > 0, _top_k(lt, k), lt), lambda: lt)
        probs = jax.nn.softmax(lt, axis=-1)
        greedy = jnp.argmax(probs, axis=-1).astype(jnp.int32)

        def sampled():
            drawn = jax.vmap(lambda key, lg: jax.random.categorical(key, lg[None], axis=-1)[0])(keys, lt)
            return jnp.where(t[..., 0] > 0, drawn.astype(jnp.int32), greedy)

        x0 = jax.lax.cond(jnp.any(rows.temperature > 0), sampled, lambda: greedy)
        x0_prob = jnp.where(
            t[..., 0] > 0, jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0], jnp.max(probs, axis=-1)
        )
        return x0, jnp.where(masked, self.base.confidence(probs, x0_prob), NEG_INF)

    def commit_rows(
        self, logits: Array, masked: Array, keys: Array, step: Array, masked_at_start: Array, rows: RowSettings
    ) -> tuple[Array, Array]:
        """(x0 [B, L], commit [B, L]) as each row's static sampler would decide alone; rows past their step budget
        commit nothing."""
        k_prop, k_commit = _split(keys)
        x0, conf = self.propose(logits, masked, k_prop, rows)
        if isinstance(self.base, MaskGitPlus):
            n = masked.sum(axis=-1).astype(jnp.int32)
            count, prob = dream_transfer_count(n, step, rows.steps.astype(jnp.float32), self.base.eps)
            scheduled = jax.vmap(lambda c, m, k, n_, p: self.base.reveal(c[None], m[None], k, n_[None], p[None])[0])(
                conf, masked, k_commit, count, prob
            )
        else:  # LLaDA: the step's share of the block's masks, base + (step < remainder)
            s = jnp.maximum(rows.steps, 1)
            k = masked_at_start // s + (step < masked_at_start % s).astype(jnp.int32)
            scheduled = commit_top_k(conf, masked, k)
        value = rows.value[:, None]
        rule = rows.rule[:, None]
        commit = jnp.where(
            rule == SCHEDULE,
            scheduled,
            jnp.where(rule == THRESHOLD, commit_threshold(conf, masked, value), commit_factor(conf, masked, value)),
        )
        return x0, commit & (step < rows.steps)[:, None]

    def fixed_step_count(self, block_length: int, steps_per_block: int) -> bool:
        return False


def _split(keys: Array) -> tuple[Array, Array]:
    pairs = jax.vmap(jax.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]


def _top_p(logits: Array, top_p: Array) -> Array:
    """Dream's top-p filter with a per-row p (`dream._top_p_filter`'s arithmetic)."""
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    soft = jax.nn.softmax(sorted_logits, axis=-1)
    remove_sorted = (jnp.cumsum(soft, axis=-1) - soft) > top_p
    cutoff = jnp.min(jnp.where(remove_sorted, jnp.inf, sorted_logits), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, NEG_INF, logits)


def _top_k(logits: Array, top_k: Array) -> Array:
    """Dream's top-k filter with a per-row k: the k-th largest value is the cutoff (what lax.top_k's last gives)."""
    sorted_desc = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(sorted_desc, jnp.clip(top_k - 1, 0, logits.shape[-1] - 1), axis=-1)
    return jnp.where(logits < kth, NEG_INF, logits)
