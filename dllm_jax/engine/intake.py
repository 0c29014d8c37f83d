"""Where a request enters the engine: every field checked and every setting resolved once, before it is queued and
before any device work (`RequestError` naming the field otherwise). What an engine serves (block lengths, the static
part of its sampler, BiCache's depths) is fixed when it is made; the rest is per request."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from dllm_jax.config import ModelConfig
from dllm_jax.decoding.caches.bicache import batch_depth
from dllm_jax.decoding.config import CacheConfig, GenerationConfig, Schedule, Shallow
from dllm_jax.decoding.samplers import FamilySampler
from dllm_jax.decoding.samplers.rows import RowValues, static_part
from dllm_jax.engine.affix_index import AffixIndex, find_aligned
from dllm_jax.engine.block_manager import token_bytes
from dllm_jax.engine.request import Request


class RequestError(ValueError):
    """A request the engine refuses at submit: the message names the field."""


@dataclasses.dataclass(frozen=True)
class AffixHandle:
    """A registered affix (`Engine.register_affix`)."""

    key: str
    tokens: tuple[int, ...]


@dataclasses.dataclass
class Intake:
    """The checks and resolution of requests for one engine serving these settings (ValueError for settings the
    model cannot serve). affixes: the engine's index of registered and recently seen affixes (for affix="auto")."""

    model_config: ModelConfig
    max_len: int
    block_lengths: tuple[int, ...]
    sampler: FamilySampler | None  # resolved to its static part: what the programs are built with
    shallow_depths: tuple[int, ...]
    affixes: AffixIndex
    auto_affix: bool = True
    generation: dict = dataclasses.field(default_factory=dict)  # the model's generation_config.json defaults

    def __post_init__(self) -> None:
        mc = self.model_config
        if (deepest := max(self.shallow_depths, default=0)) > mc.n_layers:
            raise ValueError(f"EngineConfig.shallow_depths: {deepest} exceeds the model's {mc.n_layers} layers")
        if max(self.block_lengths) >= self.max_len:
            raise ValueError(f"EngineConfig.block_lengths={self.block_lengths} must be < max_model_len={self.max_len}")
        self.sampler = static_part((self.sampler or FamilySampler()).resolve(mc.family))
        schedule = Schedule.from_defaults(self.generation, self.block_lengths)  # what a request without a config gets
        self.default = GenerationConfig(schedule, self.sampler, CacheConfig("dual"))

    def handle(self, tokens: Sequence[int]) -> AffixHandle:
        toks = tuple(int(t) for t in tokens)
        self._check_tokens(toks, "affix")
        return AffixHandle(self.affixes.register(toks), toks)

    def request(
        self, prompt: Sequence[int], config: GenerationConfig | None, affix: Any, request_id: str, remember: bool = True
    ) -> Request:
        """The checked request, its affix span resolved ("auto": found by the affix index, which remembers the
        prompt unless remember=False) and its settings turned into what its rows carry."""
        gc = config or self.default
        prompt = [int(t) for t in prompt]
        self._check_config(gc)
        self._check_tokens(prompt, "prompt")
        if len(prompt) + gc.schedule.gen_length > self.max_len:
            raise RequestError(
                f"prompt of {len(prompt)} tokens + gen_length {gc.schedule.gen_length} exceeds the "
                f"engine's maximum length {self.max_len}"
            )
        req = Request(request_id, prompt, gc, self._span(prompt, gc, affix, remember))
        if isinstance(req.technique, Shallow):
            req.depth = self._depth(req)
        req.row_values = RowValues.of(gc.sampler_for(self.model_config), gc.schedule.steps_per_block, req.block_length)
        return req

    def _check_tokens(self, toks: Sequence[int], what: str) -> None:
        if len(toks) == 0:
            raise RequestError(f"the {what} is empty")
        v = self.model_config.vocab_size
        if bad := [t for t in toks if not 0 <= t < v]:
            raise RequestError(f"the {what} has token ids outside [0, {v}): {bad[:5]}")

    def _check_config(self, gc: GenerationConfig) -> None:
        if not isinstance(gc, GenerationConfig):
            raise RequestError(f"config must be a GenerationConfig, got {type(gc).__name__}")
        if gc.cache.mode != "dual":
            raise RequestError(f"the engine decodes with the dual cache: cache={gc.cache.mode!r} is not served")
        if gc.cache.refresh != "block" or gc.cfg_scale:
            raise RequestError("the engine serves refresh='block' without classifier-free guidance")
        try:
            gc.check_model(self.model_config)
        except ValueError as e:
            raise RequestError(str(e)) from None
        # the settings that are part of a program's key must be among those served (and warmed)
        bl = gc.schedule.block_length
        if bl not in self.block_lengths:
            raise RequestError(
                f"block_length={bl} is not served: this engine serves block lengths {list(self.block_lengths)} "
                "(EngineConfig.block_lengths; dllm-jax serve --block-lengths)"
            )
        sampler = static_part(gc.sampler_for(self.model_config))
        if sampler != self.sampler:
            raise RequestError(
                f"the sampler {sampler} is not served: this engine decodes with {self.sampler} (temperature, top_p, "
                "top_k, threshold, factor and steps may vary per request; EngineConfig.sampler sets the rest)"
            )

    def _span(self, prompt: list[int], gc: GenerationConfig, affix, remember: bool) -> tuple[int, int] | None:
        if affix is None or gc.cache.affix is None:
            return None
        if isinstance(affix, AffixHandle):
            if (at := find_aligned(token_bytes(prompt), token_bytes(affix.tokens))) is None:
                raise RequestError(f"the prompt does not contain the affix {affix.key}")
            return at, at + len(affix.tokens)
        if isinstance(affix, str):
            if affix != "auto":
                raise RequestError(f"affix={affix!r}: expected 'auto', a handle, a (start, end) span or None")
            find = self.affixes.observe if remember else self.affixes.match
            match = find(prompt) if self.auto_affix else None
            return None if match is None else (match.start, match.end)
        try:
            s, e = (int(v) for v in affix)
        except (TypeError, ValueError):
            raise RequestError(f"affix={affix!r}: expected 'auto', a handle, a (start, end) span or None") from None
        if not 0 <= s < e <= len(prompt):
            raise RequestError(f"affix span ({s}, {e}) is not a non-empty span of the {len(prompt)}-token prompt")
        return s, e

    def _depth(self, req: Request) -> int:
        """BiCache's depth for the request: its own, or its table's rounded down to a served depth (shallower
        reuses less: closer to exact)."""
        t, served = req.config.cache.affix, self.shallow_depths
        table = dict(t.table) if t.table else None
        try:
            depth = batch_depth(self.model_config, [req.affix_span], [len(req.prompt)], req.gen_length, t.depth, table)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if t.depth is None:
            depth = max((d for d in served if d <= depth), default=depth)
        if depth not in served:
            raise RequestError(
                f"shallow_depth={depth} is not served: this engine serves BiCache depths {list(served)} "
                "(EngineConfig.shallow_depths; dllm-jax serve --shallow-depths)"
            )
        return depth
