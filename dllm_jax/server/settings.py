"""The server's defaults of the request fields (no web framework here: the CLI reads them to build its flags)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from dllm_jax.decoding.config import Schedule

FALLBACK_TOKENS = 32  # max_tokens when neither the server nor the model's generation_config.json sets one
ADMISSION_WAIT = 0.1  # the fraction of a block call the next one may be held for arrivals (service.EngineService)


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """Server-side defaults of the request fields (see protocol.py); `dllm-jax serve`'s flags default to these.
    None (max_tokens, block_length, steps_per_token): from the model's generation_config.json, see `resolve`."""

    model_name: str
    api_key: str | None = None
    max_tokens: int | None = None
    block_length: int | None = None
    steps_per_token: float | None = None
    temperature: float = 0.0
    affix_technique: str = "none"
    anchor_ratio: float | str = 0.2  # or "auto" (calibrated per affix)
    shallow_depth: int | str | None = None  # or "auto" (calibrated per affix among the served depths)
    request_timeout: float | None = 600.0  # seconds; a request's own timeout field wins
    body_timeout: float = 30.0  # seconds a request body may take to arrive (408 after)

    def resolve(self, generation: dict, block_lengths: Sequence[int]) -> "ServeSettings":
        """Every default concrete, once: generation is the model's generation_config.json values
        (`io.loading.generation_defaults`), block_lengths the engine's served ones (the block length:
        `Schedule.served_block_length`)."""
        gen_length, steps = generation.get("gen_length"), generation.get("steps")
        block = self.block_length
        if block is None:
            block = Schedule.served_block_length(generation, block_lengths)
        return dataclasses.replace(
            self,
            max_tokens=self.max_tokens or gen_length or FALLBACK_TOKENS,
            block_length=block,
            steps_per_token=self.steps_per_token or (steps / gen_length if steps and gen_length else 1.0),
        )
