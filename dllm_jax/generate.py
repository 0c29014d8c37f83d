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
from typing import TYPE_CHECKING, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import decode_loop
from dllm_jax.caches import STRATEGIES, affix
from dllm_jax.caches.base import DecodeInputs
from dllm_jax.config import ModelConfig
from dllm_jax.modeling import is_unrolled

if TYPE_CHECKING:
    from dllm_jax.caches.acache import SharedAffix
    from dllm_jax.caches.bicache import SharedPrefix

CacheMode = Literal["none", "first_layer", "prefix", "dual"]


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings (static: a new value compiles a new program; the same value never recompiles).

    steps: total denoising steps over the generation region (fixed schedule; each block gets steps / n_blocks).
    threshold / factor: Fast-dLLM parallel decoding (then steps only bounds nothing: a block takes as many
    steps as it needs, at most block_length).
    """

    gen_length: int = 128
    block_length: int = 32
    steps: int = 128
    temperature: float = 0.0
    sampler: Literal["llada", "dream"] | None = None  # None: the model family's own
    remasking: Literal["low_confidence", "random"] = "low_confidence"  # LLaDA
    threshold: float | None = None
    factor: float | None = None
    cfg_scale: float = 0.0  # LLaDA classifier-free guidance (cache "none" only)
    alg: Literal["origin", "maskgit_plus", "topk_margin", "entropy"] = "maskgit_plus"  # Dream
    alg_temp: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    eps: float = 1e-3
    cache: CacheMode = "none"
    refresh: Literal["block", "step"] = "block"  # "step": refresh the cache at every step (exact; for testing)
    # Shared-affix reuse (generate's affix_spans mark each prompt's affix). "naive": the affix's K/V computed from
    # the affix alone once, never refreshed. "anchors": ACache (caches/acache.py): the same shared K/V, except
    # for the anchor_ratio share of affix tokens that a one-shot probe (one NFE) finds most attended by the
    # generation region's [MASK] queries; those and the request's own tokens are recomputed at every block start.
    # "shallow": BiCache (caches/bicache.py): the shared part's K/V (a prefix in the paper; any span works) reused
    # in layers < shallow_depth, recomputed with the request in the deeper layers at every block start
    affix: Literal["none", "naive", "anchors", "shallow"] = "none"
    anchor_ratio: float = 0.2  # "anchors": K = min(ceil(ratio * affix_len), affix_len); 0 = naive, 1 = plain cache
    # "shallow": the reuse depth; None: the paper's table for LLaDA-8B / Dream-7B by the prefix's share of the
    # sequence (a batch runs at its rows' shallowest); 0 = plain cache, n_layers = naive
    shallow_depth: int | None = None
    # "shallow" without a depth: a depth table ((r, depth), ...) as bicache.depth_table_from_profile returns (its
    # items), for models without a published one
    shallow_table: tuple[tuple[int, int], ...] | None = None
    stop_at_eos: bool = True
    extra_stop_ids: tuple[int, ...] = ()
    prompt_bucket: int = 32
    # auto: on a GPU for unpadded bf16 batches "cudnn_pallas" (cuDNN for full forwards, the Pallas kernel for block
    # steps), else XLA
    attention_backend: Literal["auto", "xla", "cudnn", "pallas", "cudnn_pallas"] = "auto"
    # "pallas": FFN GEMMs of short windows (batch x window <= 64 tokens: block steps at batch 1-2) with the
    # weight-streaming kernel. Off by default until it is measured faster inside the model (bench/NOTES.md).
    ffn_backend: Literal["xla", "pallas", "mgpu"] = "xla"  # "mgpu": the Mosaic GPU kernel (bf16; slower, NOTES v3)
    # "pallas": residual add + RMSNorm and RoPE + K/V cache write as one kernel each (dllm_jax/fused_layers.py;
    # needs per-layer params, the GPU layout). Opt-in: on the H200 it was no faster (block steps within 0.5%,
    # block starts 1% slower: XLA already fuses each add into its split-K GEMM's reduction; bench/NOTES.md v12)
    # "pallas_rope": only RoPE + the K/V write as one kernel, fed at block steps by the q/k/v GEMM's split-K partials
    # (one kernel instead of three per layer; LLaDA-8B batch-1 block step 3.0% faster, bench/NOTES.md v14). "auto":
    # that on a GPU in bf16 with per-layer params and cache, XLA's ops everywhere else (CPU, fp32, stacked layers)
    norm_rope_backend: Literal["auto", "xla", "pallas", "pallas_rope"] = "auto"
    # "auto": where every block provably takes exactly steps / n_blocks steps (a fixed schedule whose every step
    # commits at least one token; `decode_loop.fixed_step_count`), the in-block steps run as a loop of known trip
    # count, which XLA's GPU runtime runs without copying a loop predicate to the host and waiting for it at every
    # step; elsewhere (threshold / factor, Dream's random "origin" reveals, blocks shorter than their step count) a
    # while loop that stops when the block is done. "while": always the while loop (same tokens and NFEs; the
    # benchmarks' twin). On the H200 both run at the same speed (bench/NOTES.md v16 item 7); "auto" keeps the host
    # off the step-to-step path where the schedule allows it
    step_loop: Literal["auto", "while"] = "auto"

    def __post_init__(self) -> None:
        # a list would make the (static, hashed) config unhashable
        object.__setattr__(self, "extra_stop_ids", tuple(int(i) for i in self.extra_stop_ids))
        if self.shallow_table is not None:  # a dict or list of pairs -> sorted pairs (hashable)
            items = self.shallow_table.items() if isinstance(self.shallow_table, dict) else self.shallow_table
            object.__setattr__(self, "shallow_table", tuple(sorted((int(r), int(b)) for r, b in items)))

    def resolved_sampler(self, config: ModelConfig) -> str:
        return self.sampler or config.family

    def stop_token_ids(self, config: ModelConfig) -> tuple[int, ...]:
        return (config.eos_token_id,) + tuple(self.extra_stop_ids)

    @property
    def n_blocks(self) -> int:
        return self.gen_length // self.block_length

    def validate(self, config: ModelConfig | None = None) -> None:
        def bad(msg):
            raise ValueError(f"GenerationConfig: {msg}")

        if self.gen_length <= 0 or self.block_length <= 0:
            bad(f"gen_length={self.gen_length} and block_length={self.block_length} must be positive")
        if self.gen_length % self.block_length:
            bad(f"gen_length={self.gen_length} is not a multiple of block_length={self.block_length}")
        parallel = self.threshold is not None or self.factor is not None
        if not parallel:
            if self.steps <= 0 or self.steps % self.n_blocks:
                bad(f"steps={self.steps} must be a positive multiple of the number of blocks "
                    f"({self.gen_length} / {self.block_length} = {self.n_blocks})")
            if self.steps > self.gen_length:
                bad(f"steps={self.steps} exceeds gen_length={self.gen_length} (at most one step per token)")
        if self.threshold is not None and not (0.0 < self.threshold <= 1.0):
            bad(f"threshold={self.threshold} must be in (0, 1]")
        if self.factor is not None and self.factor <= 0:
            bad(f"factor={self.factor} must be positive")
        if self.threshold is not None and self.factor is not None:
            bad("set threshold or factor, not both")
        if self.temperature < 0:
            bad(f"temperature={self.temperature} must be >= 0")
        if self.cache not in STRATEGIES:
            bad(f"cache={self.cache!r}; expected one of {sorted(STRATEGIES)}")
        if self.cfg_scale > 0 and self.cache != "none":
            bad(f"cfg_scale={self.cfg_scale} needs cache='none' (guidance reruns the prompt unconditionally)")
        if self.affix not in ("none", "naive", "anchors", "shallow"):
            bad(f"affix={self.affix!r}; expected none, naive, anchors or shallow")
        if self.shallow_table is not None and (not self.shallow_table or self.shallow_table[0][0] != 0 or any(
                not 0 <= b <= (config.n_layers if config is not None else b) for _, b in self.shallow_table)):
            bad(f"shallow_table={self.shallow_table} needs an entry for r = 0 and depths within the model's layers")
        if self.shallow_depth is not None and not (
                0 <= self.shallow_depth <= (config.n_layers if config is not None else self.shallow_depth)):
            bad(f"shallow_depth={self.shallow_depth} must be in [0, {config.n_layers if config else 'n_layers'}]")
        if self.affix != "none" and self.cache not in ("prefix", "dual"):
            bad(f"affix={self.affix!r} reuses cached K/V: it needs cache='prefix' or 'dual'")
        if not (0.0 <= self.anchor_ratio <= 1.0):
            bad(f"anchor_ratio={self.anchor_ratio} must be in [0, 1]")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            bad(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k <= 0:
            bad(f"top_k={self.top_k} must be positive")
        if self.alg not in ("origin", "maskgit_plus", "topk_margin", "entropy"):
            bad(f"alg={self.alg!r}; expected origin, maskgit_plus, topk_margin or entropy")
        if self.remasking not in ("low_confidence", "random"):
            bad(f"remasking={self.remasking!r}; expected low_confidence or random")
        if not (0.0 < self.eps < 1.0):
            bad(f"eps={self.eps} must be in (0, 1)")
        if self.attention_backend not in ("auto", "xla", "cudnn", "pallas", "cudnn_pallas"):
            bad(f"attention_backend={self.attention_backend!r}; expected auto, xla, cudnn, pallas or cudnn_pallas")
        if self.ffn_backend not in ("xla", "pallas", "mgpu"):
            bad(f"ffn_backend={self.ffn_backend!r}; expected xla, pallas or mgpu")
        if self.norm_rope_backend not in ("auto", "xla", "pallas", "pallas_rope"):
            bad(f"norm_rope_backend={self.norm_rope_backend!r}; expected auto, xla, pallas or pallas_rope")
        if (config is not None and config.family == "dream" and STRATEGIES[self.cache].window_steps and not parallel
                and self.refresh == "block" and self.steps // self.n_blocks < 2):
            bad(f"Dream with a cache commits only the block's first token at the block start: it needs >= 2 steps "
                f"per block, got steps={self.steps} for {self.n_blocks} blocks")
        if self.step_loop not in ("auto", "while"):
            bad(f"step_loop={self.step_loop!r}; expected auto or while")
        if self.prompt_bucket <= 0:
            bad(f"prompt_bucket={self.prompt_bucket} must be positive")
        if config is not None and self.sampler not in (None, "llada", "dream"):
            bad(f"sampler={self.sampler!r}")


@dataclasses.dataclass
class GenerationOutput:
    tokens: np.ndarray  # [B, gen_length] int32
    nfe: int  # forward passes (each on the whole batch; affix="anchors" counts its probe)
    steps_per_block: np.ndarray  # [n_blocks]
    committed_per_step: np.ndarray  # [nfe] tokens committed (whole batch) at each step
    seconds: float  # wall time of the device loop (excluding compilation when already compiled)
    prompt_len: int  # bucketed prompt region length P
    shallow_depth: int | None = None  # affix="shallow": the layers the batch reused the prefix in

    @property
    def stats(self) -> dict:
        return {"nfe": self.nfe, "steps_per_block": self.steps_per_block.tolist(),
                "committed_per_step": self.committed_per_step.tolist(), "seconds": self.seconds}


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
            raise ValueError(f"prompt {i} has token ids outside [0, {config.vocab_size}): "
                             f"min {arr.min()}, max {arr.max()}")
        if len(p) + gc.gen_length > config.max_seq_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens + gen_length {gc.gen_length} = {len(p) + gc.gen_length} "
                             f"exceeds the model's maximum sequence length {config.max_seq_len}")


def layout(prompts: Sequence[Sequence[int]], config: ModelConfig, gc: GenerationConfig,
           affix_spans: Sequence[tuple[int, int] | None] | None = None):
    """Host-side batch layout: tokens [B, T], positions, key mask, frozen mask and P (numpy)."""
    b = len(prompts)
    longest = max(len(p) for p in prompts)
    # round the prompt region up to a bucket (fewer compiled shapes), never past what the longest prompt needs
    # within the model's maximum (RoPE positions count from each row's first real token, so pads cost no range)
    P = max(longest, min(math.ceil(longest / gc.prompt_bucket) * gc.prompt_bucket,
                         config.max_seq_len - gc.gen_length))
    T = P + gc.gen_length
    x = np.full((b, T), config.mask_token_id, np.int32)
    pad = np.zeros(b, np.int32)
    frozen = np.zeros((b, T), bool)
    for i, p in enumerate(prompts):
        pad[i] = P - len(p)
        x[i, : pad[i]] = config.pad_token_id
        x[i, pad[i]:P] = np.asarray(p, np.int32)
        if affix_spans is not None and affix_spans[i] is not None:
            s, e = affix_spans[i]
            if not (0 <= s <= e <= len(p)):
                raise ValueError(f"affix span {affix_spans[i]} of prompt {i} is outside its {len(p)} tokens")
            frozen[i, pad[i] + s: pad[i] + e] = True
    idx = np.arange(T)[None, :]
    key_mask = idx >= pad[:, None]
    positions = np.maximum(idx - pad[:, None], 0).astype(np.int32)
    return x, positions, key_mask, frozen, P


def resolve_backend(gc: GenerationConfig, config: ModelConfig, padded: bool) -> str:
    """auto: on a GPU for unpadded bf16 batches (cuDNN's masked path is not validated yet), cuDNN for full
    forwards and the Pallas kernel for block steps (`attention.attend`'s "cudnn_pallas"); else XLA. (The affix
    caches' one masked forward, the affix alone, runs XLA's attention whatever this says.)"""
    if gc.attention_backend != "auto":
        return gc.attention_backend
    gpu = jax.default_backend() == "gpu"
    return "cudnn_pallas" if gpu and config.dtype == "bfloat16" and not padded else "xla"


# XLA's Triton GEMMs off for FP8-FFN programs with the dual cache whose block steps have more than this many tokens
# (batch x block_length). There every GEMM XLA keeps (q/k/v, o_proj, the head, layer 1's FFN) runs on cuBLAS anyway,
# but with Triton GEMMs on, XLA's autotuner splits o_proj's K into fp32 partials (its GEMM alone was faster) whose
# separate reduction kernel costs more than the split saved. Measured on the H200 (bench/NOTES.md v15, batch 8, per
# step in a loop): LLaDA-8B 6.143 vs 6.287 ms and 6.203 vs 6.314 in two runs, Dream-7B 5.448 vs 5.572; the block
# starts of the same program within 0.4% (71.53 vs 71.25 ms), end to end 1.003x. Limited to what was measured: the
# dual cache (prefix / none forwards are a whole window: not timed this way), FP8 (bf16 with Triton GEMMs off: one
# call-of-8 comparison so far, 1.016x, v15h), and more than 64 tokens (at a batch-1 block step XLA's split-K
# Triton GEMMs are the fast path, v14; batches 3-7 at block 32 follow the rule untimed). None: never.
NO_TRITON_GEMM_FP8_ABOVE_TOKENS: int | None = 64
NO_TRITON_GEMM = (("xla_gpu_enable_triton_gemm", False),)


def compiler_options(config: ModelConfig, gc: "GenerationConfig", batch: int) -> dict | None:
    """The XLA options the decode program of `batch` rows is compiled with (None: XLA's defaults)."""
    limit = NO_TRITON_GEMM_FP8_ABOVE_TOKENS
    if (limit is None or jax.default_backend() != "gpu" or not config.fp8_ffn or gc.cache != "dual"
            or batch * gc.block_length <= limit):
        return None
    return dict(NO_TRITON_GEMM)


def _generate_impl(params, x, positions, key_mask, frozen, key, affix_in=None, *, config, gc, prompt_len, padded):
    # Dream is AR-adapted: position i is predicted by output i-1 whatever sampler decodes it (a model property)
    shift = 1 if config.family == "dream" else 0
    inp = DecodeInputs(positions=positions, key_mask=key_mask, frozen=frozen, prompt_len=prompt_len,
                       block_length=gc.block_length, shift=shift, backend=resolve_backend(gc, config, padded),
                       padded=padded, has_frozen=gc.affix == "naive", ffn_backend=gc.ffn_backend,
                       norm_rope_backend=gc.norm_rope_backend)
    x_cache, extra_nfe = (None, 0) if affix_in is None else affix.initial_state(params, config, inp, x, frozen,
                                                                                 affix_in)
    s = decode_loop.run(params, config, gc, x, inp, key, init_cache=x_cache,
                        depth=None if affix_in is None else affix_in.depth)
    return s.x[:, prompt_len:], s.nfe + extra_nfe, s.steps_per_block, s.committed_per_step


@functools.lru_cache(maxsize=None)
def _generate_jit(options: tuple = ()):
    """The jitted decode program compiled with these XLA options ((name, value) pairs; () = XLA's defaults): one
    jit object, hence one compilation cache, per set of options."""
    return jax.jit(_generate_impl, static_argnames=("config", "gc", "prompt_len", "padded"),
                   compiler_options=dict(options) or None)


def warn_if_slow_layer_layout(params, backend: str | None = None) -> bool:
    """Warn (once per call site) when stacked layer weights are decoded on a GPU: XLA copies each layer's weight
    slice inside the scan, ~2x slower block steps there (bench/NOTES.md, issue 7). Returns whether it warned."""
    if (backend or jax.default_backend()) != "gpu" or is_unrolled(params["layers"]):
        return False
    warnings.warn("stacked layer weights on a GPU run a lax.scan whose weight slices XLA copies (~2x slower "
                  "block steps); load with dllm_jax.load(..., layer_layout='auto'|'unrolled') or convert with "
                  "dllm_jax.modeling.unstack_layers(params)", stacklevel=3)
    return True


def generate(model, prompts: Sequence[Sequence[int]], config: GenerationConfig | None = None, seed: int = 0,
             affix_spans: Sequence[tuple[int, int] | None] | None = None,
             shared_affix: "SharedAffix | SharedPrefix | None" = None) -> GenerationOutput:
    """Decode a batch of prompts (token id lists). Returns generated tokens [B, gen_length] and statistics.

    affix_spans: per prompt the [start, end) of its shared affix (None: no affix), for the affix techniques.
    shared_affix: `acache.build_shared_affix(model.params, model.config, tokens)` (or, for affix="shallow",
    `bicache.build_shared_prefix`), built once and reused across calls: its K/V (and hidden states) are placed
    into every row instead of being recomputed (spans are found when not given)."""
    gc = config or GenerationConfig()
    mc: ModelConfig = model.config
    gc.validate(mc)
    _validate_prompts(prompts, mc, gc)
    affix_spans, shared, prefix_entry = affix.resolve_spans(gc, mc, prompts, affix_spans, shared_affix)
    # spans only matter to affix techniques; plain modes ignore them (callers may pass them for every mode)
    x, positions, key_mask, frozen, P = layout(prompts, mc, gc, affix_spans if gc.affix != "none" else None)
    affix_in = None
    if gc.affix != "none":
        affix_in = affix.affix_inputs(gc, mc, prompts, affix_spans, shared, prefix_entry, key_mask, P, x.shape[1])
        if gc.affix != "naive":  # recomputed (anchors, deeper layers), never frozen
            frozen = np.zeros_like(frozen)
    if gc.norm_rope_backend in ("pallas", "pallas_rope") and not is_unrolled(model.params["layers"]):
        raise ValueError(f"norm_rope_backend={gc.norm_rope_backend!r} needs per-layer params: load with "
                         "dllm_jax.load(..., layer_layout='unrolled') or convert with "
                         "dllm_jax.modeling.unstack_layers(params)")
    warn_if_slow_layer_layout(model.params)
    t0 = time.perf_counter()
    run = _generate_jit(tuple(sorted((compiler_options(mc, gc, len(prompts)) or {}).items())))
    toks, nfe, spb, cps = run(model.params, jnp.asarray(x), jnp.asarray(positions), jnp.asarray(key_mask),
                              jnp.asarray(frozen), jax.random.key(seed), affix_in, config=mc, gc=gc, prompt_len=P,
                              padded=bool((~key_mask).any()))
    toks = np.asarray(jax.block_until_ready(toks))
    seconds = time.perf_counter() - t0
    nfe = int(nfe)
    return GenerationOutput(tokens=toks, nfe=nfe, steps_per_block=np.asarray(spb),
                            committed_per_step=np.asarray(cps)[:nfe], seconds=seconds, prompt_len=P,
                            shallow_depth=None if affix_in is None else affix_in.depth)


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
