"""Reading HF-layout safetensors checkpoints and writing/reading converted (orbax) ones.

Everything is validated before any large allocation: a checkpoint with missing, unexpected or misshapen tensors
fails with ONE error that lists every problem. Conversion (`iter_leaves`) streams tensor by tensor into preallocated
stacked arrays, so peak host memory is the converted params plus one tensor (LLaDA-8B: ~16 GB, fits 24 GB).
Loading (`dllm_jax.load`) takes the tensors as they lie in the files instead (`MappedShards`: memory-mapped, no
host copy) and does the rest on the device (io/loading.py).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from dllm_jax.config import ConfigError, ModelConfig
from dllm_jax.models import FAMILIES
from dllm_jax.models.base import ParamMapping
from dllm_jax.transformer import params as P

FORMAT_FILE = "dllm_jax.json"
FORMAT_VERSION = 2  # 2: one orbax item per param leaf (streamed writes)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "added_tokens.json",
)
SOURCE_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
_NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


class CheckpointError(ValueError):
    """A checkpoint that cannot be converted or loaded; the message lists every problem found."""


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint file, or a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------------------ HF safetensors in
class HFCheckpoint:
    """A directory in the HuggingFace release layout: config.json + model.safetensors or a sharded index."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"checkpoint directory {self.path} does not exist")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory")
        if not (self.path / "config.json").is_file():
            raise CheckpointError(f"{self.path} has no config.json")
        self.hf_config = read_json(self.path / "config.json")
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map'")
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
            return [self.path / n for n in names]
        single = self.path / "model.safetensors"
        if single.is_file():
            return [single]
        found = sorted(self.path.glob("*.safetensors"))
        if found:
            return found
        raise CheckpointError(
            f"{self.path} has no model.safetensors, no model.safetensors.index.json and no *.safetensors file"
        )

    def tensor_index(self) -> dict[str, tuple[Path, tuple[int, ...], str]]:
        """name -> (file, shape, safetensors dtype string), from headers only (no tensor is read)."""
        out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
        for f in self.files:
            try:
                with safe_open(f, "np") as st:
                    for name in st.keys():
                        sl = st.get_slice(name)
                        out[name] = (f, tuple(sl.get_shape()), sl.get_dtype())
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read safetensors file {f}: {e}") from e
        return out

    def model_config(self, dtype: str = "bfloat16") -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config, dtype=dtype)

    def locations(self) -> dict[str, TensorLocation]:
        """name -> where its bytes lie, from the shards' headers (no tensor is read)."""
        out: dict[str, TensorLocation] = {}
        for f in self.files:
            out.update(safetensors_locations(f))
        return out


@dataclasses.dataclass(frozen=True)
class TensorLocation:
    """One tensor's bytes in a safetensors file: [start, start + nbytes), C order, PyTorch layout."""

    file: Path
    start: int
    shape: tuple[int, ...]
    dtype: str  # safetensors' dtype string ("BF16", ...)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(SOURCE_DTYPES[self.dtype]).itemsize


def safetensors_locations(path: Path) -> dict[str, TensorLocation]:
    """Parse a safetensors header (u64 little-endian length, JSON, then the data) into absolute byte ranges, so
    tensors can be memory-mapped without a copy. Only SOURCE_DTYPES tensors are listed (`validate` reports the
    others); a range that disagrees with its shape or runs past the file is a CheckpointError."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or info.get("dtype") not in SOURCE_DTYPES:
            continue
        begin, end = info["data_offsets"]
        loc = TensorLocation(path, 8 + n + begin, tuple(info["shape"]), info["dtype"])
        if end - begin != loc.nbytes or 8 + n + end > size:
            raise CheckpointError(f"{path}: tensor {name} has data_offsets {[begin, end]} for shape {list(loc.shape)}")
        out[name] = loc
    return out


class MappedShards:
    """Zero-copy numpy views of tensors in memory-mapped safetensors files. A view keeps its file's map alive, so
    nothing is closed by hand: each map goes when the last array over it does."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._lock = threading.Lock()  # arrays are taken on a loader's worker threads

    def _map(self, file: Path) -> mmap.mmap:
        with self._lock:
            if file not in self._maps:
                # no MADV_SEQUENTIAL: it lets the kernel drop pages once read (a second load would read the disk)
                with open(file, "rb") as f:
                    self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return self._maps[file]

    def prefetch(self, loc: TensorLocation) -> None:
        """Ask the kernel to start reading the tensor's pages now (returns at once): the disk works ahead of us."""
        if hasattr(mmap, "MADV_WILLNEED") and loc.nbytes:
            start = loc.start - loc.start % mmap.PAGESIZE
            self._map(loc.file).madvise(mmap.MADV_WILLNEED, start, loc.start + loc.nbytes - start)

    def array(self, loc: TensorLocation) -> np.ndarray:
        """The tensor as a read-only numpy view of the file's pages (no bytes are copied here)."""
        count = int(np.prod(loc.shape, dtype=np.int64))
        flat = np.frombuffer(self._map(loc.file), SOURCE_DTYPES[loc.dtype], count, loc.start)
        return flat.reshape(loc.shape)


def family_of(config: ModelConfig) -> ParamMapping:
    return FAMILIES[config.family]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the PyTorch-layout shape it must have."""
    shapes = P.param_shapes(config)
    out = {}
    for name, (rule, layer) in family_of(config).expand(config).items():
        leaf = shapes
        for key in rule.path:
            leaf = leaf[key]
        shape = tuple(leaf.shape[1:] if layer is not None else leaf.shape)
        out[name] = tuple(reversed(shape)) if rule.transpose else shape
    return out


def validate(ckpt: HFCheckpoint, config: ModelConfig) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    index = ckpt.tensor_index()
    expected = expected_shapes(config)
    problems = []
    missing = sorted(set(expected) - set(index))
    unexpected = sorted(set(index) - set(expected))
    if missing:
        problems.append(
            f"{len(missing)} missing tensor(s): " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected tensor(s): "
            + ", ".join(unexpected[:20])
            + (" ..." if len(unexpected) > 20 else "")
        )
    for name in sorted(set(expected) & set(index)):
        _, shape, dtype = index[name]
        if shape != expected[name]:
            problems.append(f"{name}: shape {list(shape)}, expected {list(expected[name])}")
        if dtype not in SOURCE_DTYPES:
            problems.append(f"{name}: dtype {dtype}, expected one of {sorted(SOURCE_DTYPES)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {ckpt.path} ({config.family}) does not match its config.json:\n  - " + "\n  - ".join(problems)
        )
    return index


def iter_leaves(
    ckpt: HFCheckpoint, config: ModelConfig, progress: bool = True
) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Validate, then yield (param path, array in config.dtype) one leaf at a time.

    A stacked leaf ([n_layers, ...]) is filled layer by layer from whichever shard holds each tensor, so the
    peak is one leaf plus one tensor; a caller that writes and drops each leaf never holds the whole model."""
    index = validate(ckpt, config)
    target = _NP_DTYPES[config.dtype]
    shapes = P.param_shapes(config)
    plan = family_of(config).expand(config)
    by_leaf: dict[tuple[str, ...], list[str]] = {}
    for name, (rule, _) in plan.items():
        by_leaf.setdefault(rule.path, []).append(name)
    # delay: no bar for conversions that finish within a second (the bundled 10 MB model on every CLI call)
    bar = tqdm(total=len(plan), desc="converting", unit="tensor", disable=not progress, delay=1.0)
    handles: dict[Path, Any] = {}
    try:
        for path, names in by_leaf.items():
            leaf = shapes
            for key in path:
                leaf = leaf[key]
            out = np.empty(leaf.shape, target)
            for name in names:
                rule, layer = plan[name]
                f = index[name][0]
                if f not in handles:
                    handles[f] = safe_open(f, "np").__enter__()
                t = handles[f].get_tensor(name)
                t = t.T if rule.transpose else t
                if layer is None:
                    out[...] = t
                else:
                    out[layer] = t
                del t
                bar.update(1)
            # close the shards' memory maps after every leaf: their touched pages would otherwise stay in RSS
            for h in handles.values():
                h.__exit__(None, None, None)
            handles.clear()
            yield path, out
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
        bar.close()


def quantize_ffn_leaves(
    leaves: Iterable[tuple[tuple[str, ...], np.ndarray]], config: ModelConfig
) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Stream transform for `--fp8-ffn`: hold the three stacked FFN leaves until all have arrived, then emit the
    e4m3 layers.mlp_fp8 leaves and the bf16 mlp_first leaves instead (see transformer/params.py)."""
    P.check_fp8_shapes(config)
    held: dict[str, np.ndarray] = {}
    for path, arr in leaves:
        if path[:2] != ("layers", "mlp"):
            yield path, arr
            continue
        held[path[2]] = arr
        if len(held) == 3:
            mlp = {k: {"kernel": v} for k, v in held.items()}
            held.clear()
            stacked, first = P.quantize_stacked_mlp(mlp)
            del mlp
            for k, v in stacked.items():
                yield ("layers", "mlp_fp8", k), v
            for k, v in first.items():
                yield ("mlp_first", k, "kernel"), v["kernel"]


def quantize_projection_leaves(
    leaves: Iterable[tuple[tuple[str, ...], np.ndarray]], config: ModelConfig
) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Stream transform for weights="fp8_all" (after `quantize_ffn_leaves`): each stacked q/k/v/o kernel becomes its
    e4m3 leaves and layer 0's bf16 copy (attn_first), the head (or the tied embedding) lm_head_fp8 (see
    transformer/params.py); a bias is held until its kernel has come, then stored beside both."""
    P.check_fp8_proj_shapes(config)
    held: dict[str, dict] = {}
    for path, arr in leaves:
        if path == ("lm_head",) or (path == ("embed",) and config.tie_embeddings):
            for k, v in P.quantize_head(arr if path == ("lm_head",) else arr.T).items():  # [d, V] in
                yield ("lm_head_fp8", k), v
            if path == ("lm_head",):
                continue
        if path[:1] != ("layers",) or path[1] not in P.PROJECTIONS:
            yield path, arr
            continue
        module = held.setdefault(path[1], {})
        module[path[2]] = arr
        if "kernel" not in module or (config.qkv_bias and path[1] != "o_proj" and "bias" not in module):
            continue
        fp8, first = P.quantize_projection_module(held.pop(path[1]))
        for k, v in fp8.items():
            yield ("layers", path[1], k), v
        for k, v in first.items():
            yield ("attn_first", path[1], k), v


def read_params(ckpt: HFCheckpoint, config: ModelConfig, progress: bool = True) -> dict[str, Any]:
    """Validate, then stream every tensor into a numpy param tree in config.dtype."""
    params: dict[str, Any] = {}
    for path, arr in iter_leaves(ckpt, config, progress):
        _set(params, path, arr)
    return params


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _leaf_dir(path: tuple[str, ...]) -> str:
    return ".".join(path)


def iter_hf_tensors(params: dict[str, Any], config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """The inverse mapping: (HF name, PyTorch-layout array) for every tensor of the param tree."""
    for name, (rule, layer) in family_of(config).expand(config).items():
        leaf = params
        for key in rule.path:
            leaf = leaf[key]
            if P.is_unrolled(leaf) and layer is not None:  # unrolled layout: one tree per layer
                leaf, layer = leaf[layer], None
            if key == "layers":  # fused q/k/v, gate/up (the GPU layout): slices of the fused kernels (numpy
                leaf = P.split_projections(leaf, config)  # views; device arrays: one layer's slices at a time)
        t = np.asarray(leaf if layer is None else leaf[layer])
        yield name, np.ascontiguousarray(t.T if rule.transpose else t)


def export_hf(
    params: dict[str, Any],
    config: ModelConfig,
    out_dir: str | os.PathLike,
    max_shard_bytes: int | None = None,
    dtype: Any = ml_dtypes.bfloat16,
) -> Path:
    """Write params in the family's exact HF release layout (config.json + safetensors, sharded if asked)."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in iter_hf_tensors(params, config):
        t = t.astype(dtype)
        if max_shard_bytes and size + t.nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            for k, v in shard.items():
                weight_map[k] = fname
                total += v.nbytes
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (out / "config.json").write_text(json.dumps(family_of(config).hf_config(config), indent=2))
    return out


# ------------------------------------------------------------------------------ converted (orbax) out/in
def is_converted(path: str | os.PathLike) -> bool:
    return (Path(path) / FORMAT_FILE).is_file()


def write_converted(
    leaves: Iterable[tuple[tuple[str, ...], np.ndarray]] | dict[str, Any],
    config: ModelConfig,
    out_dir: str | os.PathLike,
    source_dir: str | os.PathLike | None = None,
    force: bool = False,
) -> Path:
    """Write a converted checkpoint: one orbax item per param leaf (params/<dotted.path>), dllm_jax.json, the HF
    config and tokenizer files. Leaves may be an iterator (written and dropped one by one: low peak memory).

    Atomic: everything goes to a temporary sibling directory that is renamed at the very end."""
    import orbax.checkpoint as ocp

    if isinstance(leaves, dict):
        leaves = _flatten(P.stack_layers(leaves, config))  # the converted format stores stacked [L, ...] leaves
    out = Path(out_dir).absolute()
    if out.exists() and any(out.iterdir()) and not force:
        raise CheckpointError(f"output directory {out} exists and is not empty (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        ckptr = ocp.StandardCheckpointer()
        names = []
        for path, arr in leaves:
            ckptr.save(tmp / "params" / _leaf_dir(path), {"value": arr})
            ckptr.wait_until_finished()  # orbax copies the array while writing: one leaf at a time
            names.append(list(path))
            del arr
        meta = {"format": FORMAT_VERSION, "model_config": config.to_dict(), "leaves": names}
        (tmp / FORMAT_FILE).write_text(json.dumps(meta, indent=2))
        if source_dir is not None:
            src = Path(source_dir)
            for name in ("config.json",) + TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp / name)
        if not (tmp / "config.json").exists():
            (tmp / "config.json").write_text(json.dumps(family_of(config).hf_config(config), indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def read_converted(path: str | os.PathLike, dtype: str | None = None) -> tuple[ModelConfig, dict[str, Any]]:
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = read_json(path / FORMAT_FILE)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: converted format {meta.get('format')!r}, this version reads {FORMAT_VERSION}")
    try:
        config = ModelConfig.from_dict(meta["model_config"])
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}/{FORMAT_FILE}: bad model_config: {e}") from e
    ckptr = ocp.StandardCheckpointer()
    params: dict[str, Any] = {}
    cast = dtype is not None and dtype != config.dtype
    for leaf in meta.get("leaves", []):
        item = path / "params" / _leaf_dir(tuple(leaf))
        if not item.exists():
            raise CheckpointError(f"{path}: missing param leaf {'/'.join(leaf)} ({item})")
        arr = ckptr.restore(item)["value"]
        fp8 = "mlp_fp8" in leaf or leaf[-1] in ("w8", "s8")  # e4m3 weights and fp32 scales keep their dtypes
        _set(params, tuple(leaf), np.asarray(arr).astype(_NP_DTYPES[dtype]) if cast and not fp8 else arr)
    if cast:
        config = config.replace(dtype=dtype)
    return config, params
