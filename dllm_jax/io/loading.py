"""`load(path)`: a converted directory or an HF release directory -> Model (config, params, tokenizer)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from dllm_jax.config import ModelConfig
from dllm_jax.io import checkpoint as ckpt
from dllm_jax.io.tokenizer import Tokenizer, has_tokenizer, load_tokenizer
from dllm_jax.transformer import params as P
from dllm_jax.transformer.sharding import AXIS, check_tensor_parallel, param_specs, tensor_parallel_mesh

DEFAULT_MODEL_DIR = Path(__file__).parent.parent / "assets" / "default_model"


def generation_defaults(path: Path | None) -> dict:
    """gen_length / block_length / steps defaults from a model's generation_config.json (HF's file; we read
    max_new_tokens, block_length and steps): a model trained on short answers (the bundled demo model answers in 8
    tokens) says so there. {} when there is none; CheckpointError when it is not valid JSON."""
    f = path / "generation_config.json" if path else None
    if f is None or not f.is_file():
        return {}
    cfg = ckpt.read_json(f)
    out = {}
    for ours, theirs in (("gen_length", "max_new_tokens"), ("block_length", "block_length"), ("steps", "steps")):
        if isinstance(cfg.get(theirs), int) and cfg[theirs] > 0:
            out[ours] = cfg[theirs]
    return out


@dataclasses.dataclass
class Model:
    config: ModelConfig
    params: dict[str, Any]  # device arrays in config.dtype
    tokenizer: Tokenizer | None = None
    path: Path | None = None

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model at {self.path} has no tokenizer files; pass token ids instead")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt)


def _check_shapes(config: ModelConfig, params: dict[str, Any], where: Path) -> None:
    want = P.param_shapes(config)
    bad = []

    def walk(w, g, path):
        if isinstance(w, dict):
            if not isinstance(g, dict) or set(w) != set(g):
                bad.append(
                    f"{path or '/'}: keys {sorted(g) if isinstance(g, dict) else type(g).__name__}, "
                    f"expected {sorted(w)}"
                )
                return
            for k in w:
                walk(w[k], g[k], f"{path}/{k}")
        elif tuple(np.shape(g)) != tuple(w.shape):
            bad.append(f"{path}: shape {list(np.shape(g))}, expected {list(w.shape)}")

    walk(want, params, "")
    if bad:
        raise ckpt.CheckpointError(f"params at {where} do not match their config:\n  - " + "\n  - ".join(bad))


# ------------------------------------------------------------------------------------- tensors -> device
# Why this path: the host used to transpose every [out, in] weight in numpy (~0.25 GB/s for bf16: LLaDA-8B took
# 64 s on an H200 host), then copy the stacked tree again to fuse and split it, then transfer it. Now each tensor
# goes to the device exactly as it lies in the file (a memory-mapped view: no host copy; a thread pool keeps
# several transfers in flight while the kernel reads ahead), and everything else runs there, a layer at a time, in
# one jitted program for every layer (transposes, casts, FP8 quantisation, fusing or writing into the stacked
# leaves) and one for the other leaves: compiled once a load, whatever the number of tensors.
IO_WORKERS = 8  # transfers in flight (each blocks its thread, not the caller, until its bytes are on the device)
IO_WINDOW_BYTES = 2 << 30  # read-ahead: bytes fetched beyond the tensor being placed (host pages, device buffers)
# below this many bytes numpy assembles the tree on the host (milliseconds for the bundled 10 MB model) rather
# than compiling the device programs (~0.5 s: every CLI call, every test's tiny checkpoint)
DEVICE_ASSEMBLY_BYTES = 64 << 20
GLOBAL = -1  # Piece.group of the leaves outside "layers" (embedding, final norm, head, FP8's bf16 first FFN)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One array to bring to the device: where it goes (its group's tree: GLOBAL or a layer index, and the path
    in it) and how it is read (a host array: a view of a mapped file or of a restored leaf)."""

    group: int
    path: tuple[str, ...]
    shape: tuple[int, ...]  # as read; the leaf's shape reversed when transpose (a PyTorch [out, in] weight)
    dtype: np.dtype
    transpose: bool
    read: Callable[[], np.ndarray]
    prefetch: Callable[[], None] | None = None  # a read-ahead hint, given when the piece is queued

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def hf_pieces(hf: ckpt.HFCheckpoint, config: ModelConfig) -> list[Piece]:
    """Validate (one error listing every problem), then every tensor of an HF checkpoint as a Piece, group by
    group (the non-layer leaves, then layer 0, 1, ...) and in file order within a group (sequential reads)."""
    ckpt.validate(hf, config)
    where = hf.locations()
    shards = ckpt.MappedShards()
    keyed = []
    for name, (rule, layer) in ckpt.family_of(config).expand(config).items():
        loc = where[name]
        group, path = (GLOBAL, rule.path) if layer is None else (layer, rule.path[1:])  # rule.path[0]: "layers"
        dtype = np.dtype(ckpt.SOURCE_DTYPES[loc.dtype])
        read, prefetch = functools.partial(shards.array, loc), functools.partial(shards.prefetch, loc)
        keyed.append(
            ((group, str(loc.file), loc.start), Piece(group, path, loc.shape, dtype, rule.transpose, read, prefetch))
        )
    return [p for _, p in sorted(keyed, key=lambda kp: kp[0])]


def host_pieces(params: dict[str, Any]) -> list[Piece]:
    """A host param tree in the stacked layout (a converted checkpoint) as Pieces: each layer's slice of every
    stacked leaf (a contiguous view), then the other leaves."""
    pieces = []
    for path, leaf in ckpt._flatten(params):
        if path[0] == "layers":
            for i in range(leaf.shape[0]):
                view = functools.partial(_index, leaf, i)
                pieces.append(Piece(i, path[1:], tuple(leaf.shape[1:]), np.dtype(leaf.dtype), False, view))
        else:
            pieces.append(Piece(GLOBAL, path, tuple(leaf.shape), np.dtype(leaf.dtype), False, lambda a=leaf: a))
    return sorted(pieces, key=lambda p: p.group)  # stable: leaf order within a group


def _index(a: np.ndarray, i: int) -> np.ndarray:
    return np.asarray(a[i])


T = TypeVar("T")
R = TypeVar("R")


def prefetched(
    items: Iterable[T],
    fetch: Callable[[T], R],
    size: Callable[[T], int],
    workers: int = IO_WORKERS,
    window_bytes: int = IO_WINDOW_BYTES,
    on_submit: Callable[[T], None] | None = None,
) -> Iterator[tuple[T, R]]:
    """(item, fetch(item)) in the items' order, fetched on `workers` threads up to `window_bytes` ahead (always at
    least one item). on_submit(item) runs in the caller's thread when an item is queued (a read-ahead hint)."""
    items = iter(items)
    pending: collections.deque = collections.deque()
    ahead = 0
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dllm-load") as pool:
        try:
            while True:
                for item in items:
                    if on_submit is not None:
                        on_submit(item)
                    pending.append((item, pool.submit(fetch, item)))
                    ahead += size(item)
                    if ahead >= window_bytes or len(pending) >= 4 * max(1, workers):
                        break
                if not pending:
                    return
                item, future = pending.popleft()
                ahead -= size(item)
                yield item, future.result()
        finally:
            for _, future in pending:
                future.cancel()


def _constrain(tree: Any, mesh: Mesh | None) -> Any:
    """Each leaf in its tensor-parallel split (`param_specs`, from the leaf's names and shape)."""
    if mesh is None or tree is None:
        return tree
    specs = param_specs(tree, mesh.shape[AXIS])
    return jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s)), tree, specs)


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """How a group's arrays as read become its leaves (hashable: a static argument of the programs below)."""

    dtype: Any  # every leaf's dtype but the FP8 ones'
    transposed: frozenset  # paths of the PyTorch [out, in] weights
    unrolled: bool = False  # the GPU layout's extras: the FP8 kernel's scale tables, fused projections where fuse
    fuse: bool = False
    quantize: bool = False  # the bf16 FFN -> mlp_fp8 (`params.quantize_layer_mlp`, the quantiser of the host path)
    keep_mlp: bool = False  # also return the bf16 FFN (layer 0's is mlp_first)


def _leaves(raw: dict[str, Any], recipe: _Recipe, host: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A group's leaves from its arrays as read: traced inside the device programs, or numpy (host=True)."""

    def shape(path, a):
        names = tuple(str(getattr(k, "key", k)) for k in path)
        a = a.T if names in recipe.transposed else a
        dtype = a.dtype if "mlp_fp8" in names or names[-1] in ("w8", "s8") else recipe.dtype
        # always a copy: a leaf never aliases the array as read (a mapped file, which the CPU backend may keep)
        return np.array(a, dtype, order="C") if host else jnp.array(a, dtype, copy=True)

    tree = jax.tree_util.tree_map_with_path(shape, raw)
    mlp = None
    if recipe.quantize:
        mlp = tree.pop("mlp")
        tree["mlp_fp8"] = jax.tree.map(np.asarray, _quantize_layer(mlp)) if host else P.quantize_layer_mlp(mlp)
    if recipe.fuse:
        tree = P.fuse_projections(tree)
    if recipe.unrolled and "mlp_fp8" in tree:
        tree["mlp_fp8"] = P.with_kernel_scales(tree["mlp_fp8"])
    return tree, mlp if recipe.keep_mlp else None


_quantize_layer = jax.jit(P.quantize_layer_mlp)  # the host path's per-layer quantiser (`params.quantize_stacked_mlp`)


@functools.partial(jax.jit, static_argnames=("recipe", "mesh"))
def _build(raw: dict[str, Any], recipe: _Recipe, mesh: Mesh | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One group's leaves (a layer's, or the non-layer ones). Every layer has the same shapes: one compile."""
    tree, mlp = _leaves(raw, recipe)
    return _constrain(tree, mesh), _constrain(mlp, mesh)


@functools.partial(jax.jit, static_argnames=("recipe", "mesh"), donate_argnums=0)
def _build_into(
    stacked: dict[str, Any], raw: dict[str, Any], i: jax.Array, recipe: _Recipe, mesh: Mesh | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`_build` written straight into slot i of the stacked leaves, in place (stacked is donated; i is traced: one
    program for every layer)."""
    tree, mlp = _leaves(raw, recipe)
    out = jax.tree.map(lambda s, a: jax.lax.dynamic_update_index_in_dim(s, a, i, 0), stacked, tree)
    return _constrain(out, mesh), _constrain(mlp, mesh)


@functools.partial(jax.jit, static_argnames=("shapes", "mesh"))
def _zeros(shapes: tuple[tuple[tuple[str, ...], tuple[int, ...], str], ...], mesh: Mesh | None) -> dict[str, Any]:
    """Zero leaves (path, shape, dtype), allocated on the device in their split."""
    tree: dict[str, Any] = {}
    for path, shape, dtype in shapes:
        ckpt._set(tree, path, jnp.zeros(shape, dtype))
    return _constrain(tree, mesh)


def assemble(
    pieces: list[Piece],
    config: ModelConfig,
    layout: str = "stacked",
    mesh: Mesh | None = None,
    quantize: bool = False,
    progress: bool = False,
    workers: int = IO_WORKERS,
    on_device: bool | None = None,
) -> dict[str, Any]:
    """The param tree on the device, in `layout` ("stacked" or "unrolled": `params.py`), from pieces ordered group
    by group (`hf_pieces`, `host_pieces`). quantize: FP8 FFNs for layers >= 2 (`params.quantize_params`).

    on_device (default: from DEVICE_ASSEMBLY_BYTES on): each group is built on the device as soon as its last
    piece has arrived, and its pieces dropped: the device holds the model plus a layer or two, the host nothing but
    the transfers' staging. Else numpy builds the tree on the host, then it is transferred. Both are bit-identical
    to `params.py`'s host layouts and quantiser (the same casts, the same quantiser program, exact copies)."""
    total = sum(p.nbytes for p in pieces)
    if not (total >= DEVICE_ASSEMBLY_BYTES if on_device is None else on_device):
        return _assemble_on_host(pieces, config, layout, mesh, quantize)
    tp = mesh.shape[AXIS] if mesh is not None else 1
    # each piece lands directly in its shards: the split of the leaf it becomes, mapped back through the transpose
    # (a stacked layer's slice or a raw FFN weight take the names, hence the split, of their leaf)
    targets = {
        (p.group, p.path): jax.ShapeDtypeStruct(p.shape[::-1] if p.transpose else p.shape, p.dtype) for p in pieces
    }

    def sharding(p: Piece) -> NamedSharding | None:
        if mesh is None:
            return None  # the default device
        tree: Any = targets[(p.group, p.path)]
        for key in reversed(p.path):
            tree = {key: tree}
        spec = param_specs(tree, tp)
        for key in p.path:
            spec = spec[key]
        return NamedSharding(mesh, PartitionSpec(*(tuple(spec)[::-1] if p.transpose else spec)))

    def fetch(p: Piece) -> jax.Array:
        # may_alias: the CPU backend takes an aligned host array as it is (no copy); the programs below only read
        # it and always write fresh buffers. The worker waits for the transfer: `workers` bounds those in flight.
        return jax.device_put(p.read(), sharding(p), may_alias=True).block_until_ready()

    def on_submit(p: Piece) -> None:
        if p.prefetch is not None:
            p.prefetch()

    counts = collections.Counter(p.group for p in pieces)
    recipes = _recipes(pieces, config, layout, mesh, quantize)
    unrolled = layout == "unrolled"
    params: dict[str, Any] = {}
    layers: list[Any] = [None] * config.n_layers
    stacked = None
    raw: dict[int, dict] = collections.defaultdict(dict)
    # delay: no bar for loads that finish within a second (the bundled 10 MB model on every CLI call)
    bar = tqdm(total=total, desc="loading", unit="B", unit_scale=True, delay=1.0, disable=not progress)
    try:
        for p, x in prefetched(pieces, fetch, lambda p: p.nbytes, workers, on_submit=on_submit):
            ckpt._set(raw[p.group], p.path, x)
            del x
            bar.update(p.nbytes)
            counts[p.group] -= 1
            if counts[p.group]:
                continue
            group, recipe = raw.pop(p.group), recipes[p.group]
            if p.group == GLOBAL:
                params.update(_build(group, recipe, mesh)[0])
                continue
            if unrolled:
                layers[p.group], mlp = _build(group, recipe, mesh)
            else:
                if stacked is None:
                    layer = jax.eval_shape(lambda g, r=recipe: _leaves(g, r)[0], group)
                    stacked = _zeros(
                        tuple((path, (config.n_layers, *a.shape), a.dtype.name) for path, a in ckpt._flatten(layer)),
                        mesh,
                    )
                stacked, mlp = _build_into(stacked, group, p.group, recipe, mesh)
            if mlp is not None:
                params["mlp_first"] = mlp  # the paper keeps layer 1's FFN in bf16
            del group, mlp
    finally:
        bar.close()
    params["layers"] = tuple(layers) if unrolled else stacked
    return _fuse_first(params, layout, mesh)


def _fuse_first(params: dict[str, Any], layout: str, mesh: Mesh | None) -> dict[str, Any]:
    """A stored fp8_all's layer-1 bf16 projections fused as the per-layer layout fuses the layers."""
    if layout == "unrolled" and mesh is None and "attn_first" in params:
        params["attn_first"] = P.fuse_projections(params["attn_first"])
    return params


def _recipes(
    pieces: list[Piece], config: ModelConfig, layout: str, mesh: Mesh | None, quantize: bool
) -> dict[int, _Recipe]:
    """Each group's _Recipe. Every layer's FFN goes to FP8 (layer 0's entry keeps the scan over layers uniform;
    its bf16 FFN is mlp_first); tensor parallel keeps q, k, v apart (each is split by head)."""
    dtype = np.dtype(config.jnp_dtype)
    unrolled = layout == "unrolled"
    out = {}
    for g in sorted({p.group for p in pieces}):
        transposed = frozenset(p.path for p in pieces if p.group == g and p.transpose)
        if g == GLOBAL:
            out[g] = _Recipe(dtype, transposed)
        else:
            fuse = unrolled and mesh is None
            out[g] = _Recipe(dtype, transposed, unrolled, fuse, quantize, keep_mlp=quantize and g == 0)
    return out


def _assemble_on_host(
    pieces: list[Piece], config: ModelConfig, layout: str, mesh: Mesh | None, quantize: bool
) -> dict[str, Any]:
    """`assemble` for small checkpoints: numpy on the host, then one transfer per leaf (no program to compile)."""
    recipes = _recipes(pieces, config, layout, mesh, quantize)
    raw: dict[int, dict] = collections.defaultdict(dict)
    for p in pieces:
        ckpt._set(raw[p.group], p.path, p.read())
    params, _ = _leaves(raw.pop(GLOBAL), recipes[GLOBAL], host=True)
    layers = []
    for i in range(config.n_layers):
        layer, mlp = _leaves(raw.pop(i), recipes[i], host=True)
        layers.append(layer)
        if mlp is not None:
            params["mlp_first"] = mlp
    params["layers"] = tuple(layers) if layout == "unrolled" else jax.tree.map(lambda *a: np.stack(a), *layers)
    params = _fuse_first(params, layout, mesh)
    if mesh is None:
        return jax.device_put(params)
    specs = param_specs(params, mesh.shape[AXIS])
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec))


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


LAYER_LAYOUTS = ("auto", "stacked", "unrolled")


def resolve_layer_layout(layer_layout: str) -> str:
    """ "auto" -> "unrolled" on a GPU, "stacked" elsewhere.

    Why unrolled on the GPU: inside lax.scan each layer's weights are a dynamic slice of the stacked arrays and
    XLA copies every slice before its GEMM, so a batch-1 LLaDA-8B block step read the weights ~3 times: 12.63 ms
    scanned vs 5.17 ms with per-layer (fused) weights on an H200 (bench/results/block_step_h200.json). On the CPU
    the scan compiles faster and the tiny models gain nothing from unrolling."""
    if layer_layout not in LAYER_LAYOUTS:
        raise ValueError(f"layer_layout={layer_layout!r}; expected one of {LAYER_LAYOUTS}")
    if layer_layout == "auto":
        return "unrolled" if jax.default_backend() == "gpu" else "stacked"
    return layer_layout


WEIGHTS = ("bf16", "fp8_ffn", "fp8_all")  # load(weights=...): which linear layers run in FP8


def load(
    path: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
    progress: bool = False,
    fp8_ffn: bool = False,
    layer_layout: str = "auto",
    tensor_parallel: int = 1,
    weights: str | None = None,
    fp8_first_layer: bool = False,
) -> Model:
    """Load a model. `path`: a directory written by `dllm-convert`, or an HF release directory (converted in
    memory), or None for the bundled default model. dtype: "bfloat16" (default) or "float32".
    weights: "bf16" (the dtype throughout), "fp8_ffn" (the FFNs of layers >= 2 in e4m3 with 128x128 block scales,
    LaCache's scheme) or "fp8_all" (also their q/k/v and o projections and the LM head); None: as stored (a
    checkpoint converted with --fp8-ffn is fp8_ffn). Quantised here when the checkpoint is not already.
    fp8_ffn: True is weights="fp8_ffn". fp8_first_layer: layer 1 in FP8 as well (by default it stays in dtype).
    layer_layout: "stacked" ([L, ...] weights, a lax.scan over layers), "unrolled" (one array per layer, an
    unrolled layer loop: faster on the GPU), or "auto" (unrolled on a GPU; see `resolve_layer_layout`).
    tensor_parallel: split the weights over this many devices (`transformer.sharding`); every jitted call on the
    model then runs on all of them."""
    weights = "fp8_ffn" if fp8_ffn and weights in (None, "bf16") else weights
    if weights not in (None, *WEIGHTS):
        raise ValueError(f"weights={weights!r}; expected one of {WEIGHTS}")
    if weights == "fp8_all" and tensor_parallel != 1:
        raise ValueError("weights='fp8_all' runs on one device for now (tensor_parallel=1)")
    layout = resolve_layer_layout(layer_layout)
    mesh = tensor_parallel_mesh(tensor_parallel) if tensor_parallel != 1 else None  # a bad count: before reading
    path = Path(path) if path is not None else DEFAULT_MODEL_DIR
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ckpt.CheckpointError(f"{path} is not a directory")
    if ckpt.is_converted(path):
        config, host = ckpt.read_converted(path)  # in its stored dtype: a cast to `dtype` runs on the device
        config = config.replace(dtype=dtype)
        _check_shapes(config, host, path)
        pieces = host_pieces(host)
    else:
        hf = ckpt.HFCheckpoint(path)
        config = hf.model_config(dtype=dtype)
        pieces = hf_pieces(hf, config)  # validated: names, shapes and dtypes as config.json says
    if mesh is not None:
        check_tensor_parallel(config, tensor_parallel)
        if config.fp8_proj:  # stored fp8_all (the asked-for case was refused before reading)
            raise ValueError(f"{path} stores weights='fp8_all', which runs on one device for now (tensor_parallel=1)")
    if weights is not None and WEIGHTS.index(weights) < WEIGHTS.index(config.weights):
        raise ValueError(f"{path} stores FP8 weights ({config.weights}): load it with weights={config.weights!r}")
    if fp8_first_layer and (weights or config.weights) == "bf16":
        raise ValueError("fp8_first_layer quantises layer 1 beside FP8 weights: weights='fp8_ffn' or 'fp8_all'")
    quantize = weights in ("fp8_ffn", "fp8_all") and not config.fp8_ffn
    if quantize:
        (P.check_fp8_proj_shapes if weights == "fp8_all" else P.check_fp8_shapes)(config)
    params = assemble(pieces, config, layout, mesh, quantize, progress)
    if quantize:
        config = config.replace(fp8_ffn=True)
    if weights == "fp8_all":
        params, config = P.quantize_projections(params, config)
    if fp8_first_layer:
        params, config = P.quantize_first_layer(params, config)
    tokenizer = load_tokenizer(path, config) if has_tokenizer(path) else None
    return Model(config, params, tokenizer, path)
