"""How fast does `dllm_jax.load` bring an HF checkpoint to the device? (issue 39: LLaDA-8B took 64 s on an H200;
target <= 25 s, close to the disk's and the bus's speed.)

Writes a random bf16 checkpoint in LLaDA's HF release layout (config.json, ~5 GB safetensors shards in the order HF
writes them, model.safetensors.index.json) with LLaDA-8B's shapes (or smaller: --layers, --d-model, ...), then:
- read_floor: every tensor read into numpy with safetensors (the disk / page-cache floor);
- transfer_floor: a device_put of the same bytes from host memory on the loader's IO_WORKERS threads (the bus floor);
- load: `dllm_jax.load(dir)` until every param is on the device (jax.block_until_ready), the median of --repeats
  runs after a first one (compiles, and a cold page cache: reported apart as first_load_s).
Unless --no-cold, the shards' pages are dropped from the page cache (posix_fadvise DONTNEED: no root needed; a no-op
on tmpfs) before the first load and before a cold read floor, so first_load_s and cold_read_floor_s read the disk.
--dir keeps the checkpoint (a later run with the same shapes reuses it). Writes bench/results/load_<h200|platform>.json
(rows merged by --run label).

    PYTHONPATH=. python bench/bench_load.py --run h200                                   # LLaDA-8B shapes
    PYTHONPATH=. python bench/bench_load.py --layers 2 --d-model 256 --mlp 512 --vocab 1024 --run smoke   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
from tools import common  # noqa: E402

import dllm_jax  # noqa: E402
from dllm_jax.io import checkpoint as ckpt  # noqa: E402
from dllm_jax.io.loading import DEVICE_ASSEMBLY_BYTES, IO_WORKERS, resolve_layer_layout  # noqa: E402
from dllm_jax.models import llada  # noqa: E402

MARKER = "bench_load.json"  # the shapes a --dir checkpoint was written with (reused when they match)


def bench_config(args: argparse.Namespace):
    d, heads = args.d_model, args.heads or max(1, args.d_model // 128)
    config = common.LLADA_8B.replace(
        n_layers=args.layers,
        d_model=d,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=d // heads,
        mlp_hidden=args.mlp,
    )
    if args.vocab != config.vocab_size:  # the special ids must lie in a smaller vocabulary
        ids = dict(mask_token_id=args.vocab - 1, eos_token_id=args.vocab - 2, pad_token_id=args.vocab - 2)
        config = config.replace(vocab_size=args.vocab, bos_token_id=args.vocab - 3, **ids)
    return config


def hf_order(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, PyTorch-layout shape) in the order an HF state dict saves them: embedding, layer by layer, head."""
    shapes = ckpt.expected_shapes(config)

    def rank(item):
        rule, layer = item[1]
        return layer + 1 if layer is not None else (0 if rule.path == ("embed",) else config.n_layers + 1)

    plan = sorted(ckpt.family_of(config).expand(config).items(), key=rank)  # stable: the rules' order in a layer
    return [(name, shapes[name]) for name, _ in plan]


def random_bf16_block(n: int, seed: int = 0) -> np.ndarray:
    """n random bf16 values of weight-like magnitudes (|w| in [2^-10, 2^-3)) built from bits: no float math."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)  # sign and mantissa bits
    exp = rng.integers(117, 124, n, dtype=np.uint16)
    return ((bits & 0x807F) | (exp << 7)).view(ml_dtypes.bfloat16)


def write_checkpoint(out: Path, config, shard_bytes: int) -> tuple[int, int]:
    """Write the checkpoint (safetensors written directly: header, then bytes tiled from one random block, so 16 GB
    take the disk's time, not numpy's); (bytes, tensors)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_order(config)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = 2 * int(np.prod(shape))
        if size + nbytes > shard_bytes and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    elems = sum(int(np.prod(shape)) for _, shape in tensors)
    block = random_bf16_block(min(32 << 20, elems + 1)).view(np.uint8)  # at most 64 MiB
    weight_map, total, pos = {}, 0, 0
    bar = tqdm(total=2 * elems, desc="writing checkpoint", unit="B", unit_scale=True, delay=1.0)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            nbytes = 2 * int(np.prod(shape))
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        with open(out / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            left = offset
            while left:
                pos %= len(block) - 1  # odd steps through the block: neighbouring tensors differ
                n = min(left, len(block) - pos)
                f.write(block[pos : pos + n].data)
                pos, left = pos + n + 1, left - n
                bar.update(n)
            f.flush()
            os.fsync(f.fileno())  # clean pages: posix_fadvise can drop them for the cold runs
        total += offset
    bar.close()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (out / "config.json").write_text(json.dumps(llada.hf_config(config), indent=2))
    return total, len(tensors)


def shard_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def drop_page_cache(d: Path) -> None:
    for f in shard_files(d):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_floor(d: Path) -> float:
    """Seconds to read every tensor into numpy with safetensors (one file after another)."""
    from safetensors import safe_open

    t0 = time.perf_counter()
    for f in shard_files(d):
        with safe_open(f, "np") as st:
            for name in st.keys():
                st.get_tensor(name)
    return time.perf_counter() - t0


def transfer_floor(d: Path) -> float:
    """Seconds to device_put the checkpoint's tensors from host memory (one host array per distinct shape, already
    in RAM: no disk), on as many threads as the loader keeps transfers in flight, until the last has arrived."""
    from safetensors import safe_open

    shapes = []
    for f in shard_files(d):
        with safe_open(f, "np") as st:
            shapes += [tuple(st.get_slice(n).get_shape()) for n in st.keys()]
    host = {s: random_bf16_block(int(np.prod(s)), seed=1).reshape(s) for s in set(shapes)}
    jax.block_until_ready(jax.device_put(host[shapes[0]]))  # the transfer path's own warm-up
    with ThreadPoolExecutor(IO_WORKERS) as pool:
        t0 = time.perf_counter()
        out = list(pool.map(lambda s: jax.device_put(host[s]).block_until_ready(), shapes))
        secs = time.perf_counter() - t0
    del out
    return secs


def time_load(d: Path, layer_layout: str) -> float:
    t0 = time.perf_counter()
    model = dllm_jax.load(d, layer_layout=layer_layout)
    jax.block_until_ready(model.params)
    secs = time.perf_counter() - t0
    del model
    return secs


def ensure_checkpoint(d: Path, config, shard_gb: float, clear: bool = True) -> tuple[dict, bool]:
    """A random checkpoint with `config`'s shapes in d, reused when its marker matches; (its marker's info,
    whether it was written now). clear: remove other shards first."""
    shape = dict(
        layers=config.n_layers,
        d_model=config.d_model,
        heads=config.n_heads,
        mlp=config.mlp_hidden,
        vocab=config.vocab_size,
        shard_gb=shard_gb,
    )
    marker = d / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("shape") == shape:
        return json.loads(marker.read_text()), False
    if d.exists() and clear:
        for f in shard_files(d):
            f.unlink()
    total, count = write_checkpoint(d, config, int(shard_gb * (1 << 30)))
    info = {"shape": shape, "bytes": total, "tensors": count}
    marker.write_text(json.dumps(info))
    return info, True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="where to write (or reuse) the checkpoint; default: a temporary directory")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=0, help="default: d_model / 128")
    ap.add_argument("--mlp", type=int, default=12288)
    ap.add_argument("--vocab", type=int, default=126464)
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3, help="timed loads after the first")
    ap.add_argument("--layer-layout", default="auto", choices=["auto", "stacked", "unrolled"])
    ap.add_argument("--no-cold", action="store_true", help="do not drop the shards from the page cache")
    common.output_args(ap)
    args = ap.parse_args(argv)
    config = bench_config(args)
    jax.devices()  # backend start-up is not loading
    tmp = None if args.dir else tempfile.mkdtemp(prefix="bench_load-")
    d = Path(args.dir or tmp)
    try:
        t0 = time.perf_counter()
        info, wrote = ensure_checkpoint(d, config, args.shard_gb, clear=bool(args.dir))
        write_s = time.perf_counter() - t0 if wrote else None
        nbytes, ntensors = info["bytes"], info["tensors"]
        print(f"checkpoint {d}: {nbytes / 1e9:.2f} GB, {ntensors} tensors (written in {write_s} s)", flush=True)

        cold = not args.no_cold
        if cold:
            drop_page_cache(d)
        first = time_load(d, args.layer_layout)
        print(f"first load ({'cold' if cold else 'warm'} page cache, compiles): {first:.2f} s", flush=True)
        cold_read = None
        if cold:
            drop_page_cache(d)
            cold_read = read_floor(d)
        warm_read = read_floor(d)
        transfer = transfer_floor(d)
        print(f"read floor {warm_read:.2f} s (cold {cold_read}), transfer floor {transfer:.2f} s", flush=True)
        loads = [time_load(d, args.layer_layout) for _ in range(max(1, args.repeats))]
        load_s = statistics.median(loads)
        print(f"load: {load_s:.2f} s median of {loads}", flush=True)

        def gbs(s):
            return None if not s else round(nbytes / s / 1e9, 3)

        row = {
            "model": "llada-8b" if config == common.LLADA_8B else "llada-synthetic",
            "shape": info["shape"],
            "layer_layout": resolve_layer_layout(args.layer_layout),
            "assembly": "device"
            if nbytes >= DEVICE_ASSEMBLY_BYTES
            else "host",  # io/loading.py: where the tree is built
            "bytes": nbytes,
            "tensors": ntensors,
            "write_s": write_s,
            "load_s": load_s,
            "load_runs_s": loads,
            "first_load_s": first,
            "first_load_cold": cold,
            "read_floor_s": warm_read,
            "cold_read_floor_s": cold_read,
            "transfer_floor_s": transfer,
            "io_workers": IO_WORKERS,
            "load_gb_per_s": gbs(load_s),
            "first_load_gb_per_s": gbs(first),
            "read_floor_gb_per_s": gbs(warm_read),
            "cold_read_floor_gb_per_s": gbs(cold_read),
            "transfer_floor_gb_per_s": gbs(transfer),
            "tensors_per_s": round(ntensors / load_s, 1),
        }
        dev = jax.devices()[0]
        tag = "h200" if "H200" in dev.device_kind else dev.platform
        out = common.write_results(
            f"load_{tag}.json", common.meta(what="dllm_jax.load of an HF directory"), [row], args.out, args.run
        )
        print(f"wrote {out}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
