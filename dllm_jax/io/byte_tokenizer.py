"""A byte-level BPE tokenizer with no merges: 256 byte symbols plus a family's special tokens.

Used for the bundled default model and the test fixtures, where no real vocabulary can be downloaded. It is an
ordinary `tokenizers` byte-level BPE (the same machinery as Qwen's), so it round-trips any UTF-8 text.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

LLADA_SPECIALS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|mdm_mask|>",
)
DREAM_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")


def byte_vocab() -> dict[str, int]:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return {ch: i for i, ch in enumerate(sorted(alphabet))}


def build(specials: tuple[str, ...], special_ids: dict[str, int] | None = None) -> Tokenizer:
    """256 byte tokens at ids 0..255; specials at 256.. or at the ids given."""
    vocab = byte_vocab()
    next_id = 256
    for s in specials:
        if special_ids and s in special_ids:
            vocab[s] = special_ids[s]
        else:
            vocab[s] = next_id
            next_id += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    return tok


def write(out_dir: str | Path, family: str, special_ids: dict[str, int] | None = None) -> None:
    """Write tokenizer files in the family's release layout (LLaDA: tokenizer.json; Dream: also vocab/merges)."""
    out = Path(out_dir)
    specials = LLADA_SPECIALS if family == "llada" else DREAM_SPECIALS
    tok = build(specials, special_ids)
    tok.save(str(out / "tokenizer.json"))
    if family == "llada":
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mdm_mask|>",
        }
    else:
        vocab = {k: v for k, v in tok.get_vocab().items() if k not in specials}
        (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        (out / "merges.txt").write_text("#version: 0.2\n")
        cfg = {
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mask|>",
            "bos_token": None,
        }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
