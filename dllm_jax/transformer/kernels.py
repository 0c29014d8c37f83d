"""Which kernel runs each hot path, decided once per program (`Kernels.resolve`) and carried by every forward.

The user's request (`KernelChoice`, part of `GenerationConfig`) says "auto" or names a backend; `resolve` turns it
into a concrete record from the device, the dtype, the parameter layout and whether the batch is padded. Nothing
downstream looks at the device again.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from dllm_jax.config import ModelConfig
from dllm_jax.transformer.attention import BACKENDS
from dllm_jax.transformer.params import Params, is_unrolled
from dllm_jax.transformer.sharding import mesh_of

AttentionChoice = Literal["auto", "xla", "cudnn", "pallas", "cudnn_pallas"]
RopeWriteChoice = Literal["auto", "xla", "pallas"]


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """What the user asks for. attention: "auto" = "cudnn_pallas" on a GPU for unpadded bf16 batches (cuDNN for full
    forwards, the Pallas kernel for block steps; cuDNN's masked path is not validated), else "xla". rope_write:
    "pallas" = the q/k/v projection's split-K reduction, RoPE and the K/V cache write as one kernel at block steps
    (a batch-1 LLaDA-8B step 1.023x faster on the H200); "auto" = that on a GPU in bf16 with per-layer params.
    step_loop: "auto" runs a block's steps as a loop of known trip count where the schedule fixes it (XLA's GPU
    runtime then never copies a loop predicate to the host between steps), else a while loop; "while" always the
    while loop (same tokens and NFEs). batch_invariant: a request's answer is bit-identical whatever shares its
    batch and wherever its keys sit (the engine's pool, a padded batch, solo `generate`): linear layers run
    `layers.TOKEN_TILE` tokens at a time and attention is the slot kernel at fixed tiles (`attention.attend_slots`:
    "auto" on a GPU in bf16, a GPU kernel choice, or "pallas", interpreted off the GPU) or else XLA's
    `attend_segments`; it overrides rope_write, and costs speed (bench/PERFORMANCE.md)."""

    attention: AttentionChoice = "auto"
    rope_write: RopeWriteChoice = "auto"
    step_loop: Literal["auto", "while"] = "auto"
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ("auto",) + BACKENDS:
            raise ValueError(f"attention={self.attention!r}; expected one of {('auto',) + BACKENDS}")
        if self.rope_write not in ("auto", "xla", "pallas"):
            raise ValueError(f"rope_write={self.rope_write!r}; expected auto, xla or pallas")
        if self.step_loop not in ("auto", "while"):
            raise ValueError(f"step_loop={self.step_loop!r}; expected auto or while")

    def check_device(self, platform: str | None = None) -> None:
        """Refuse, before any device work, a backend this machine cannot run."""
        platform = platform or jax.default_backend()
        if self.attention in ("cudnn", "cudnn_pallas") and platform != "gpu":
            raise ValueError(
                f"attention={self.attention!r} needs a GPU (this machine runs {platform}); use 'auto' or 'xla'"
            )


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The resolved choice (static: part of a compiled program's key)."""

    attention: str = "xla"  # transformer.attention.BACKENDS
    rope_write: bool = False  # the fused RoPE + K/V write kernel at block-step windows (per-layer caches)
    fp8: str = "xla"  # the FP8 FFN: "pallas" (GPU kernels) or "xla" (reference)
    interpret: bool = True  # Pallas kernels interpreted (off the GPU)
    batch_invariant: bool = False  # token-tiled linear layers (attention is then "invariant" or "invariant_slot")

    @classmethod
    def resolve(cls, choice: KernelChoice, config: ModelConfig, params: Params, padded: bool = False) -> "Kernels":
        gpu = jax.default_backend() == "gpu"
        attention = choice.attention
        if choice.batch_invariant:  # its own attention and linear layers, every other kernel as usual
            single = mesh_of(params) is None  # tensor parallel: XLA's ops only
            # the slot kernel where asked for, and by default on a GPU in bf16 (its dots would run fp32 as TF32)
            named = attention in ("pallas", "cudnn_pallas", "cudnn", "invariant_slot")
            slot = single and (named or (attention == "auto" and gpu and config.dtype == "bfloat16"))
            fp8 = "pallas" if gpu and single else "xla"
            return cls("invariant_slot" if slot else "invariant", False, fp8, not gpu, True)
        if mesh_of(params) is not None:  # tensor parallel: XLA partitions its own ops, not the Pallas/cuDNN calls
            if attention not in ("auto", "xla") or choice.rope_write == "pallas":
                raise ValueError(f"attention={attention!r}: tensor-parallel params run XLA's kernels (attention='xla')")
            return cls("xla", False, "xla", not gpu)
        if attention == "auto":
            attention = "cudnn_pallas" if gpu and config.dtype == "bfloat16" and not padded else "xla"
        unrolled = is_unrolled(params["layers"])
        if choice.rope_write == "pallas" and not unrolled:
            raise ValueError(
                "rope_write='pallas' needs per-layer params: load with layer_layout='unrolled' or "
                "convert with dllm_jax.transformer.params.unstack_layers"
            )
        rope_write = choice.rope_write == "pallas" or (
            choice.rope_write == "auto" and gpu and config.dtype == "bfloat16" and unrolled
        )
        return cls(attention, rope_write, "pallas" if gpu else "xla", not gpu)


XLA = Kernels()  # plain XLA everywhere: the reference the others are tested against
