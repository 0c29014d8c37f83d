"""Small helpers shared by the kernel modules."""

from __future__ import annotations


def is_pow2(x) -> bool:
    return isinstance(x, int) and x >= 1 and (x & (x - 1)) == 0


def check_pow2(owner: str, field: str, value, at_most: int | None = None) -> None:
    """Raises ValueError unless `value` (the field `owner.field` of a tiling dataclass) is a power of two <= at_most."""
    if not is_pow2(value) or (at_most is not None and value > at_most):
        limit = "" if at_most is None else f" <= {at_most}"
        raise ValueError(f"{owner}.{field} must be a power of two{limit}, got {value!r}")


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def check_attention_tiles(owner: str, block_q, block_k, num_warps, num_stages) -> None:
    """The checks every attention-style tiling shares (ValueError naming the field): powers of two, at least the
    16 keys a dot needs, at most 16 warps, at least one pipeline stage."""
    check_pow2(owner, "block_q", block_q)
    check_pow2(owner, "block_k", block_k)
    if block_k < 16:
        raise ValueError(f"{owner}.block_k must be >= 16, got {block_k}")
    check_pow2(owner, "num_warps", num_warps, 16)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"{owner}.num_stages must be >= 1, got {num_stages!r}")
