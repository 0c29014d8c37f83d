"""Checkpoints and tokenizers in (HF safetensors, converted orbax), nothing computed."""
