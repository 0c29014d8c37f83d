"""Shared bench helpers: the real checkpoints' shapes, random weights on the device, timing (warm-up, median),
fused forward loops, results JSON (GPU, jax version, commit, command; runs merged by label) and bar plots."""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# package imports (the only ones of tools/; re-point here when the package moves)
from dllm_jax.config import ModelConfig  # noqa: E402
from dllm_jax.decoding.caches.base import DecodeInputs  # noqa: E402
from dllm_jax.decoding.generate import layout  # noqa: E402
from dllm_jax.io.loading import Model, resolve_layer_layout  # noqa: E402
from dllm_jax.transformer.kernels import Kernels  # noqa: E402
from dllm_jax.transformer.params import (  # noqa: E402
    param_shapes,
    quantize_params,
    quantize_projections,
    unstack_layers,
)

RESULTS = Path(__file__).resolve().parents[1] / "results"
HBM_BYTES_PER_S = 4.3e12  # achievable HBM bandwidth of an H200
BF16_FLOPS_PER_S = 790e12  # achievable dense bf16 (989 peak)
FP8_FLOPS_PER_S = 1979e12  # dense e4m3 peak

LLADA_8B = ModelConfig(
    family="llada",
    vocab_size=126464,
    d_model=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=32,
    head_dim=128,
    mlp_hidden=12288,
    rms_eps=1e-5,
    rope_theta=500000.0,
    rope_fp32=True,
    qkv_bias=False,
    tie_embeddings=False,
    max_seq_len=4096,
    mask_token_id=126336,
    eos_token_id=126081,
    pad_token_id=126081,
    bos_token_id=126080,
)
DREAM_7B = ModelConfig(
    family="dream",
    vocab_size=152064,
    d_model=3584,
    n_layers=28,
    n_heads=28,
    n_kv_heads=4,
    head_dim=128,
    mlp_hidden=18944,
    rms_eps=1e-6,
    rope_theta=1e6,
    rope_fp32=False,
    qkv_bias=True,
    tie_embeddings=False,
    max_seq_len=4096,
    mask_token_id=151666,
    eos_token_id=151643,
    pad_token_id=151643,
)
# a CPU smoke-test size (same code paths)
TINY = LLADA_8B.replace(
    vocab_size=512,
    d_model=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    head_dim=32,
    mlp_hidden=256,
    mask_token_id=511,
    eos_token_id=510,
    pad_token_id=510,
    bos_token_id=509,
)
MODELS = {"llada-8b": LLADA_8B, "dream-7b": DREAM_7B, "tiny": TINY}

# On the CPU the benches run only as smoke tests (tests/test_bench_scripts.py: the GPU runs' code paths, JSON and
# plots); timings mean nothing there, so every repeat count collapses to one call. `common.SMOKE_ON_CPU` is read on
# first use (module __getattr__), not at import: importing this module starts no backend, so a bench can start
# child processes on the device first (bench_serve.py's fresh-process starts).


def smoke_on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def __getattr__(name: str):
    if name == "SMOKE_ON_CPU":
        return smoke_on_cpu()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def repeats(n: int) -> int:
    return 1 if smoke_on_cpu() else n


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random bf16 params (stacked layers) built directly on the device: speed does not depend on the values."""
    leaves, tree = jax.tree_util.tree_flatten(param_shapes(config))
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    @jax.jit
    def make(keys):
        return [
            (0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)
            if len(s.shape) > 1
            else jnp.ones(s.shape, s.dtype)
            for k, s in zip(keys, leaves)
        ]

    return jax.tree_util.tree_unflatten(tree, make(keys))


def random_model(name: str, weights: str = "bf16") -> Model:
    """A model of MODELS with random_params, per-layer arrays where that is the device's default layout; weights:
    quantised as `dllm_jax.load(weights=...)` does (on the device)."""
    cfg = MODELS[name]
    params = random_params(cfg)
    if weights != "bf16":
        params, cfg = quantize_params(params, cfg, on_device=True)
    if weights == "fp8_all":
        params, cfg = quantize_projections(params, cfg)
    return Model(cfg, unstack_layers(params) if resolve_layer_layout("auto") == "unrolled" else params)


def param_bytes(params: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def weight_count(config: ModelConfig) -> int:
    """Weights a forward multiplies by: every parameter but the embedding table (a gather), counted on the bf16
    layout (FP8 storage multiplies as many)."""
    shapes = param_shapes(config.replace(fp8_ffn=False, fp8_proj=False, fp8_first_layer=False))
    return sum(s.size for s in jax.tree_util.tree_leaves(shapes)) - shapes["embed"].size


def fp8_weight_count(config: ModelConfig) -> int:
    """Of `weight_count`, those multiplied in e4m3 under config.weights: the FFNs of layers >= 2 (fp8_ffn), and their
    q/k/v and o and the LM head (fp8_all)."""
    d, f, late = config.d_model, config.mlp_hidden, config.n_layers - 1
    wq, wk, wv = (config.n_heads * config.head_dim,) + (config.n_kv_heads * config.head_dim,) * 2
    ffn = 3 * d * f * late if config.fp8_ffn else 0
    proj = ((wq + wk + wv) * d + wq * d) * late + d * config.vocab_size if config.fp8_proj else 0
    return ffn + proj


def measure_floors(copy_bytes: int = 4 << 30, side: int = 8192, reps: int = 5) -> dict:
    """This run's floors, measured on its device: HBM bytes/s from a device-to-device pass over `copy_bytes`
    (read once, written once), and the sustained dense bf16 and e4m3 FLOP/s of square GEMMs of `side` (XLA's:
    cuBLAS(Lt) on a GPU, per-tensor FP8 with an fp32 result). The CPU smoke runs tiny sizes (its figures mean
    nothing)."""
    if smoke_on_cpu():
        copy_bytes, side = 8 << 20, 256
    buf = jnp.zeros(copy_bytes // 2, jnp.bfloat16)
    bump = jax.jit(lambda a: a + jnp.bfloat16(1))  # one read and one write of every byte
    t_copy, _ = time_call(lambda b=buf: bump(b).block_until_ready(), reps=reps)
    del buf
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (side, side), jnp.bfloat16)
    b = jax.random.normal(key_b, (side, side), jnp.bfloat16)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    t_bf16, _ = time_call(lambda: dot(a, b).block_until_ready(), reps=reps)
    a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
    dot8 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    t_e4m3, _ = time_call(lambda: dot8(a8, b8).block_until_ready(), reps=reps)
    flops = 2 * side**3
    return dict(
        hbm_bytes_per_s=2 * copy_bytes / t_copy,
        bf16_flops_per_s=flops / t_bf16,
        e4m3_flops_per_s=flops / t_e4m3,
        copy_bytes=copy_bytes,
        gemm_side=side,
    )


def decode_inputs(model, gc, prompts: list[list[int]]) -> tuple[jax.Array, DecodeInputs]:
    """generate's token buffer and fixed inputs for unpadded prompts, built as generate builds them: what a cache
    strategy's forwards take, to time them apart from the decode loop."""
    cfg = model.config
    x, pos, km, frozen, p = layout(prompts, cfg, gc)
    inp = DecodeInputs(
        jnp.asarray(pos),
        jnp.asarray(km),
        jnp.asarray(frozen),
        p,
        gc.schedule.block_length,
        1 if cfg.family == "dream" else 0,
        kernels(model, gc),
        padded=False,
    )
    return jnp.asarray(x), inp


def kernels(model, gc) -> Kernels:
    """The kernels generate resolves for an unpadded batch of this model."""
    return Kernels.resolve(gc.kernels, model.config, model.params, padded=False)


def time_call(fn: Callable[[], Any], reps: int = 5, warmup: int = 1) -> tuple[float, float]:
    """(median seconds of `reps` calls after `warmup` calls, seconds of the first call, compile included). fn must
    block until its result is ready."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(repeats(warmup) - 1):
        fn()
    times = []
    for _ in range(repeats(reps)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def fused_loop(forward: Callable, params: Any, state: Any, compiler_options: dict | None = None) -> Callable:
    """call(n): n forwards `forward(params, state) -> (logits, state)` fused in one jitted fori_loop, the state
    donated (updated in place, as in generate) and carried from call to call; blocks until done."""

    @functools.partial(jax.jit, static_argnums=2, donate_argnums=1, compiler_options=compiler_options)
    def run(params, state, n):
        def body(i, carry):
            st, acc = carry
            logits, st = forward(params, st)
            return st, acc + logits[0, 0, 0].astype(jnp.float32)

        return jax.lax.fori_loop(0, n, body, (state, jnp.float32(0)))

    box = [state]

    def call(n: int):
        st, acc = run(params, box[0], n)
        acc.block_until_ready()
        box[0] = st

    return call


def commit() -> str | None:
    """GIT_COMMIT (a device copy's .git may be stale: the caller's wins), else this checkout's HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def meta(**extra) -> dict:
    dev = jax.devices()[0]
    return {
        "gpu": dev.device_kind,
        "platform": dev.platform,
        "jax": jax.__version__,
        "date": now(),
        "git": commit(),
        "command": " ".join(["python", *sys.argv]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        **extra,
    }


def output_args(ap: argparse.ArgumentParser, out: Path = RESULTS, budget_s: float | None = None) -> None:
    """The flags the benches end with: --budget-s (where given one), --run (its rows' label) and --out."""
    if budget_s is not None:
        ap.add_argument("--budget-s", type=float, default=budget_s, help="stop starting new rows after this long")
    ap.add_argument("--run", default=default_run(), help="label of this run's rows in the results file")
    ap.add_argument("--out", default=str(out))


def default_run() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M")


def write_results(
    name: str, meta_: dict, rows: list[dict], out_dir: str | os.PathLike | None = None, run: str | None = None
) -> Path:
    """Write {"meta", "rows"} to out_dir/name (bench/results by default). With a run label the file's rows of other
    runs stay (the committed files hold every run's evidence): this run's rows, tagged run=LABEL, replace earlier
    rows of that label and meta.runs[LABEL] holds this run's meta. Called after every row, through a temporary
    file, so that a run cut short by a time limit keeps what it measured."""
    path = Path(out_dir or RESULTS) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta_, "rows": rows}
    if run is not None:
        old = json.loads(path.read_text()) if path.exists() else {"meta": {}, "rows": []}
        old["meta"].setdefault("runs", {})[run] = meta_
        kept = [r for r in old["rows"] if str(r.get("run")) != run]
        data = {**old, "rows": kept + [{**r, "run": run} for r in rows]}
    tmp = path.with_name(f".{name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def grouped_bars(
    path: Path,
    xlabels: list[str],
    series: list[tuple[str, list[float]]],
    ylabel: str,
    title: str,
    ref: tuple[float, str] | None = None,
    log: bool = False,
) -> Path:
    """One group of bars per x label, one bar per series, an optional dashed reference line; saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(xlabels) * max(1, len(series)) / 2), 4.5))
    x = np.arange(len(xlabels))
    width = 0.8 / max(1, len(series))
    for i, (label, ys) in enumerate(series):
        ax.bar(x + width * (i - (len(series) - 1) / 2), [y or 0 for y in ys], width, label=label)
    if ref:
        ax.axhline(ref[0], color="gray", ls="--", lw=1, label=ref[1])
    ax.set_xticks(x, xlabels, fontsize=7, rotation=30 if len(xlabels) > 6 else 0, ha="right")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
