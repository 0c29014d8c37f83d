"""Tokenizers of both families through `transformers`, never by executing a checkpoint's remote code.

LLaDA ships tokenizer.json (PreTrainedTokenizerFast). Dream ships Qwen2-style vocab.json/merges.txt (and often a
tokenizer.json) whose tokenizer_config points at remote code; we build transformers' own Qwen2 tokenizer instead.
The chat template is the checkpoint's own when it has one, else the family's built-in (models/<family>.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

from dllm_jax.config import ModelConfig
from dllm_jax.models import FAMILIES

# transformers announces at import that it found no PyTorch: true and irrelevant here (only its tokenizers are
# used), so that one record is dropped; every other transformers message passes.
logging.getLogger("transformers").addFilter(lambda record: "PyTorch was not found" not in record.getMessage())

Message = dict[str, str]


class Tokenizer:
    """A thin wrapper: encode/decode and the chat template, with the special ids the engine needs."""

    def __init__(self, hf_tokenizer, config: ModelConfig):
        self.hf = hf_tokenizer
        self.config = config
        if not getattr(self.hf, "chat_template", None):
            self.hf.chat_template = FAMILIES[config.family].chat_template

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message] | str, add_generation_prompt: bool = True) -> list[int]:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        out = self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return [int(i) for i in out]

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def unk_token_id(self) -> int | None:
        """The id every unknown word maps to (word-level vocabularies); None for byte-level tokenizers."""
        return getattr(self.hf, "unk_token_id", None)


def has_tokenizer(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "tokenizer.json").is_file() or ((p / "vocab.json").is_file() and (p / "merges.txt").is_file())


def load_tokenizer(path: str | os.PathLike, config: ModelConfig) -> Tokenizer:
    import transformers

    p = Path(path)
    tok_cfg = {}
    if (p / "tokenizer_config.json").is_file():
        tok_cfg = json.loads((p / "tokenizer_config.json").read_text())
    kwargs = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token"):
        value = tok_cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            kwargs[key] = value
    # from_pretrained on a concrete class reads the standard file names (tokenizer.json, or vocab.json +
    # merges.txt, plus tokenizer_config.json's added tokens) and never runs a checkpoint's remote code.
    # A checkpoint whose tokenizer_config names the generic fast tokenizer (a tokenizer.json of any model type, e.g.
    # the task vocabulary of a Dream-layout demo model) is read as such: Qwen2's class would rebuild a BPE from it.
    generic = tok_cfg.get("tokenizer_class") == "PreTrainedTokenizerFast" and (p / "tokenizer.json").is_file()
    cls = (
        transformers.Qwen2TokenizerFast
        if config.family == "dream" and not generic
        else transformers.PreTrainedTokenizerFast
    )
    hf = cls.from_pretrained(str(p), local_files_only=True, **kwargs)
    template = tok_cfg.get("chat_template")
    if isinstance(template, str):
        hf.chat_template = template
    return Tokenizer(hf, config)
