"""The `minivllm` command (vLLM's `vllm` command): `minivllm serve [MODEL]`
starts the OpenAI-compatible server on MODEL (default: the shipped story
model), with every server and engine flag of the api_server module."""

from __future__ import annotations

import argparse

from minivllm.entrypoints.openai.api_server import serve
from minivllm.entrypoints.openai.cli_args import make_arg_parser


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="minivllm's commands")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser(
        "serve",
        help="start the OpenAI-compatible API server",
        description="Start the OpenAI-compatible API server (minivllm serve [MODEL] [flags]).",
    )
    serve_parser.add_argument(
        "model_tag", nargs="?", default=None, help="the model (default: the shipped story model)"
    )
    make_arg_parser(serve_parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model not in (None, args.model_tag):
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    serve(args)


if __name__ == "__main__":
    main()
