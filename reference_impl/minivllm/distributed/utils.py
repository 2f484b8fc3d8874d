"""Small arithmetic the parallel layers share."""

from __future__ import annotations


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, refusing a remainder: a layer whose size does
    not split evenly over the ranks cannot be sharded by rows or columns."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator
