"""A request's host record (its prompt, shared affix span, settings and progress; no device arrays) and what it streams
back (`BlockOutput`, one per committed block)."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Callable

import numpy as np

from dllm_jax.decoding.caches.acache import anchor_count
from dllm_jax.decoding.config import Anchors, GenerationConfig, NaiveReuse


class Status(enum.Enum):
    WAITING, RUNNING, FINISHED = "waiting", "running", "finished"  # queued; pages reserved, decoding; pages freed


@dataclasses.dataclass(frozen=True)
class BlockOutput:
    """One committed block of one request (what a stream yields)."""

    request_id: str
    block: int  # index of the block in the generation region
    tokens: list[int]  # the block's new answer tokens (cut before a stop token)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error" (its device call failed) or "timeout"
    commit_steps: list[int] = dataclasses.field(default_factory=list)  # per token, the in-block step that wrote it
    affix: tuple[tuple[int, int] | None, list[int]] = (None, [])  # the shared affix's span and ACache's anchors


@dataclasses.dataclass(eq=False)
class Request:
    """A request: its prompt token ids, the [start, end) span of a shared affix in them (or None) and its settings."""

    request_id: str
    prompt: list[int]
    config: GenerationConfig
    affix_span: tuple[int, int] | None = None
    on_block: Callable[[BlockOutput], Any] | None = None
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    deadline: float | None = None  # perf_counter time past which it ends unfinished ("timeout")
    # host state, owned by the engine
    status: Status = Status.WAITING
    generated: list[int] = dataclasses.field(default_factory=list)  # committed tokens, whole blocks
    pages: list[int] = dataclasses.field(default_factory=list)  # private pages
    affix_entry: Any = None  # block_manager.AffixEntry while running with a shared affix
    anchors: list[int] = dataclasses.field(default_factory=list)  # ACache: prompt indices recomputed per block
    key: np.ndarray | None = None  # the request's PRNG key data (advances only at its own steps)
    depth: int = 0  # BiCache: layers reusing the shared prefix
    row_values: Any = None  # samplers.rows.RowValues: the sampling settings and step budget its rows carry
    plan: Any = None  # the runner's cached layout of the request (runner.RowPlan), by anchor set
    first_block_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None

    gen_length = property(lambda self: self.config.schedule.gen_length)
    block_length = property(lambda self: self.config.schedule.block_length)
    n_blocks = property(lambda self: self.config.schedule.n_blocks)
    total_len = property(lambda self: len(self.prompt) + self.gen_length)
    blocks_done = property(lambda self: len(self.generated) // self.block_length)
    technique = property(lambda self: self.config.cache.affix if self.affix_span is not None else None)  # in force
    affix_len = property(lambda self: 0 if self.affix_span is None else self.affix_span[1] - self.affix_span[0])

    # whether the affix's non-anchor tokens read the one stored copy (all techniques but BiCache, whose deeper layers
    # recompute the prefix with the request and so keep it privately)
    shares_affix = property(lambda self: isinstance(self.technique, (NaiveReuse, Anchors)))

    @property
    def anchor_count(self) -> int:
        return anchor_count(self.affix_len, t.ratio) if isinstance(t := self.technique, Anchors) else 0

    needs_probe = property(lambda self: self.anchor_count > 0 and not self.anchors)  # ACache: its next call probes it

    def probe_done(self, ranking) -> None:
        """ACache: its probe ran: its anchors are the first anchor_count of `ranking` (its affix tokens, the most
        important first, from `acache.rank_anchors`), as sorted prompt indices."""
        self.anchors = sorted(self.affix_span[0] + int(j) for j in ranking[: self.anchor_count])

    def private_tokens(self) -> int:
        """Slots a request writes: everything but a shared affix's non-anchor tokens."""
        return self.total_len - (self.affix_len - self.anchor_count if self.shares_affix else 0)

    def own_prompt_indices(self) -> list[int]:
        """Prompt indices recomputed at block starts besides the anchors: everything outside a shared affix."""
        s, e = self.affix_span if self.technique is not None else (0, 0)
        return [j for j in range(len(self.prompt)) if not s <= j < e]

    def answer(self, stop_ids: tuple[int, ...]) -> list[int]:
        """Generated tokens up to (excluding) the first stop token."""
        return self.generated[: next((i for i, t in enumerate(self.generated) if t in stop_ids), None)]
