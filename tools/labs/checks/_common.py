"""Shared by every day's checker: the one line a passing checker prints, and
the guard for cells that use an exercise's code (tools/labs/FORMAT.md)."""

from __future__ import annotations


def passed(day: int, k: int) -> None:
    """The stable line of a checker cell whose exercise passed."""
    print(f"Day {day}, exercise {k}: passed")


class needs:
    """`with check.needs(4): ...` runs a cell that uses exercise 4's code; while
    that exercise is unfinished (NotImplementedError) it says so instead of failing."""

    def __init__(self, *k: int) -> None:
        self.k = " and ".join(map(str, k))

    def __enter__(self) -> needs:
        return self

    def __exit__(self, kind, value, tb) -> bool:
        if kind is not None and issubclass(kind, NotImplementedError):
            print(
                f"(this cell uses your code from exercise {self.k}: "
                "run it again once the checker passes)"
            )
            return True
        return False
