"""A real API server for tests: a subprocess on 127.0.0.1 and a free port
(vLLM's tests have the same `RemoteOpenAIServer`).

It runs in its own process group with one CPU thread (OMP_NUM_THREADS=1),
and stopping it always ends the whole group: SIGTERM, then SIGKILL if it
has not exited in time, so no test leaves a server behind.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tools.labs.server import API_SERVER, LabServer

# On the server's path too, so it can load test components by name.
REPO = Path(__file__).resolve().parent.parent


def num_successes(metrics: dict[str, float]) -> float:
    """Finished requests, all finish reasons, from `RemoteOpenAIServer.metrics()`."""
    return sum(v for k, v in metrics.items() if k.startswith("vllm:request_success_total"))


class RemoteOpenAIServer(LabServer):
    """`python -m MODULE ARGS --host 127.0.0.1 --port PORT` (the api_server
    module, or the `minivllm` command's), started and waited for (GET
    /health); use as a context manager."""

    def __init__(
        self,
        args: list[str],
        module: str = API_SERVER,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 180.0,
    ) -> None:
        """`command` replaces `python -m module` (an installed `minivllm`
        script); `env` replaces this process's environment (whose PYTHONPATH
        gets the repository, so the server can load test components)."""
        if env is None:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        super().__init__(
            args, startup_timeout, command=command or [sys.executable, "-m", module], env=env
        )

    def url_for(self, *parts: str) -> str:
        return self.url("/".join(parts))

    def get_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url_for("v1"), max_retries=0, timeout=120, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), max_retries=0, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name{labels}: value}, through prometheus_client's parser."""
        text = httpx.get(self.url_for("metrics"), timeout=10).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
                )
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values
        self.log.close()
