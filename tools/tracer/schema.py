"""Checking a trace against its contract: `trace_schema.json` line by line,
then the rules between fields and lines that a JSON Schema cannot say
(SCHEMA.md, "Rules")."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("trace_schema.json")


@cache
def _validator():
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(schema)


def _check_step(step: dict[str, Any], expected: int, known: set[str]) -> list[str]:
    errors = []
    if step["step"] != expected:
        errors.append(f"step number {step['step']}, expected {expected}")
    named = {e["request_id"] for e in step["scheduled"]}
    for queues in (step["queues_before"], step["queues_after"]):
        named.update(rid for ids in queues.values() for rid in ids)
    unknown = named - known
    if unknown:
        errors.append(f"request ids {sorted(unknown)} have no request line before this step")
    for e in step["scheduled"]:
        lengths = {len(e[k]) for k in ("token_ids", "positions", "slot_mapping")}
        if lengths != {e["num_tokens"]}:
            errors.append(
                f"seq {e['seq_id']}: num_tokens, token_ids, positions and slot_mapping "
                "disagree in length"
            )
    if sum(e["num_tokens"] for e in step["scheduled"]) != step["num_batched_tokens"]:
        errors.append("num_batched_tokens is not the sum of the scheduled num_tokens")
    missing = set(step["block_tables"]) - set(step["seqs"])
    if missing:
        errors.append(f"block_tables of seqs {sorted(missing)} that seqs does not list")
    return errors


def validate_trace(path: str | Path) -> int:
    """Raise ValueError naming the first bad line; returns the number of lines.

    A killed run's half-written last line is allowed (and not checked).
    """
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    validator = _validator()
    known: set[str] = set()
    num_steps = 0
    for number, text in enumerate(lines[:-1], start=1):
        line = json.loads(text)
        error = next(iter(validator.iter_errors(line)), None)
        if error is not None:
            where = "/".join(map(str, error.absolute_path)) or "the line"
            raise ValueError(f"{path}:{number}: {where}: {error.message}")
        if (number == 1) != (line["type"] == "header"):
            raise ValueError(f"{path}:{number}: the header is the first line and only that one")
        if line["type"] == "request":
            known.add(line["request_id"])
        elif line["type"] == "step":
            errors = _check_step(line, num_steps, known)
            if errors:
                raise ValueError(f"{path}:{number}: " + "; ".join(errors))
            num_steps += 1
    return len(lines) - 1
