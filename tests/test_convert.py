"""Checkpoint conversion: HF -> orbax -> load is bit-exact; every kind of bad checkpoint fails clearly."""

import json

import fixtures
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dllm_jax
from convert.cli import main as convert_main
from dllm_jax.io import checkpoint as ckpt


def leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{prefix}/{k}")
    else:
        yield prefix, np.asarray(tree)


@pytest.mark.parametrize(
    "name,shard", [("llada", None), ("llada_gqa_tied", 20_000), ("dream", 30_000), ("dream_tied", None)]
)
def test_round_trip_bit_exact(name, shard, tmp_path, capsys):
    src = fixtures.write_checkpoint(name, tmp_path / "hf", shard_bytes=shard)
    fixtures.write_tokenizer(fixtures.SPECS[name]["family"], src)
    if shard:
        assert (src / "model.safetensors.index.json").exists() and len(list(src.glob("*.safetensors"))) > 1
    assert convert_main([str(src), str(tmp_path / "out"), "--quiet"]) == 0
    assert "converted" in capsys.readouterr().out
    direct = dllm_jax.load(src)
    converted = dllm_jax.load(tmp_path / "out")
    assert converted.config == direct.config
    a, b = dict(leaves(direct.params)), dict(leaves(converted.params))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(a[k].view(np.uint16), b[k].view(np.uint16), err_msg=k)
    # every HF tensor survives HF -> params -> HF unchanged (the mapping table is a bijection)
    hf = {}
    for f in src.glob("*.safetensors"):
        hf.update(load_file(f))
    back = dict(ckpt.iter_hf_tensors(converted.params, converted.config))
    assert back.keys() == hf.keys()
    for k in hf:
        np.testing.assert_array_equal(back[k].astype(ml_dtypes.bfloat16).view(np.uint16), hf[k].view(np.uint16))
    # tokenizer files travel with the converted checkpoint
    assert converted.tokenizer is not None
    assert converted.tokenizer.decode(converted.tokenizer.encode("hi there")) == "hi there"


def test_fp32_conversion(tmp_path):
    src = fixtures.write_checkpoint("dream", tmp_path / "hf")
    assert convert_main([str(src), str(tmp_path / "out"), "--dtype", "float32", "--quiet"]) == 0
    m = dllm_jax.load(tmp_path / "out", dtype="float32")
    assert m.config.dtype == "float32" and m.params["embed"].dtype == np.float32


def _expect_failure(src, out, capsys, *needles):
    code = convert_main([str(src), str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    for n in needles:
        assert n in err, (n, err)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]
    return err


def _rewrite(src, fn):
    t = load_file(src / "model.safetensors")
    fn(t)
    save_file(t, str(src / "model.safetensors"))


def test_missing_unexpected_and_misshapen_listed_together(tmp_path, capsys):
    src = fixtures.write_checkpoint("llada", tmp_path / "hf")

    def damage(t):
        del t["model.transformer.blocks.1.q_proj.weight"]
        t["model.transformer.blocks.0.extra.weight"] = np.zeros(3, ml_dtypes.bfloat16)
        t["model.transformer.ln_f.weight"] = np.zeros(7, ml_dtypes.bfloat16)
        t["model.transformer.blocks.2.up_proj.weight"] = t["model.transformer.blocks.2.up_proj.weight"].astype(np.int32)

    _rewrite(src, damage)
    _expect_failure(
        src,
        tmp_path / "out",
        capsys,
        "1 missing tensor(s): model.transformer.blocks.1.q_proj.weight",
        "unexpected tensor(s): model.transformer.blocks.0.extra.weight",
        "model.transformer.ln_f.weight: shape [7], expected [60]",
        "model.transformer.blocks.2.up_proj.weight: dtype I32",
    )


def test_config_disagrees_with_weights(tmp_path, capsys):
    src = fixtures.write_checkpoint("dream", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (src / "config.json").write_text(json.dumps(cfg))
    _expect_failure(src, tmp_path / "out", capsys, "missing tensor(s): model.layers.3.")


def test_bad_paths_and_files(tmp_path, capsys):
    _expect_failure(tmp_path / "nope", tmp_path / "out", capsys, "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_failure(empty, tmp_path / "out", capsys, "has no config.json")
    src = fixtures.write_checkpoint("llada", tmp_path / "hf")
    (src / "model.safetensors").unlink()
    _expect_failure(src, tmp_path / "out", capsys, "no model.safetensors")
    src2 = fixtures.write_checkpoint("llada", tmp_path / "hf2", shard_bytes=20_000)
    next(iter(sorted(src2.glob("model-*.safetensors")))).unlink()
    _expect_failure(src2, tmp_path / "out", capsys, "names shard files that do not exist")
    src3 = fixtures.write_checkpoint("llada", tmp_path / "hf3")
    (src3 / "model.safetensors").write_bytes(b"garbage")
    _expect_failure(src3, tmp_path / "out", capsys, "cannot read safetensors file")
    src4 = fixtures.write_checkpoint("llada", tmp_path / "hf4")
    cfg = json.loads((src4 / "config.json").read_text())
    cfg["model_type"] = "bert"
    (src4 / "config.json").write_text(json.dumps(cfg))
    _expect_failure(src4, tmp_path / "out", capsys, "model_type='bert'")


def test_existing_output_is_protected(tmp_path, capsys):
    src = fixtures.write_checkpoint("llada", tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert_main([str(src), str(out), "--quiet"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert convert_main([str(src), str(out), "--quiet", "--force"]) == 0
    assert not (out / "keep.txt").exists() and ckpt.is_converted(out)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        dllm_jax.load(tmp_path / "missing")
    src = fixtures.write_checkpoint("llada", tmp_path / "hf")
    convert_main([str(src), str(tmp_path / "out"), "--quiet"])
    meta = json.loads((tmp_path / "out" / "dllm_jax.json").read_text())
    meta["model_config"]["n_layers"] = 5
    (tmp_path / "out" / "dllm_jax.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="do not match their config"):
        dllm_jax.load(tmp_path / "out")


def test_default_model_loads():
    m = dllm_jax.load()
    assert m.config.family == "llada" and m.tokenizer is not None
    ids = m.encode_chat("Hello")
    assert ids[0] == m.config.bos_token_id


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_chat_templates(family, hf_dirs):
    m = dllm_jax.load(hf_dirs["llada" if family == "llada" else "dream"])
    text = m.tokenizer.decode(m.encode_chat([{"role": "user", "content": " 2+2? "}]), skip_special_tokens=False)
    if family == "llada":
        assert text == (
            "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    else:
        assert text.endswith("<|im_start|>user\n 2+2? <|im_end|>\n<|im_start|>assistant\n")


def test_dream_tokenizer_from_vocab_merges_without_remote_code(tmp_path):
    """A Dream release whose tokenizer_config points at remote code, with only vocab.json + merges.txt: the
    Qwen2 tokenizer of transformers loads it, its added special tokens stay single ids."""
    d = fixtures.write_checkpoint("dream", tmp_path / "hf")
    fixtures.write_tokenizer("dream", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    added = json.loads((d / "tokenizer.json").read_text())["added_tokens"]
    cfg["added_tokens_decoder"] = {str(t["id"]): {"content": t["content"], "special": True} for t in added}
    cfg["tokenizer_class"] = "DreamTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "tokenizer.json").unlink()
    tok = dllm_jax.load(d).tokenizer
    ids = tok.apply_chat_template("hi")
    im_start = next(t["id"] for t in added if t["content"] == "<|im_start|>")
    assert ids.count(im_start) == 3  # system, user, assistant headers
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
