"""`minivllm-trace`: record a trace, then look at it.

    minivllm-trace run admission_blocked --dry-run -o run.jsonl
    minivllm-trace run -p "Once upon a time" -p "The cat" --max-tokens 20
    minivllm-trace run prefix_cache -e use_v1=true -e max_model_len=256   (on V1)
    minivllm-trace show run.jsonl [--step 3 | --steps 100:200]
    minivllm-trace render run.jsonl --step 3 -o step3.svg   (or .png, .pdf)
    minivllm-trace render run.jsonl -o steps.html [--steps 100:200]
    minivllm-trace timeline run.jsonl -o timeline.png       (or .json for Perfetto)
    minivllm-trace summary run.jsonl
    minivllm-trace validate run.jsonl
    minivllm-trace scenarios

Also `python -m minivllm.tracer ...`. The views that
draw every step take at most MAX_STEPS_AT_ONCE (2,000) unless `--steps A:B`
(steps A to B-1) says which.

Every trace is read by one path (`schema.read_trace`), which refuses a file
that is not a valid trace with `TraceError` naming the file and the line;
`main` prints the tracer's errors in one line and exits with 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

import yaml

from minivllm.tracer.errors import TracerError
from minivllm.tracer.trace import MAX_STEPS_AT_ONCE, load_trace, step_range

# What `render` and `timeline` need beyond the package's own dependencies.
TRACE_EXTRA = ("graphviz", "matplotlib")


def _default_model() -> str:
    try:
        from minivllm.assets import DEFAULT_MODEL
    except ImportError:
        DEFAULT_MODEL = None
    if DEFAULT_MODEL is None or not os.path.isdir(DEFAULT_MODEL):
        raise TracerError(
            "the shipped model (minivllm.assets.DEFAULT_MODEL) is not "
            "installed here; pass --model DIR (any Hugging Face checkpoint directory)"
        )
    return DEFAULT_MODEL


def _engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"{text!r}: VALUE is not a YAML value") from None


def _resolve_scenario(name: str) -> Path:
    from minivllm.tracer.scenario import SCENARIO_DIR, shipped_scenarios

    path = Path(name)
    if path.is_file():
        return path
    shipped = SCENARIO_DIR / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    names = ", ".join(p.stem for p in shipped_scenarios())
    raise TracerError(f"no scenario file {name!r}; shipped scenarios: {names}")


def cmd_run(args: argparse.Namespace) -> None:
    from minivllm.tracer.scenario import Scenario, check_claims, load_scenario, run_scenario

    if args.scenario and args.prompt:
        raise TracerError("run takes a scenario or --prompt, not both")
    if args.scenario:
        scenario = load_scenario(_resolve_scenario(args.scenario))
    elif args.prompt:
        requests = [{"prompt": p, "max_tokens": args.max_tokens} for p in args.prompt]
        scenario = Scenario("prompts", "", {}, requests)
    else:
        raise TracerError("run needs a scenario (a file or a shipped name) or --prompt TEXT")
    model = args.model or _default_model()
    steps = run_scenario(
        scenario, args.output, model, args.dry_run, dict(args.engine_arg), args.max_steps
    )
    trace = load_trace(args.output)
    kind = " (dry run)" if args.dry_run else ""
    print(f"wrote {args.output}: {steps} steps, {len(trace.requests)} requests{kind}")
    claims = check_claims(scenario, trace)
    for claim, where in claims.items():
        print(f"  {claim}: {where or 'NOT SHOWN by this run'}")
    missing = [claim for claim, where in claims.items() if where is None]
    if missing:
        # The trace is written and worth a look, but the run failed its purpose.
        raise TracerError(
            f"the scenario claims {', '.join(missing)}, which this run does not show "
            f"(see minivllm-trace show {args.output}); a different model or engine option "
            "can change what happens"
        )
    print(f"next: minivllm-trace show {args.output}")


def cmd_show(args: argparse.Namespace) -> None:
    from minivllm.tracer.show import show

    if args.step is not None and args.steps is not None:
        raise TracerError("show takes --step N (one step in full) or --steps A:B, not both")
    trace = load_trace(args.trace)
    if args.step is not None:
        show(trace, args.step)
    else:
        show(trace, steps=step_range(trace, args.steps, "show"))


def cmd_render(args: argparse.Namespace) -> None:
    from minivllm.tracer.notebook import trace_page
    from minivllm.tracer.render import check_image_format, render_step

    out = Path(args.output)
    if out.suffix == ".html":
        if args.step is not None:
            raise TracerError("-o FILE.html draws a range of steps: --steps A:B, not --step N")
        trace = load_trace(args.trace)
        steps = step_range(trace, args.steps, "render -o FILE.html")
        out.write_text(trace_page(trace, title=str(args.trace), steps=steps), encoding="utf-8")
    elif args.step is None or args.steps is not None:
        raise TracerError("render draws one step as an image (--step N), or -o FILE.html for steps")
    else:
        check_image_format(out)
        trace = load_trace(args.trace)
        trace.step(args.step)  # a clear error for a step the trace lacks
        render_step(trace, args.step, out)
    print(f"wrote {out}")


def cmd_timeline(args: argparse.Namespace) -> None:
    from minivllm.tracer.timeline import check_timeline_format, write_timeline

    check_timeline_format(args.output)
    trace = load_trace(args.trace)
    steps = step_range(trace, args.steps, "timeline")
    print(f"wrote {write_timeline(trace, args.output, steps)}")


def cmd_summary(args: argparse.Namespace) -> None:
    from minivllm.tracer.summary import summary

    summary(load_trace(args.trace))


def cmd_validate(args: argparse.Namespace) -> None:
    from minivllm.tracer.schema import read_trace

    lines, truncated = read_trace(args.trace)
    cut = " (and a half-written last line, left out)" if truncated else ""
    print(f"{args.trace}: {len(lines)} lines, valid{cut}")


def cmd_scenarios(args: argparse.Namespace) -> None:
    from minivllm.tracer.scenario import load_scenario, shipped_scenarios

    for path in shipped_scenarios():
        scenario = load_scenario(path)
        print(scenario.name)
        print(textwrap.indent(textwrap.fill(scenario.description, width=84), "    "))
        print(f"    shows: {', '.join(scenario.shows)}\n")


def _steps_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps",
        metavar="A:B",
        help=f"only steps A to B-1 (A: and :B leave an end open); needed above "
        f"{MAX_STEPS_AT_ONCE} steps",
    )


def _check_output(path: str) -> None:
    """An output file must be writable where it is named, before any work."""
    out = Path(path)
    if out.is_dir():
        raise TracerError(f"{out} is a directory; -o names the file to write")
    if not out.parent.is_dir():
        raise TracerError(f"{out}: no directory {out.parent} to write it in")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minivllm-trace", description="Record and view traces of the minivllm engine."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="play a scenario or prompts into a trace")
    run.add_argument("scenario", nargs="?", help="scenario file, or a shipped scenario's name")
    run.add_argument("-p", "--prompt", action="append", help="a prompt (repeat for more)")
    run.add_argument("--max-tokens", type=int, default=16, help="per prompt (default 16)")
    run.add_argument("-o", "--output", default="trace.jsonl", help="default trace.jsonl")
    run.add_argument("--model", help="checkpoint directory (default: the shipped model)")
    run.add_argument("--dry-run", action="store_true", help="no model: pseudo-random tokens")
    run.add_argument(
        "-e",
        "--engine-arg",
        type=_engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine option, over the scenario's (repeatable)",
    )
    run.add_argument("--max-steps", type=int, default=100_000)
    run.set_defaults(func=cmd_run)

    show = sub.add_parser("show", help="the trace in the terminal")
    show.add_argument("trace")
    show.add_argument("--step", type=int, help="one step in full (default: all, one row each)")
    _steps_option(show)
    show.set_defaults(func=cmd_show)

    render = sub.add_parser("render", help="a step's block diagram (Graphviz)")
    render.add_argument("trace")
    render.add_argument("--step", type=int, help="the step an image shows")
    render.add_argument(
        "-o", "--output", required=True, help=".svg, .png, .pdf: one step; .html: every step"
    )
    _steps_option(render)
    render.set_defaults(func=cmd_render)

    timeline = sub.add_parser("timeline", help="every request's lifecycle")
    timeline.add_argument("trace")
    timeline.add_argument("-o", "--output", required=True, help=".png, or .json for Perfetto")
    _steps_option(timeline)
    timeline.set_defaults(func=cmd_timeline)

    summary = sub.add_parser("summary", help="per-request and total figures")
    summary.add_argument("trace")
    summary.set_defaults(func=cmd_summary)

    validate = sub.add_parser("validate", help="check a trace against the schema")
    validate.add_argument("trace")
    validate.set_defaults(func=cmd_validate)

    scenarios = sub.add_parser("scenarios", help="list the shipped scenarios")
    scenarios.set_defaults(func=cmd_scenarios)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "output", None):
            _check_output(args.output)
        args.func(args)
    except TracerError as e:  # anything else is a bug: its traceback shows where
        print(f"minivllm-trace {args.command}: error: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        if e.name not in TRACE_EXTRA:
            raise
        print(
            f"minivllm-trace {args.command}: error: needs the Python package {e.name}, "
            "which the `trace` extra installs: pip install 'minivllm[trace]'",
            file=sys.stderr,
        )
        return 1
    return 0
