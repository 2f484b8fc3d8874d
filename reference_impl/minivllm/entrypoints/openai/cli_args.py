"""The API server's command line (vLLM's `make_arg_parser`): the server's
own flags, then every engine option from `AsyncEngineArgs`, so any option of
`LLM(...)` is a flag here too (`--block-size 8`, `--enable-prefix-caching`)."""

from __future__ import annotations

import argparse
import json

from minivllm.engine.arg_utils import AsyncEngineArgs


def json_string_list(value: str) -> list[str]:
    """A flag's JSON list of strings, as vLLM reads --allowed-origins."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {value!r}") from e
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(
            f'a JSON list of strings is needed, like \'["*"]\', got {value!r}'
        )
    return parsed


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    server = parser.add_argument_group("server options")
    server.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for all, "
        "as vLLM's default)",
    )
    server.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) clients must send (default: --model as given, or "
        "'minivllm-stories' for the shipped model)",
    )
    server.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MINIVLLM_API_KEY, "
        "else none)",
    )
    # Cross-origin requests from browser pages (vLLM's flags and defaults: all allowed).
    for flag, what in (("--allowed-origins", "origins whose pages may call the server"),
                       ("--allowed-methods", "HTTP methods those pages may use"),
                       ("--allowed-headers", "request headers those pages may send")):
        server.add_argument(flag, type=json_string_list, default=["*"],
                            help=f'{what}, a JSON list (default: \'["*"]\': all)')
    server.add_argument(
        "--allow-credentials",
        action="store_true",
        help="allow cookies and HTTP authentication across origins",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file, or the template itself (default: the tokenizer's)",
    )
    server.add_argument(
        "--response-role",
        default="assistant",
        help="the role of the chat answers (default: assistant)",
    )
    server.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report the prompt tokens found in the prefix cache in each answer's usage "
        "(prompt_tokens_details.cached_tokens; the V1 engine counts them)",
    )
    server.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer every HTTP request with an X-Request-Id header: the one it sent, or a "
        "new random id",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="uvicorn's log level (default: info)",
    )
    return AsyncEngineArgs.add_cli_args(parser)
