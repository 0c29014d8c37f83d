"""What a model family is to the engine: a table from HF tensor names to param-tree paths, plus its chat format."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dllm_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One HF tensor -> one param leaf. `{i}` in hf_name is the layer index (the leaf is stacked over layers)."""

    hf_name: str
    path: tuple[str, ...]
    transpose: bool  # PyTorch Linear weights are [out, in]; our kernels are [in, out]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    name: str
    rules: Callable[[ModelConfig], tuple[TensorRule, ...]]
    hf_config: Callable[[ModelConfig], dict[str, Any]]  # writes the family's own config.json keys
    chat_template: str  # jinja, used when the checkpoint's tokenizer carries none
    oracle: str  # the transformers class that computes the same function with a bidirectional mask

    def expand(self, config: ModelConfig) -> dict[str, tuple[TensorRule, int | None]]:
        """Every HF tensor name the checkpoint must contain -> (rule, layer index or None)."""
        out: dict[str, tuple[TensorRule, int | None]] = {}
        for rule in self.rules(config):
            if rule.per_layer:
                for i in range(config.n_layers):
                    out[rule.hf_name.format(i=i)] = (rule, i)
            else:
                out[rule.hf_name] = (rule, None)
        return out
