"""`generate(model, prompts, config)`: batched diffusion decoding with the whole loop under one jit.

Host side (this file): validate settings and prompts, lay the batch out in a fixed-size buffer
([left pad][prompt][generation]; the prompt region is rounded up to a bucket so that requests of similar length
share one compiled program), call the jitted loop, and unpack tokens and statistics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.decoding import loop
from dllm_jax.decoding.caches import affix
from dllm_jax.decoding.caches.base import DecodeInputs
from dllm_jax.decoding.config import GenerationConfig, NaiveReuse
from dllm_jax.transformer.kernels import Kernels
from dllm_jax.transformer.params import is_unrolled

if TYPE_CHECKING:
    from dllm_jax.decoding.caches.acache import SharedAffix
    from dllm_jax.decoding.caches.bicache import SharedPrefix


@dataclasses.dataclass
class GenerationOutput:
    tokens: np.ndarray  # [B, gen_length] int32
    nfe: int  # forward passes (each on the whole batch; ACache counts its probe)
    steps_per_block: np.ndarray  # [n_blocks]
    committed_per_step: np.ndarray  # [nfe] tokens committed (whole batch) at each step
    seconds: float  # wall time of the device loop (excluding compilation when already compiled)
    prompt_len: int  # bucketed prompt region length P
    shallow_depth: int | None = None  # BiCache: the layers the batch reused the prefix in
    # [B, gen_length]: the step inside its block at which each token was committed (0: the block-start step), -1 for
    # those no step decoded (filled with EOS after the row's answer ended): the order a block was written in
    commit_steps: np.ndarray | None = None

    @property
    def stats(self) -> dict:
        return {
            "nfe": self.nfe,
            "steps_per_block": self.steps_per_block.tolist(),
            "committed_per_step": self.committed_per_step.tolist(),
            "seconds": self.seconds,
        }


def _validate_prompts(prompts: Sequence[Sequence[int]], config: ModelConfig, gc: GenerationConfig) -> None:
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        arr = np.asarray(p)
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {i} must be token ids (integers), got dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() >= config.vocab_size:
            raise ValueError(
                f"prompt {i} has token ids outside [0, {config.vocab_size}): min {arr.min()}, max {arr.max()}"
            )
        gen = gc.schedule.gen_length
        if len(p) + gen > config.max_seq_len:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + gen_length {gen} = {len(p) + gen} exceeds the model's "
                f"maximum sequence length {config.max_seq_len}"
            )


def layout(
    prompts: Sequence[Sequence[int]],
    config: ModelConfig,
    gc: GenerationConfig,
    affix_spans: Sequence[tuple[int, int] | None] | None = None,
):
    """Host-side batch layout: tokens [B, T], positions, key mask, frozen mask and P (numpy)."""
    b = len(prompts)
    longest = max(len(p) for p in prompts)
    # round the prompt region up to a bucket (fewer compiled shapes), never past what the longest prompt needs
    # within the model's maximum (RoPE positions count from each row's first real token, so pads cost no range)
    gen = gc.schedule.gen_length
    P = max(longest, min(math.ceil(longest / gc.prompt_bucket) * gc.prompt_bucket, config.max_seq_len - gen))
    T = P + gen
    x = np.full((b, T), config.mask_token_id, np.int32)
    pad = np.zeros(b, np.int32)
    frozen = np.zeros((b, T), bool)
    for i, p in enumerate(prompts):
        pad[i] = P - len(p)
        x[i, : pad[i]] = config.pad_token_id
        x[i, pad[i] : P] = np.asarray(p, np.int32)
        if affix_spans is not None and affix_spans[i] is not None:
            s, e = affix_spans[i]
            if not (0 <= s <= e <= len(p)):
                raise ValueError(f"affix span {affix_spans[i]} of prompt {i} is outside its {len(p)} tokens")
            frozen[i, pad[i] + s : pad[i] + e] = True
    idx = np.arange(T)[None, :]
    key_mask = idx >= pad[:, None]
    positions = np.maximum(idx - pad[:, None], 0).astype(np.int32)
    return x, positions, key_mask, frozen, P


# XLA's Triton GEMMs off for FP8-FFN programs with the dual cache whose block steps have more than this many tokens
# (batch x block_length). There every GEMM XLA keeps (q/k/v, o_proj, the head, layer 1's FFN) runs on cuBLAS anyway,
# but with Triton GEMMs on, XLA's autotuner splits o_proj's K into fp32 partials whose separate reduction kernel
# costs more than the split saved: batch 8 on the H200, per step, LLaDA-8B 6.143 vs 6.287 ms, Dream-7B 5.448 vs
# 5.572. Limited to what was measured (the dual cache, FP8, more than 64 tokens: at a batch-1 block step XLA's
# split-K Triton GEMMs are the fast path).
NO_TRITON_GEMM_FP8_ABOVE_TOKENS: int | None = 64
NO_TRITON_GEMM = (("xla_gpu_enable_triton_gemm", False),)


def compiler_options(config: ModelConfig, gc: "GenerationConfig", batch: int) -> dict | None:
    """The XLA options the decode program of `batch` rows is compiled with (None: XLA's defaults)."""
    if gc.cache.mode != "dual":
        return None
    return dict(fp8_compiler_options(config, batch * gc.schedule.block_length)) or None


def fp8_compiler_options(config: ModelConfig, tokens: int) -> tuple:
    """The XLA options of a dual-cache program whose block steps have `tokens` tokens (the serving engine's too:
    its block calls run the dual cache)."""
    limit = NO_TRITON_GEMM_FP8_ABOVE_TOKENS
    if limit is None or jax.default_backend() != "gpu" or not config.fp8_ffn or tokens <= limit:
        return ()
    return NO_TRITON_GEMM


def _generate_impl(
    params, x, positions, key_mask, frozen, key, affix_in=None, *, config, gc, prompt_len, padded, kernels
):
    # Dream is AR-adapted: position i is predicted by output i-1 whatever sampler decodes it (a model property)
    shift = 1 if config.family == "dream" else 0
    inp = DecodeInputs(
        positions=positions,
        key_mask=key_mask,
        frozen=frozen,
        prompt_len=prompt_len,
        block_length=gc.schedule.block_length,
        shift=shift,
        kernels=kernels,
        padded=padded,
        has_frozen=isinstance(gc.cache.affix, NaiveReuse),
    )
    x_cache, extra_nfe = (
        (None, 0) if affix_in is None else affix.initial_state(params, config, inp, x, frozen, affix_in)
    )
    s = loop.run(
        params, config, gc, x, inp, key, init_cache=x_cache, depth=None if affix_in is None else affix_in.depth
    )
    return (
        s.x[:, prompt_len:],
        s.nfe + extra_nfe,
        s.steps_per_block,
        s.committed_per_step,
        s.commit_step[:, prompt_len:],
    )


@functools.lru_cache(maxsize=None)
def _generate_jit(options: tuple = ()):
    """The jitted decode program compiled with these XLA options ((name, value) pairs; () = XLA's defaults): one
    jit object, hence one compilation cache, per set of options."""
    return jax.jit(
        _generate_impl,
        static_argnames=("config", "gc", "prompt_len", "padded", "kernels"),
        compiler_options=dict(options) or None,
    )


def warn_if_slow_layer_layout(params, backend: str | None = None) -> bool:
    """Warn (once per call site) when stacked layer weights are decoded on a GPU: XLA copies each layer's weight
    slice inside the scan, ~2x slower block steps there. Returns whether it warned."""
    if (backend or jax.default_backend()) != "gpu" or is_unrolled(params["layers"]):
        return False
    warnings.warn(
        "stacked layer weights on a GPU run a lax.scan whose weight slices XLA copies (~2x slower "
        "block steps); load with dllm_jax.load(..., layer_layout='auto'|'unrolled') or convert with "
        "dllm_jax.transformer.unstack_layers(params)",
        stacklevel=3,
    )
    return True


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    seed: int = 0,
    affix_spans: Sequence[tuple[int, int] | None] | None = None,
    shared_affix: "SharedAffix | SharedPrefix | None" = None,
) -> GenerationOutput:
    """Decode a batch of prompts (token id lists). Returns generated tokens [B, gen_length] and statistics.

    affix_spans: per prompt the [start, end) of its shared affix (None: no affix), for the affix techniques.
    shared_affix: `acache.build_shared_affix(model.params, model.config, tokens)` (or, for BiCache,
    `bicache.build_shared_prefix`), built once and reused across calls: its K/V (and hidden states) are placed
    into every row instead of being recomputed (spans are found when not given)."""
    gc = config or GenerationConfig()
    mc: ModelConfig = model.config
    gc.check_model(mc)
    gc.kernels.check_device()
    _validate_prompts(prompts, mc, gc)
    affix_spans, shared, prefix_entry = affix.resolve_spans(gc, mc, prompts, affix_spans, shared_affix)
    # spans only matter to affix techniques; plain modes ignore them (callers may pass them for every mode)
    technique = gc.cache.affix
    x, positions, key_mask, frozen, P = layout(prompts, mc, gc, affix_spans if technique is not None else None)
    affix_in = None
    if technique is not None:
        affix_in = affix.affix_inputs(gc, mc, prompts, affix_spans, shared, prefix_entry, key_mask, P, x.shape[1])
        if not isinstance(technique, NaiveReuse):  # recomputed (anchors, deeper layers), never frozen
            frozen = np.zeros_like(frozen)
    padded = bool((~key_mask).any())
    kernels = Kernels.resolve(gc.kernels, mc, model.params, padded)
    warn_if_slow_layer_layout(model.params)
    t0 = time.perf_counter()
    run = _generate_jit(tuple(sorted((compiler_options(mc, gc, len(prompts)) or {}).items())))
    toks, nfe, spb, cps, commit_steps = run(
        model.params,
        jnp.asarray(x),
        jnp.asarray(positions),
        jnp.asarray(key_mask),
        jnp.asarray(frozen),
        jax.random.key(seed),
        affix_in,
        config=mc,
        gc=gc,
        prompt_len=P,
        padded=padded,
        kernels=kernels,
    )
    toks = np.asarray(jax.block_until_ready(toks))
    seconds = time.perf_counter() - t0
    nfe = int(nfe)
    return GenerationOutput(
        tokens=toks,
        nfe=nfe,
        steps_per_block=np.asarray(spb),
        committed_per_step=np.asarray(cps)[:nfe],
        seconds=seconds,
        prompt_len=P,
        shallow_depth=None if affix_in is None else affix_in.depth,
        commit_steps=np.asarray(commit_steps),
    )


def answer_tokens(tokens: np.ndarray, config: ModelConfig, gc: GenerationConfig | None = None) -> list[list[int]]:
    """Each row's generated ids up to (excluding) the first stop token."""
    stops = set((gc or GenerationConfig()).stop_token_ids(config))
    out = []
    for row in np.asarray(tokens):
        ids = []
        for t in row.tolist():
            if t in stops:
                break
            ids.append(t)
        out.append(ids)
    return out
