"""Shared by every day's checker: the one line a passing checker prints, and
the guard for cells that use an exercise's code (tools/labs/FORMAT.md)."""

from __future__ import annotations

import re

# What an unfinished exercise raises in the lab (tools/labs/generate.py):
# `raise NotImplementedError("Day N, exercise k")`.
_PLACEHOLDER = re.compile(r"Day \d+, exercise \d+")


def is_unfinished(error: BaseException) -> bool:
    """Is this the lab's placeholder of an unfinished exercise (which the
    progress tool reports as "todo")? Not every NotImplementedError is:
    PyTorch raises one for an operator it has no kernel for at that dtype
    (`torch.bincount` of a float tensor), a bug in the learner's code."""
    return isinstance(error, NotImplementedError) and bool(_PLACEHOLDER.fullmatch(str(error)))


def passed(day: int, k: int) -> None:
    """The stable line of a checker cell whose exercise passed."""
    print(f"Day {day}, exercise {k}: passed")


class needs:
    """`with check.needs(4): ...` runs a cell that uses exercise 4's code; while
    that exercise is unfinished (its placeholder, `is_unfinished`) it says so
    instead of failing; any other error shows as it is."""

    def __init__(self, *k: int) -> None:
        self.k = " and ".join(map(str, k))

    def __enter__(self) -> needs:
        return self

    def __exit__(self, kind, value, tb) -> bool:
        if value is not None and is_unfinished(value):
            print(
                f"(this cell uses your code from exercise {self.k}: "
                "run it again once the checker passes)"
            )
            return True
        return False


class SameEqualities:
    """Checks, one value at a time, that the learner's hashes are equal exactly
    where the reference's are: a hash of theirs given to two different reference
    values is a collision, a reference value given two hashes of theirs a split.
    `where` is what the message names (a case and a block index, say)."""

    def __init__(self) -> None:
        self._first_of_mine: dict = {}  # learner's hash -> (reference value, where)
        self._first_of_ref: dict = {}  # reference value -> (learner's hash, where)

    def add(self, mine, ref, where) -> tuple[str, object] | None:
        """None if consistent so far, else ("collision" or "split", the earlier `where`)."""
        seen = self._first_of_mine.get(mine)
        if seen is not None and seen[0] != ref:
            return "collision", seen[1]
        self._first_of_mine[mine] = (ref, where)
        seen = self._first_of_ref.get(ref)
        if seen is not None and seen[0] != mine:
            return "split", seen[1]
        self._first_of_ref[ref] = (mine, where)
        return None
