"""What a generate call is asked to do: the schedule, the sampler, the cache technique and the kernels, each a small
frozen dataclass checked where it is built, combined by `GenerationConfig` (which checks only what spans them).

All of them are static: a new value compiles a new program, the same value never recompiles.

    GenerationConfig(Schedule(gen_length=256, block_length=32, steps=64), cache="dual")
    GenerationConfig(Schedule(256, 32), sampler=Threshold(0.9), cache=CacheConfig("dual", affix=Anchors(0.2)))
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence, Union

from dllm_jax.config import ModelConfig
from dllm_jax.decoding.samplers import Factor, FamilySampler, Sampler, Threshold
from dllm_jax.transformer.kernels import KernelChoice

CacheMode = Literal["none", "first_layer", "prefix", "dual"]
CACHE_MODES = ("none", "first_layer", "prefix", "dual")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Semi-autoregressive blocks: the generation region of gen_length tokens is finished block by block, each block
    in steps / n_blocks denoising steps (LLaDA's schedule; threshold / factor samplers take as many as they need)."""

    gen_length: int = 128
    block_length: int = 32
    steps: int = 128

    def __post_init__(self) -> None:
        for name in ("gen_length", "block_length", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}")

    @property
    def n_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.n_blocks

    @staticmethod
    def served_block_length(defaults: dict, block_lengths: Sequence[int]) -> int:
        """The model's block length (generation_config.json) where it is listed, else the first listed: a default
        never names a program the engine lacks."""
        return d if (d := defaults.get("block_length")) in block_lengths else block_lengths[0]

    @classmethod
    def from_defaults(cls, defaults: dict, block_lengths: Sequence[int]) -> "Schedule":
        """A model's generation_config.json schedule (`io.loading.generation_defaults`; this class's gen_length where
        it has none) at its block length if listed, else the first listed: gen_length rounded up to whole blocks;
        steps one a token unless the model's divide into the blocks."""
        block_length = cls.served_block_length(defaults, block_lengths)
        gen = -(-defaults.get("gen_length", cls.gen_length) // block_length) * block_length
        steps = defaults.get("steps", gen)
        return cls(gen, block_length, steps if steps <= gen and steps % (gen // block_length) == 0 else gen)


@dataclasses.dataclass(frozen=True)
class NaiveReuse:
    """The shared affix keeps the K/V it has alone, never refreshed (the baseline the two techniques correct)."""

    name = "naive"


@dataclasses.dataclass(frozen=True)
class Anchors:
    """ACache: block starts recompute the request and the `ratio` share of the affix that a one-shot probe (one NFE)
    finds most attended by the generation region's [MASK] queries. ratio 0 = naive reuse, 1 = the plain cache."""

    ratio: float = 0.2
    name = "anchors"

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"anchor ratio={self.ratio} must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class Shallow:
    """BiCache: the shared part's K/V reused in layers < depth, recomputed with the request in the deeper layers at
    every block start. depth None: from `table` ((r, depth) pairs, e.g. `bicache.depth_table_from_profile`), else
    the table of the LLaDA-8B / Dream-7B paper by the affix's share of the sequence. 0 = the plain cache, n_layers =
    naive reuse."""

    depth: int | None = None
    table: tuple[tuple[int, int], ...] | None = None
    name = "shallow"

    def __post_init__(self) -> None:
        if self.depth is not None and self.depth < 0:
            raise ValueError(f"shallow depth={self.depth} must be >= 0")
        if self.table is not None:  # a dict or list of pairs -> sorted pairs (hashable)
            items = self.table.items() if isinstance(self.table, dict) else self.table
            table = tuple(sorted((int(r), int(b)) for r, b in items))
            if not table or table[0][0] != 0 or any(b < 0 for _, b in table):
                raise ValueError(f"shallow table={table} needs an entry for r = 0 and depths >= 0")
            object.__setattr__(self, "table", table)


AffixTechnique = Union[NaiveReuse, Anchors, Shallow]


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """mode: "none" (full recompute), "first_layer" (LaCache's exact first-layer memo), "prefix" / "dual"
    (Fast-dLLM, refreshed at block starts). affix: how a shared affix is reused (needs "prefix" or "dual").
    refresh "step": refresh the cache at every step (exact; for tests)."""

    mode: CacheMode = "none"
    affix: AffixTechnique | None = None
    refresh: Literal["block", "step"] = "block"

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise ValueError(f"cache={self.mode!r}; expected one of {CACHE_MODES}")
        if self.refresh not in ("block", "step"):
            raise ValueError(f"refresh={self.refresh!r}; expected block or step")
        if self.affix is not None and not isinstance(self.affix, (NaiveReuse, Anchors, Shallow)):
            raise ValueError(f"affix={self.affix!r}; expected NaiveReuse(), Anchors(ratio) or Shallow(depth)")
        if self.affix is not None and self.mode not in ("prefix", "dual"):
            raise ValueError(f"affix={self.affix.name!r} reuses cached K/V: it needs cache 'prefix' or 'dual'")

    @property
    def affix_name(self) -> str:
        return "none" if self.affix is None else self.affix.name


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings. sampler None: the model family's own (LLaDA: LowConfidence, Dream: MaskGitPlus);
    Threshold / Factor without a base wrap that default. cfg_scale: LLaDA's classifier-free guidance (cache
    "none"). stop_at_eos: a row whose answer ended is filled with EOS; when every row has ended the loop stops.
    prompt_bucket: the prompt region is rounded up to a multiple of this (fewer compiled shapes)."""

    schedule: Schedule = Schedule()
    sampler: Sampler | None = None
    cache: CacheConfig = CacheConfig()
    kernels: KernelChoice = KernelChoice()
    cfg_scale: float = 0.0
    stop_at_eos: bool = True
    extra_stop_ids: tuple[int, ...] = ()
    prompt_bucket: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.cache, str):  # GenerationConfig(cache="dual")
            object.__setattr__(self, "cache", CacheConfig(self.cache))
        # a list would make the (static, hashed) config unhashable
        object.__setattr__(self, "extra_stop_ids", tuple(int(i) for i in self.extra_stop_ids))
        if self.cfg_scale < 0:
            raise ValueError(f"cfg_scale={self.cfg_scale} must be >= 0")
        if self.cfg_scale > 0 and self.cache.mode != "none":
            raise ValueError(
                f"cfg_scale={self.cfg_scale} needs cache 'none' (guidance reruns the prompt unconditionally)"
            )
        if self.prompt_bucket <= 0:
            raise ValueError(f"prompt_bucket={self.prompt_bucket} must be positive")
        if self.kernels.batch_invariant and self.cache.mode == "first_layer":
            raise ValueError("batch_invariant does not cover cache 'first_layer' (LaCache's memo); use dual or prefix")
        s = self.schedule
        if self.sampler is None or self.sampler.uses_steps:  # threshold / factor ignore steps
            if s.steps % s.n_blocks:
                raise ValueError(
                    f"steps={s.steps} must be a multiple of the number of blocks ({s.gen_length} / "
                    f"{s.block_length} = {s.n_blocks})"
                )
            if s.steps > s.gen_length:
                raise ValueError(f"steps={s.steps} exceeds gen_length={s.gen_length} (at most one step per token)")

    @property
    def parallel(self) -> bool:
        return isinstance(self.sampler, (Threshold, Factor))

    def sampler_for(self, config: ModelConfig) -> Sampler:
        """The sampler with the family's defaults resolved (static: the loop traces it)."""

        def resolve(s):
            return (s or FamilySampler()).resolve(config.family) if isinstance(s, (FamilySampler, type(None))) else s

        if isinstance(self.sampler, (Threshold, Factor)):
            return dataclasses.replace(self.sampler, base=resolve(self.sampler.base))
        return resolve(self.sampler)

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """Every option `from_options` takes."""
        import inspect

        explicit = set(inspect.signature(cls.from_options).parameters) - {"rest"}
        sampler = {f.name for f in dataclasses.fields(FamilySampler)} - {"family"}
        own = {f.name for f in dataclasses.fields(cls)} - {"schedule", "sampler", "cache", "kernels"}
        return frozenset(explicit | sampler | own | {"sampler"})

    @classmethod
    def from_options(
        cls,
        *,
        gen_length: int = 128,
        block_length: int = 32,
        steps: int | None = None,
        threshold: float | None = None,
        factor: float | None = None,
        cache: str = "none",
        affix: str = "none",
        anchor_ratio: float = 0.2,
        shallow_depth: int | None = None,
        shallow_table=None,
        refresh: str = "block",
        attention: str = "auto",
        rope_write: str = "auto",
        step_loop: str = "auto",
        batch_invariant: bool = False,
        **rest,
    ) -> "GenerationConfig":
        """The config from flat options, the names the CLI, the server's request fields and the tests use.
        Sampler options (temperature, remasking, alg, alg_temp, top_p, top_k, eps, and sampler="llada"|"dream"
        to force a family's sampler) go to `FamilySampler`; cfg_scale, stop_at_eos, extra_stop_ids, prompt_bucket
        to the config itself. steps None: one token per step."""
        unknown = set(rest) - cls.option_names()
        if unknown:
            raise TypeError(f"unknown generation option(s) {sorted(unknown)}")
        sampler_keys = {f.name for f in dataclasses.fields(FamilySampler)} - {"family"}
        sampler_opts = {k: rest.pop(k) for k in list(rest) if k in sampler_keys}
        family = rest.pop("sampler", None)
        sampler: Sampler = FamilySampler(**sampler_opts, family=family)
        if threshold is not None and factor is not None:
            raise ValueError("set threshold or factor, not both")
        if threshold is not None:
            sampler = Threshold(threshold, sampler)
        elif factor is not None:
            sampler = Factor(factor, sampler)
        techniques = {
            "none": lambda: None,
            "naive": NaiveReuse,
            "anchors": lambda: Anchors(anchor_ratio),
            "shallow": lambda: Shallow(shallow_depth, shallow_table),
        }
        if affix not in techniques:
            raise ValueError(f"affix={affix!r}; expected one of {sorted(techniques)}")
        return cls(
            Schedule(gen_length, block_length, steps or gen_length),
            sampler,
            CacheConfig(cache, techniques[affix](), refresh),
            KernelChoice(attention, rope_write, step_loop, batch_invariant),
            **rest,
        )

    def stop_token_ids(self, config: ModelConfig) -> tuple[int, ...]:
        return (config.eos_token_id,) + tuple(self.extra_stop_ids)

    def max_steps_per_block(self) -> int:
        """Each step commits >= 1 token, so a threshold / factor block takes at most block_length steps."""
        return self.schedule.block_length if self.parallel else self.schedule.steps_per_block

    def check_model(self, config: ModelConfig) -> None:
        """The checks that need the model: BiCache's depth within its layers, sampler settings the model family's
        sampler would ignore (top_p on LLaDA), Dream's block-start rule."""
        base = self.sampler.base if isinstance(self.sampler, (Threshold, Factor)) else self.sampler
        if isinstance(base, FamilySampler) and (ignored := base.ignored(config.family)):
            (name, value), family = next(iter(ignored.items())), base.family or config.family
            names = {"llada": "LLaDA's remasking sampler", "dream": "Dream's sampler"}
            raise ValueError(
                f"{name}={value!r} would be ignored: this request decodes with {names[family]}, which has no {name} "
                f"(a setting of {names['dream' if family == 'llada' else 'llada']}): leave it out"
            )
        affix = self.cache.affix
        if isinstance(affix, Shallow):
            depths = ([affix.depth] if affix.depth is not None else []) + [b for _, b in affix.table or ()]
            if any(b > config.n_layers for b in depths):
                raise ValueError(f"shallow depth {max(depths)} exceeds the model's {config.n_layers} layers")
        sampler = self.sampler_for(config)
        if (
            config.family == "dream"
            and self.cache.mode in ("prefix", "dual")
            and sampler.uses_steps
            and self.cache.refresh == "block"
            and self.schedule.steps_per_block < 2
        ):
            raise ValueError(
                f"Dream with a cache commits only the block's first token at the block start: it needs "
                f">= 2 steps per block, got steps={self.schedule.steps} for {self.schedule.n_blocks} "
                "blocks"
            )
