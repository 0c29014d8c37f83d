"""`dllm-convert HF_DIR OUT_DIR`: HuggingFace-release LLaDA/Dream checkpoint -> dllm-jax (orbax) checkpoint.

Validates every tensor against config.json before converting (one error listing every problem), streams the
tensors one at a time (peak memory ~ the converted params), shows a progress bar, and writes atomically: on any
failure nothing is left at OUT_DIR.
"""

from __future__ import annotations

import argparse
import sys
import time

from dllm_jax.config import ConfigError
from dllm_jax.io import checkpoint as ckpt
from dllm_jax.io.loading import WEIGHTS
from dllm_jax.transformer.params import check_fp8_proj_shapes, check_fp8_shapes


def convert(
    hf_dir: str,
    out_dir: str,
    dtype: str = "bfloat16",
    force: bool = False,
    progress: bool = True,
    fp8_ffn: bool = False,
    weights: str = "bf16",
) -> str:
    """weights: "bf16", "fp8_ffn" (fp8_ffn=True) or "fp8_all" (`dllm_jax.load`'s), stored quantised."""
    weights = "fp8_ffn" if fp8_ffn and weights == "bf16" else weights
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}; expected one of {WEIGHTS}")
    hf = ckpt.HFCheckpoint(hf_dir)
    config = hf.model_config(dtype=dtype)
    if weights == "fp8_all":
        check_fp8_proj_shapes(config)
    elif weights == "fp8_ffn":
        check_fp8_shapes(config)
    leaves = ckpt.iter_leaves(hf, config, progress=progress)  # validated before the first leaf is read
    if weights != "bf16":  # LaCache: e4m3 FFN weights (128x128 block scales) for layers >= 2, stored in the checkpoint
        leaves = ckpt.quantize_ffn_leaves(leaves, config)
        config = config.replace(fp8_ffn=True)
    if weights == "fp8_all":  # and q/k/v, o and the head
        leaves = ckpt.quantize_projection_leaves(leaves, config)
        config = config.replace(fp8_proj=True)
    return str(ckpt.write_converted(leaves, config, out_dir, source_dir=hf_dir, force=force))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dllm-convert", description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir", help="directory with config.json and model.safetensors (or a sharded index)")
    ap.add_argument("out_dir", help="where to write the converted checkpoint (must not exist unless --force)")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="dtype of the stored params (default: bfloat16, the release dtype)",
    )
    ap.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    ap.add_argument(
        "--weights",
        choices=["bf16", "fp8_ffn", "fp8_all"],
        default="bf16",
        help="store per-group FP8 weights (e4m3, 128x128 block scales; layer 1 stays bf16): fp8_ffn the FFNs, fp8_all "
        "also the attention projections and the LM head",
    )
    ap.add_argument("--fp8-ffn", action="store_true", help="the same as --weights fp8_ffn")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = convert(
            args.hf_dir,
            args.out_dir,
            args.dtype,
            args.force,
            progress=not args.quiet,
            fp8_ffn=args.fp8_ffn,
            weights=args.weights,
        )
    except (ckpt.CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"dllm-convert: error: {e}", file=sys.stderr)
        return 2
    print(f"converted {args.hf_dir} -> {out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
