"""The word-level tokenizer of the synthetic tasks, written in the LLaDA release layout.

tokenizer.json: a `tokenizers` WordLevel model over LLADA_SPECIALS + an unknown token + `generators.all_words()`,
with a lower-casing normaliser and a pre-tokenizer that splits on whitespace and isolates the punctuation words
(". , ; : ? ->"), so "Where is Mary?" gives the task words "where is mary ?"; the decoder joins words with single
spaces. tokenizer_config.json names BOS/EOS/pad/mask like LLaDA's (pad = EOS). The engine's loader
(`dllm_jax.tokenizer.load_tokenizer`) reads it through transformers.PreTrainedTokenizerFast and applies LLaDA's
chat template, which this vocabulary covers ("user", "assistant" and the header tokens are in it).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from dllm_jax.io.byte_tokenizer import LLADA_SPECIALS
from dllm_jax.tasks import long_form
from dllm_jax.tasks.generators import all_words

UNK = "<|unk|>"
BOS, EOS, MASK = "<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>"


def vocab() -> dict[str, int]:
    """Specials first (ids 0..5 in LLADA_SPECIALS order, then UNK at 6), then the task words, then the long-form
    tasks' new words (after, so that the bundled model's ids stay where they are)."""
    words = list(LLADA_SPECIALS) + [UNK] + all_words()
    words += [w for w in dict.fromkeys(long_form.WORDS) if w not in words]
    return {w: i for i, w in enumerate(words)}


def padded_vocab_size(multiple: int = 64) -> int:
    n = len(vocab())
    return (n + multiple - 1) // multiple * multiple


def build() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"->|[.,;:?]"), behavior="isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    tok.add_special_tokens(list(LLADA_SPECIALS) + [UNK])
    return tok


def write(out_dir: str | Path, chat_template: str | None = None) -> None:
    """tokenizer.json + tokenizer_config.json; chat_template (e.g. LLaDA's, which the tasks' prompts use) is stored
    in the config when given: a Dream-layout model needs it, its family's own template has no words here."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build().save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": UNK,
        "mask_token": MASK,
    }
    if chat_template:
        cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
