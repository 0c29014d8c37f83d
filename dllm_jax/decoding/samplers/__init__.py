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
        """The settings set away from their neutral values that the sampler `resolve(family)` gives has no use for
        (LLaDA's remasking has no top-p, top-k or Dream algorithm; Dream's algorithms no remasking rule)."""
        if (self.family or family) == "llada":
            neutral = dict(alg="maskgit_plus", alg_temp=None, top_p=(None, 1.0), top_k=None, eps=1e-3)
        else:
            neutral = dict(remasking="low_confidence")
        return {
            name: getattr(self, name)
            for name, value in neutral.items()
            if getattr(self, name) not in (value if isinstance(value, tuple) else (value,))
        }

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
