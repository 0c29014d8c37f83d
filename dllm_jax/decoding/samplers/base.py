"""The interface every sampling algorithm implements, as `decoding/caches/base.py` is for caches.

At each denoising step the loop hands the sampler the current block's logits and which positions are still
[MASK]; the sampler proposes a token for every masked position and says which of them to commit now. The loop knows
no algorithm by name. A sampler is a frozen dataclass: static and hashable (part of the compiled program's key).
"""

from __future__ import annotations

from typing import Protocol

import jax

Array = jax.Array


class Sampler(Protocol):
    # True when the algorithm commits a count set by `steps` (each block takes exactly steps / n_blocks steps when
    # `fixed_step_count` says so); False for threshold / factor parallel decoding, which ignore `steps`.
    uses_steps: bool

    def propose(self, logits: Array, masked: Array, key: Array) -> tuple[Array, Array]:
        """logits [B, L, V] fp32 of the block, masked [B, L] -> (candidate tokens x0 [B, L] int32, confidence [B, L]
        with -inf where not masked)."""
        ...

    def commit(
        self, logits: Array, masked: Array, key: Array, step: Array, masked_at_start: Array, steps_per_block: int
    ) -> tuple[Array, Array]:
        """(x0 [B, L], commit [B, L] bool: the positions to fill with x0 now). step: the step inside the block;
        masked_at_start [B]: the block's mask count at its first step; steps_per_block: the fixed schedule's."""
        ...

    def fixed_step_count(self, block_length: int, steps_per_block: int) -> bool:
        """Whether every block provably takes exactly steps_per_block steps (each step before the last leaves a live
        row at least one mask), so that the loop may run a known trip count."""
        ...
