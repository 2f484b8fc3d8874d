"""What a valid trace file is, checked line by line as it is read.

`read_trace(path)` is the one way the tracer reads a trace: every view, and
`minivllm-trace validate`, goes through it. Each line must be strict JSON
(no NaN or Infinity), one object, valid against `trace_schema.json`, and
keep the rules between fields and lines that a JSON Schema cannot say
(SCHEMA.md, "Rules"). The first fault raises `TraceError` naming the file
and the line, so no view ever meets a field that is missing or of the
wrong type.

The JSON Schema is checked by a small compiler of the keywords the schema
uses (`_compile`), not by the `jsonschema` package: that takes about 3 ms a
step line, over a minute for a 20,000-step trace, too slow to run on every
load; this takes about a tenth of a millisecond, about what parsing the
line takes. It refuses any other keyword, so the schema cannot silently
outgrow it, and a test checks that it agrees with `jsonschema`. It is
stricter in one way: an integer must be written as one (`16`, not `16.0`),
as the views use integers as indices.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

from minivllm.tracer.errors import TraceError

SCHEMA_PATH = Path(__file__).with_name("trace_schema.json")
LINE_TYPES = ("header", "request", "step")
ENGINES = ("classic", "v1")
# A step line's definition in trace_schema.json, by the header's engine.
STEP_DEFS = {"classic": "step", "v1": "step_v1"}


# -- strict JSON ----------------------------------------------------------------------


class _Invalid(Exception):
    """A value that breaks the contract: `message` says how, as a predicate
    ("has no 'timings'"), `where` is the path to it, innermost key first."""

    def __init__(self, message: str, mismatched_type: bool = False) -> None:
        self.message, self.where = message, []
        self.mismatched_type = mismatched_type  # the value's JSON type is wrong


def _refuse_constant(name: str) -> float:
    # json.loads accepts NaN, Infinity and -Infinity, which are not JSON.
    raise _Invalid(
        f"the line has {name}, which is not JSON (a trace writes a number that is not finite "
        "as null)"
    )


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise _Invalid(f"the line has the number {text[:40]}, too large for a double")
    return value


def parse_line(text: str) -> Any:
    """One line as strict JSON; raises _Invalid saying what is wrong."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise _Invalid(f"not a JSON line ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise _Invalid("not a JSON line this tracer can read (nested too deeply)") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise _Invalid(f"not a JSON line this tracer can read ({e})") from None


# -- the JSON Schema, compiled ----------------------------------------------------------

Check = Callable[[Any], None]  # raises _Invalid

# JSON Schema's types as Python's: json.loads makes exactly these.
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}
_ANNOTATIONS = {"$schema", "title", "description", "$comment"}


def _describe(value: Any) -> str:
    """A value's JSON type, in words ("an array", "null")."""
    name = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if type(value) in (int, float):
        return f"the number {value!r}"
    return name.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _same(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, though Python says it is."""
    return (type(a) is bool) == (type(b) is bool) and a == b


def _scalar_check(node: dict[str, Any]) -> Check | None:
    """type, const, enum, minimum and pattern, in one function: most of a
    trace is numbers in arrays, checked by this alone."""
    if not {"type", "const", "enum", "minimum", "pattern"} & set(node):
        return None
    names = node.get("type")
    names = [names] if isinstance(names, str) else names
    accepted = None if names is None else frozenset(t for n in names for t in _TYPES[n])
    expected = None if names is None else " or ".join(names)
    allowed = [node["const"]] if "const" in node else node.get("enum")
    low = node.get("minimum")
    pattern = node.get("pattern")
    search = None if pattern is None else re.compile(pattern).search

    def check(v: Any) -> None:
        if accepted is not None and type(v) not in accepted:
            raise _Invalid(f"is {_describe(v)}, expected {expected}", mismatched_type=True)
        if allowed is not None and not any(_same(v, a) for a in allowed):
            raise _Invalid(f"is {_shown(v)}, expected {', '.join(map(_shown, allowed))}")
        if low is not None and type(v) in (int, float) and v < low:
            raise _Invalid(f"is {v!r}, expected at least {low}")
        if search is not None and type(v) is str and not search(v):
            raise _Invalid(f"is {_shown(v)}, which does not match {pattern}")

    return check


def _array_check(node: dict[str, Any], sub: Callable[[dict[str, Any]], Check]) -> Check | None:
    """minItems, maxItems, prefixItems and items."""
    if not {"minItems", "maxItems", "prefixItems", "items"} & set(node):
        return None
    low, high = node.get("minItems", 0), node.get("maxItems")
    prefix = [sub(child) for child in node.get("prefixItems", [])]
    rest = sub(node["items"]) if "items" in node else None

    def check(v: Any) -> None:
        if type(v) is not list:
            return
        if len(v) < low or (high is not None and len(v) > high):
            bound = f"at least {low}" if len(v) < low else f"at most {high}"
            raise _Invalid(f"has {len(v)} items, expected {bound}")
        i = 0
        try:
            for i, item_check in enumerate(prefix[: len(v)]):
                item_check(v[i])
            if rest is not None:
                for i in range(len(prefix), len(v)):
                    rest(v[i])
        except _Invalid as e:
            e.where.append(str(i))
            raise

    return check


def _object_check(node: dict[str, Any], sub: Callable[[dict[str, Any]], Check]) -> Check | None:
    """required, properties, additionalProperties and propertyNames."""
    if not {"required", "properties", "additionalProperties", "propertyNames"} & set(node):
        return None
    required = node.get("required", [])
    properties = {k: sub(child) for k, child in node.get("properties", {}).items()}
    additional = node.get("additionalProperties", True)
    if isinstance(additional, dict):
        additional = sub(additional)
    names = sub(node["propertyNames"]) if "propertyNames" in node else None

    def check(v: Any) -> None:
        if type(v) is not dict:
            return
        for key in required:
            if key not in v:
                raise _Invalid(f"has no {key!r}")
        for key, value in v.items():
            if names is not None:
                try:
                    names(key)
                except _Invalid as e:
                    raise _Invalid(f"has a key that {e.message}") from None
            own = properties.get(key, additional)
            if own is False:
                raise _Invalid(f"has an unknown field {key!r}")
            if own is not True:
                try:
                    own(value)
                except _Invalid as e:
                    e.where.append(key)
                    raise

    return check


def _one_of_check(branches: list[Check]) -> Check:
    def check(v: Any) -> None:
        errors, passed = [], 0
        for branch in branches:
            try:
                branch(v)
                passed += 1
            except _Invalid as e:
                errors.append(e)
        if passed == 1:
            return
        if passed > 1:
            raise _Invalid("matches more than one of its allowed forms")
        # Report the branch of the value's own type, if one is.
        for e in errors:
            if not (e.mismatched_type and not e.where):
                raise e
        alternatives = " or ".join(e.message.split(", expected ")[-1] for e in errors)
        raise _Invalid(f"is {_describe(v)}, expected {alternatives}", mismatched_type=True)

    return check


def _compile(node: dict[str, Any], defs: dict[str, Any], done: dict[str, Check]) -> Check:
    """The check of one schema node. The type comes first, so the checks
    after it can skip values of other types, as JSON Schema's keywords do."""
    unknown = set(node) - _KEYWORDS - _ANNOTATIONS
    if unknown:
        raise NotImplementedError(
            f"trace_schema.json uses {sorted(unknown)}, which minivllm/tracer/schema.py does not "
            "implement: add them to _compile"
        )

    def sub(child: dict[str, Any]) -> Check:
        return _compile(child, defs, done)

    checks: list[Check | None] = []
    if "$ref" in node:
        name = node["$ref"].removeprefix("#/$defs/")
        if name not in done:
            done[name] = sub(defs[name])
        checks.append(done[name])
    checks += [_scalar_check(node), _array_check(node, sub), _object_check(node, sub)]
    if "oneOf" in node:
        checks.append(_one_of_check([sub(child) for child in node["oneOf"]]))
    present = [c for c in checks if c is not None]
    if len(present) == 1:
        return present[0]

    def check(v: Any) -> None:
        for c in present:
            c(v)

    return check


_KEYWORDS = set(
    "$ref type const enum minimum pattern minItems maxItems prefixItems items required "
    "properties additionalProperties propertyNames oneOf".split()
)


@cache
def contract() -> dict[str, Any]:
    """trace_schema.json, as read."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


# The version this tracer reads: the header's `const` in the contract, not a
# number of its own. The engine writes its SCHEMA_VERSION
# (minivllm/engine/trace_writer.py; the engine never imports the tracer), and
# a test checks the two agree. Importing it from the engine instead would load
# torch (seconds) into every `minivllm-trace show`.
SCHEMA_VERSION: int = contract()["$defs"]["header"]["properties"]["schema_version"]["const"]


@cache
def line_checks() -> dict[str, Check]:
    """Definition name -> the check of `$defs/<name>` in trace_schema.json,
    for each line type and each engine's step ("step", "step_v1"); "step?"
    is either step, as the schema's top level ("one of" them all) says.
    Dispatching on `type` (and the header's engine) gives the error of the
    line's own kind rather than "none of four matched"."""
    defs, done = contract()["$defs"], {}
    names = ("header", "request", *STEP_DEFS.values())
    checks = {name: _compile({"$ref": f"#/$defs/{name}"}, defs, done) for name in names}
    checks["step?"] = _one_of_check([checks[name] for name in STEP_DEFS.values()])
    return checks


def check_line(line: Any, engine: str | None = None) -> None:
    """Check one parsed line against the JSON Schema; raises _Invalid. A
    step line is checked as a step of `engine` (the header's), or as either
    kind when it is None, as the schema alone does."""
    if type(line) is not dict:
        raise _Invalid(f"the line is {_describe(line)}, not an object: a line is one JSON object")
    kind = line.get("type")
    if kind not in LINE_TYPES:
        got = "no 'type'" if "type" not in line else f"type {_shown(kind)}"
        raise _Invalid(f"the line has {got}; a line's type is 'header', 'request' or 'step'")
    name = kind if kind != "step" else STEP_DEFS.get(engine, "step?")
    try:
        line_checks()[name](line)
    except _Invalid as e:
        where = "/".join(reversed(e.where))
        e.message = f"{kind} line: {where} {e.message}" if where else f"{kind} line {e.message}"
        raise


# -- the rules between fields and lines ------------------------------------------------


class _Rules:
    """What SCHEMA.md's "Rules" ask of a trace, checked line by line."""

    def __init__(self) -> None:
        self.header: dict[str, Any] | None = None
        self.known: set[str] = set()  # request ids with a request line so far
        self.num_steps = 0

    def check(self, number: int, line: dict[str, Any]) -> list[str]:
        kind = line["type"]
        if (number == 1) != (kind == "header"):
            return ["the header is the first line, and only the first line"]
        if kind == "header":
            self.header = line
            return []
        if kind == "request":
            self.known.add(line["request_id"])
            if line["arrival_step"] != self.num_steps:
                return [
                    f"arrival_step {line['arrival_step']}, but {self.num_steps} step lines "
                    "come before it"
                ]
            return []
        errors = self.check_step(line)
        self.num_steps += 1
        return errors

    @property
    def engine(self) -> str | None:
        return None if self.header is None else self.header["engine"]

    def check_step(self, step: dict[str, Any]) -> list[str]:
        errors = []
        if step["step"] != self.num_steps:
            errors.append(f"step number {step['step']}, expected {self.num_steps}")
        unknown = _request_ids(step) - self.known
        if unknown:
            errors.append(f"request ids {sorted(unknown)} have no request line before this step")
        errors += _batch_errors(step)
        if self.engine == "v1":
            return errors + self.v1_errors(step)
        for field in ("block_tables", "sampled"):
            missing = set(step[field]) - set(step["seqs"])
            if missing:
                errors.append(f"{field} names seqs {sorted(map(int, missing))} that seqs lacks")
        errors += self.pool_errors(step)
        return errors

    def v1_errors(self, step: dict[str, Any]) -> list[str]:
        assert self.header is not None
        return _v1_errors(step, self.header["cache_config"]["num_gpu_blocks"])

    def pool_errors(self, step: dict[str, Any]) -> list[str]:
        """Blocks index their pool: no block number or free count beyond it."""
        assert self.header is not None
        cache = self.header["cache_config"]
        size = {"gpu": cache["num_gpu_blocks"], "cpu": cache["num_cpu_blocks"]}
        errors = [
            f"free_blocks.{pool} is {step['free_blocks'][pool]}, more than the {size[pool]} "
            "blocks of the pool"
            for pool in ("gpu", "cpu")
            if step["free_blocks"][pool] > size[pool]
        ]
        for seq_id, table in step["block_tables"].items():
            seq = step["seqs"].get(seq_id)
            pool = "cpu" if seq is not None and seq["status"] == "swapped" else "gpu"
            beyond = [b for b in table if b >= size[pool]]
            if beyond:
                errors.append(
                    f"seq {seq_id}'s block table has {pool} blocks {beyond}, beyond the "
                    f"{size[pool]} of its pool"
                )
        return errors


def _v1_errors(step: dict[str, Any], num_gpu_blocks: int) -> list[str]:
    """SCHEMA.md's rules for a V1 step line."""
    errors = []
    listed = [r["request_id"] for r in step["requests"]]
    if len(set(listed)) != len(listed):
        errors.append("requests lists a request more than once")
    batch = [e["request_id"] for e in step["scheduled"]]
    if len(set(batch)) != len(batch):
        errors.append("scheduled lists a request more than once")
    for field in ("block_tables", "sampled"):
        missing = set(step[field]) - set(listed)
        if missing:
            errors.append(f"{field} names requests {sorted(missing)} that requests lacks")
    for e in step["scheduled"]:
        start = e["num_computed_tokens"]
        if e["positions"] != list(range(start, start + e["num_tokens"])):
            errors.append(
                f"request {e['request_id']}: positions are not num_computed_tokens onwards"
            )
    queue, cached = step["free_queue"]["block_ids"], step["free_queue"]["cached"]
    if len(queue) != step["free_blocks"]["gpu"]:
        free = step["free_blocks"]["gpu"]
        errors.append(f"free_queue holds {len(queue)} blocks, free_blocks.gpu says {free}")
    if len(set(queue)) != len(queue):
        errors.append("free_queue holds a block more than once")
    in_queue = set(queue)
    if [b for b in queue if b in set(cached)] != cached:
        errors.append("free_queue.cached is not a subsequence of free_queue.block_ids")
    if any(b >= num_gpu_blocks for b in queue):
        errors.append(f"free_queue holds blocks beyond the {num_gpu_blocks} of the pool")
    for rid, table in step["block_tables"].items():
        beyond = [b for b in table if b >= num_gpu_blocks]
        if beyond:
            errors.append(
                f"request {rid}'s block table has blocks {beyond}, beyond the "
                f"{num_gpu_blocks} of the pool"
            )
        both = sorted(in_queue.intersection(table))
        if both:
            errors.append(f"request {rid}'s block table has blocks {both} of the free queue")
    return errors


def _request_ids(step: dict[str, Any]) -> set[str]:
    """Every request id a step line names."""
    named = {e["request_id"] for e in step["scheduled"]}
    for queues in (step["queues_before"], step["queues_after"]):
        named.update(rid for ids in queues.values() for rid in ids)
    named.update(p["request_id"] for p in step["preempted"])
    named.update(f["request_id"] for f in step["finished"])
    if "seqs" in step:  # the classic engine's step
        named.update(seq["request_id"] for seq in step["seqs"].values())
        named.update(step["ignored"])
    else:  # V1's
        named.update(r["request_id"] for r in step["requests"])
        named.update(step["block_tables"])
        named.update(step["sampled"])
    return named


def _batch_errors(step: dict[str, Any]) -> list[str]:
    errors = []
    for e in step["scheduled"]:
        lengths = {len(e[k]) for k in ("token_ids", "positions", "slot_mapping")}
        if lengths != {e["num_tokens"]}:
            who = f"seq {e['seq_id']}" if "seq_id" in e else f"request {e['request_id']}"
            errors.append(
                f"{who}: num_tokens, token_ids, positions and slot_mapping disagree in length"
            )
    if sum(e["num_tokens"] for e in step["scheduled"]) != step["num_batched_tokens"]:
        errors.append("num_batched_tokens is not the sum of the scheduled num_tokens")
    return errors


# -- reading a file -----------------------------------------------------------------


def _raw_lines(path: Path) -> Iterator[bytes]:
    """The file's lines, each with its newline; a last one without is cut short."""
    if path.is_dir():
        raise TraceError(path, None, "is a directory, not a trace file")
    try:
        with path.open("rb") as f:
            yield from f
    except FileNotFoundError:
        raise TraceError(path, None, "no such file") from None
    except OSError as e:
        raise TraceError(path, None, f"cannot be read ({e.strerror or e})") from None


def _header_errors(line: Any) -> str | None:
    """What is wrong with a first line, said before the schema's details."""
    if type(line) is dict and line.get("type") == "header":
        version = line.get("schema_version")
        if version != SCHEMA_VERSION:
            return f"schema_version {_shown(version)}, this tracer reads version {SCHEMA_VERSION}"
        return None
    if type(line) is dict and line.get("type") in LINE_TYPES:
        return f"a trace starts with its header line, this is a {line['type']} line"
    return None


def read_trace(path: str | Path) -> tuple[list[dict[str, Any]], bool]:
    """Every line of a trace file, checked; and whether the last line was cut
    short (a killed run: it is dropped, every complete line before it kept).
    Raises TraceError at the first fault, naming the file and the line."""
    path = Path(path)
    rules, lines, truncated = _Rules(), [], False
    for number, raw in enumerate(_raw_lines(path), start=1):
        if not raw.endswith(b"\n"):
            truncated = True
            break
        try:
            line = parse_line(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise TraceError(path, number, f"is not UTF-8 text (byte {e.start + 1})") from None
        except _Invalid as e:
            raise TraceError(path, number, e.message) from None
        problem = _header_errors(line) if number == 1 else None
        if problem:
            raise TraceError(path, number, problem)
        try:
            check_line(line, rules.engine)
        except _Invalid as e:
            raise TraceError(path, number, e.message) from None
        errors = rules.check(number, line)
        if errors:
            raise TraceError(path, number, "; ".join(errors))
        lines.append(line)
    if not lines:
        why = "its only line is cut short" if truncated else "the file is empty"
        raise TraceError(path, None, f"not a trace: no header line ({why})")
    return lines, truncated


def validate_trace(path: str | Path) -> int:
    """Check a whole trace; returns its number of complete lines. A killed
    run's half-written last line is allowed (and not checked)."""
    return len(read_trace(path)[0])
