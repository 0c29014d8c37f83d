"""Small helpers shared by the kernel modules."""

from __future__ import annotations


def is_pow2(x) -> bool:
    return isinstance(x, int) and x >= 1 and (x & (x - 1)) == 0


def check_pow2(owner: str, field: str, value, at_most: int | None = None) -> None:
    """Raises ValueError unless `value` (the field `owner.field` of a tiling dataclass) is a power of two <= at_most."""
    if not is_pow2(value) or (at_most is not None and value > at_most):
        limit = "" if at_most is None else f" <= {at_most}"
        raise ValueError(f"{owner}.{field} must be a power of two{limit}, got {value!r}")
