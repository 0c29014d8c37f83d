"""`dllm_jax.load` (io/loading.py) through both assemblies: on the device (tensors go there as read; transposes,
casts, stacking, fusing and FP8 quantisation run there: checkpoints from DEVICE_ASSEMBLY_BYTES on) and on the host
(numpy: the tiny ones). Every leaf equals, bit for bit, an expectation built on the host from the fixture tensors
and the family's mapping table (numpy transposes and casts; `params.py`'s host layouts and quantiser), for both
families, both layouts, sharded and rule-ordered files, converted checkpoints and tensor-parallel placement."""

import json
import subprocess
import sys
from pathlib import Path

import fixtures
import jax
import ml_dtypes
import numpy as np
import pytest

import dllm_jax
from convert.cli import main as convert_main
from dllm_jax.config import ModelConfig
from dllm_jax.io import checkpoint as ckpt
from dllm_jax.io import loading
from dllm_jax.models import FAMILIES
from dllm_jax.transformer import params as P

NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


@pytest.fixture(params=["device", "host"])
def assembly(request, monkeypatch):
    """Where `load` assembles the tree: forced on the device (the fixtures are far below the threshold) or host."""
    monkeypatch.setattr(loading, "DEVICE_ASSEMBLY_BYTES", 0 if request.param == "device" else 1 << 62)
    return request.param


def expected_params(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict:
    """The stacked param tree as the mapping table says: [out, in] weights transposed, layers stacked, numpy casts."""
    stacks: dict[tuple, dict[int, np.ndarray]] = {}
    tree: dict = {}
    for name, (rule, layer) in FAMILIES[config.family].expand(config).items():
        a = tensors[name].T if rule.transpose else tensors[name]
        a = np.ascontiguousarray(a).astype(NP_DTYPES[config.dtype])
        if layer is None:
            ckpt._set(tree, rule.path, a)
        else:
            stacks.setdefault(rule.path, {})[layer] = a
    for path, layers in stacks.items():
        ckpt._set(tree, path, np.stack([layers[i] for i in range(config.n_layers)]))
    return tree


def fixture_expectation(name: str, dtype: str = "bfloat16") -> tuple[ModelConfig, dict]:
    spec = {**fixtures.SPECS, **fixtures.TP_SPECS}[name]
    config = ModelConfig.from_hf(fixtures.hf_config(spec), dtype=dtype)
    return config, expected_params(fixtures.hf_tensors(spec), config)


def assert_same(got, want) -> None:
    g, w = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
    assert [jax.tree_util.keystr(p) for p, _ in g] == [jax.tree_util.keystr(p) for p, _ in w]
    for (path, a), (_, b) in zip(g, w):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), jax.tree_util.keystr(path)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), jax.tree_util.keystr(path)


@pytest.mark.parametrize(
    "name,shard,dtype",
    [
        ("llada", None, "bfloat16"),
        ("llada_gqa_tied", 20_000, "float32"),
        ("dream", 30_000, "bfloat16"),
        ("dream_tied", None, "float32"),
    ],
)
def test_hf_load_equals_mapping_table(name, shard, dtype, assembly, tmp_path):
    src = fixtures.write_checkpoint(name, tmp_path / "hf", shard_bytes=shard)
    config, want = fixture_expectation(name, dtype)
    stacked = dllm_jax.load(src, dtype=dtype, layer_layout="stacked")
    assert stacked.config == config
    assert_same(stacked.params, want)
    unrolled = dllm_jax.load(src, dtype=dtype, layer_layout="unrolled")  # per layer, q/k/v and gate/up fused
    assert P.is_unrolled(unrolled.params["layers"]) and P.is_fused(unrolled.params["layers"])
    assert_same(unrolled.params, P.unstack_layers(want))


def test_fp8_load_equals_host_quantiser(assembly, tmp_path):
    src = fixtures.write_checkpoint("llada_fp8_tp", tmp_path / "hf")
    config, want = fixture_expectation("llada_fp8_tp")
    want_fp8, config_fp8 = P.quantize_params(want, config)  # layer by layer into host numpy
    for layout, expect in (("stacked", want_fp8), ("unrolled", P.unstack_layers(want_fp8))):
        m = dllm_jax.load(src, fp8_ffn=True, layer_layout=layout)
        assert m.config == config_fp8
        assert_same(m.params, expect)
    # a checkpoint converted with --fp8-ffn (quantised once, stored e4m3) loads to the same leaves; in float32 its
    # e4m3 weights and fp32 scales stay as stored
    assert convert_main([str(src), str(tmp_path / "fp8"), "--fp8-ffn", "--quiet"]) == 0
    assert_same(dllm_jax.load(tmp_path / "fp8", layer_layout="unrolled").params, P.unstack_layers(want_fp8))
    f32 = dllm_jax.load(tmp_path / "fp8", dtype="float32", layer_layout="stacked")
    expect = jax.tree_util.tree_map_with_path(
        lambda p, a: a if "mlp_fp8" in jax.tree_util.keystr(p) else a.astype(np.float32), want_fp8
    )
    assert f32.config == config_fp8.replace(dtype="float32")
    assert_same(f32.params, expect)


def test_converted_and_rule_ordered_checkpoints(assembly, tmp_path):
    """A converted (orbax, stacked) checkpoint, and an HF directory written by `export_hf` (the tensors ordered rule
    by rule, not layer by layer, over several shards), both in both layouts."""
    src = fixtures.write_checkpoint("dream", tmp_path / "hf")
    config, want = fixture_expectation("dream")
    assert convert_main([str(src), str(tmp_path / "converted"), "--quiet"]) == 0
    ckpt.export_hf(want, config, tmp_path / "exported", max_shard_bytes=12_000)
    assert len(list((tmp_path / "exported").glob("*.safetensors"))) > 2
    for d in ("converted", "exported"):
        assert_same(dllm_jax.load(tmp_path / d, layer_layout="stacked").params, want)
        assert_same(dllm_jax.load(tmp_path / d, layer_layout="unrolled").params, P.unstack_layers(want))


@pytest.mark.parametrize("source", [np.float32, np.float16])
def test_source_dtypes_cast_as_numpy_does(source, assembly, tmp_path):
    """F32 / F16 files: the device's casts to bf16 (and f32) round exactly as ml_dtypes does on the host."""
    config, want = fixture_expectation("llada_gqa_tied", "float32")
    rng = np.random.default_rng(3)
    noisy = jax.tree.map(lambda a: (a + rng.standard_normal(a.shape).astype(np.float32) * 1e-3).astype(source), want)
    ckpt.export_hf(noisy, config, tmp_path / "hf", dtype=source)
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(ckpt.safetensors_locations(f))
    assert {loc.dtype for loc in hf.values()} == {"F32" if source is np.float32 else "F16"}
    for dtype in ("bfloat16", "float32"):
        m = dllm_jax.load(tmp_path / "hf", dtype=dtype, layer_layout="stacked")
        assert_same(m.params, jax.tree.map(lambda a, t=NP_DTYPES[dtype]: a.astype(t), noisy))


def test_params_never_alias_the_files(assembly, tmp_path):
    """The checkpoint's pages are mapped, and the CPU backend may take them as they are: every leaf must still be
    a copy (overwriting the file afterwards changes nothing), whatever its transform (none for the embedding)."""
    src = fixtures.write_checkpoint("llada", tmp_path / "hf")
    m = dllm_jax.load(src, layer_layout="stacked")
    before = jax.tree.map(np.array, m.params)
    f = src / "model.safetensors"
    size, header = f.stat().st_size, 8 + int.from_bytes(f.read_bytes()[:8], "little")
    with open(f, "r+b") as fh:  # in place: a shared mapping of this file would see the new bytes
        fh.seek(header)
        fh.write(b"\x7f" * (size - header))
    assert_same(m.params, before)


def test_bad_safetensors_ranges(tmp_path):
    src = fixtures.write_checkpoint("llada", tmp_path / "hf")
    f = src / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = "model.transformer.ln_f.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end - 2]  # one bf16 short of its shape
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    f.write_bytes(raw[:8] + text + raw[8 + n :])
    with pytest.raises(ckpt.CheckpointError, match="ln_f.weight has data_offsets"):
        ckpt.safetensors_locations(f)


TP_BODY = """
import sys, json
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
import dllm_jax, fixtures
import test_loading as T
from dllm_jax.io import loading
from dllm_jax.transformer import params as P
from dllm_jax.transformer.sharding import param_specs
from jax.sharding import PartitionSpec
assert len(jax.devices()) == 8
root = sys.argv[2]
out = []
for name, tp, layout, fp8, threshold in [
    ("llada_tp", 8, "stacked", False, 0), ("dream_tp", 2, "unrolled", False, 0),
    ("llada_fp8_tp", 2, "stacked", True, 0), ("llada_fp8_tp", 2, "unrolled", True, 0),
    ("llada_tp", 8, "stacked", False, 1 << 62), ("llada_fp8_tp", 2, "unrolled", True, 1 << 62),
]:
    loading.DEVICE_ASSEMBLY_BYTES = threshold  # 0: on the device; else numpy on the host
    src = fixtures.write_checkpoint(name, f"{root}/{name}")
    config, want = T.fixture_expectation(name, "float32")
    if fp8:
        want, config = P.quantize_params(want, config)
    if layout == "unrolled":
        want = P.unstack_layers(want, fuse=False)  # tensor parallel keeps q, k, v apart (split by head)
    m = dllm_jax.load(src, dtype="float32", tensor_parallel=tp, layer_layout=layout, fp8_ffn=fp8)
    T.assert_same(m.params, want)
    specs = param_specs(m.params, tp)
    for a, s in zip(jax.tree.leaves(m.params), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
        assert a.sharding.is_equivalent_to(jax.sharding.NamedSharding(a.sharding.mesh, s), a.ndim), (name, s)
        assert len(a.sharding.device_set) == tp
    q = m.params["layers"]["q_proj"]["kernel"] if layout == "stacked" else m.params["layers"][0]["q_proj"]["kernel"]
    out.append([name, list(q.shape), list(q.addressable_shards[0].data.shape)])
print(json.dumps(out))
"""


def test_tensor_parallel_placement(tmp_path):
    """On 8 host devices: every leaf equals the expectation and lies in its `param_specs` split (each device got
    its part straight from the file: q's columns by head)."""
    tests = Path(__file__).parent
    env = fixtures.subprocess_env(host_devices=8)
    r = subprocess.run(
        [sys.executable, "-c", TP_BODY, str(tests), str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    shapes = json.loads(r.stdout.strip().splitlines()[-1])
    assert shapes[0] == shapes[4] == ["llada_tp", [2, 64, 64], [2, 64, 8]]
    assert shapes[1] == ["dream_tp", [64, 64], [64, 32]]


def test_bench_load_smoke(tmp_path):
    """bench/bench_load.py end to end at a tiny width: it writes a checkpoint the loader reads and its JSON row."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_load.py"
    spec = importlib.util.spec_from_file_location("bench_load", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = ["--layers", "2", "--d-model", "128", "--mlp", "256", "--vocab", "512", "--shard-gb", "0.0005"]
    assert (
        mod.main([*args, "--dir", str(tmp_path / "ckpt"), "--repeats", "1", "--run", "t", "--out", str(tmp_path)]) == 0
    )
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as HF writes it
    (row,) = json.loads((tmp_path / f"load_{jax.devices()[0].platform}.json").read_text())["rows"]
    assert row["tensors"] == 3 + 2 * 9 and row["bytes"] == 2 * (
        2 * 512 * 128 + 128 + 2 * (2 * 128 + 4 * 128**2 + 3 * 128 * 256)
    )
    for k in ("load_s", "first_load_s", "read_floor_s", "transfer_floor_s"):
        assert row[k] > 0
