"""Sampling algorithms, one named object each behind the `Sampler` interface (`base.py`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from dllm_jax.decoding.samplers.base import Sampler
from dllm_jax.decoding.samplers.commit import Factor, Threshold
from dllm_jax.decoding.samplers.dream import Entropy, MaskGitPlus, Origin, TopKMargin
from dllm_jax.decoding.samplers.llada import LowConfidence, RandomRemasking

DREAM_ALGS = {"maskgit_plus": MaskGitPlus, "topk_margin": TopKMargin, "entropy": Entropy, "origin": Origin}
LLADA_REMASKING = {"low_confidence": LowConfidence, "random": RandomRemasking}


@dataclasses.dataclass(frozen=True)
class FamilySampler:
    """The model family's own sampler with these settings, resolved when the model is known (`resolve`): LLaDA's
    remasking rule or Dream's algorithm. family names one explicitly (e.g. LLaDA's sampler on a Dream model)."""

    temperature: float = 0.0
    remasking: Literal["low_confidence", "random"] = "low_confidence"  # LLaDA
    alg: Literal["maskgit_plus", "topk_margin", "entropy", "origin"] = "maskgit_plus"  # Dream
    alg_temp: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    eps: float = 1e-3
    family: Literal["llada", "dream"] | None = None
    uses_steps = True

    def __post_init__(self) -> None:
        if self.remasking not in LLADA_REMASKING:
            raise ValueError(f"remasking={self.remasking!r}; expected one of {sorted(LLADA_REMASKING)}")
        if self.alg not in DREAM_ALGS:
            raise ValueError(f"alg={self.alg!r}; expected one of {sorted(DREAM_ALGS)}")
        if self.family not in (None, "llada", "dream"):
            raise ValueError(f"sampler family={self.family!r}; expected llada or dream")
        self.resolve("llada"), self.resolve("dream")  # each family's own checks (temperature, top_p, ...)

    def ignored(self, family: str) -> dict[str, object]:
        """The settings away from their defaults that the sampler `resolve(family)` gives has no use for (LLaDA's
        remasking has no top-p, top-k or Dream algorithm; Dream's algorithms no remasking rule). top_p 1 filters
        nothing."""
        unused = ("alg", "alg_temp", "top_p", "top_k", "eps") if (self.family or family) == "llada" else ("remasking",)
        neutral = {f.name: (f.default,) for f in dataclasses.fields(self)} | {"top_p": (None, 1.0)}
        return {n: getattr(self, n) for n in unused if getattr(self, n) not in neutral[n]}

    def resolve(self, family: str) -> Sampler:
        if (self.family or family) == "llada":
            return LLADA_REMASKING[self.remasking](temperature=self.temperature)
        return DREAM_ALGS[self.alg](
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, alg_temp=self.alg_temp, eps=self.eps
        )


__all__ = [
    "DREAM_ALGS",
    "Entropy",
    "FamilySampler",
    "Factor",
    "LowConfidence",
    "MaskGitPlus",
    "Origin",
    "RandomRemasking",
    "Sampler",
    "Threshold",
    "TopKMargin",
]
