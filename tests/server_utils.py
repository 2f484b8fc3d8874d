"""A real API server for tests: a subprocess on 127.0.0.1 and a free port
(vLLM's tests have the same `RemoteOpenAIServer`).

It runs in its own process group with one CPU thread (OMP_NUM_THREADS=1),
and stopping it always ends the whole group: SIGTERM, then SIGKILL if it
has not exited in time, so no test leaves a server behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

# On the server's path too, so it can load test components by name.
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def num_successes(metrics: dict[str, float]) -> float:
    """Finished requests, all finish reasons, from `RemoteOpenAIServer.metrics()`."""
    return sum(v for k, v in metrics.items() if k.startswith("vllm:request_success_total"))


class RemoteOpenAIServer:
    """`python -m MODULE ARGS --host 127.0.0.1 --port PORT` (the api_server
    module, or the `minivllm` command's), started and waited for (GET
    /health); use as a context manager."""

    def __init__(
        self,
        args: list[str],
        module: str = "minivllm.entrypoints.openai.api_server",
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 180.0,
    ) -> None:
        """`command` replaces `python -m module` (an installed `minivllm`
        script); `env` replaces this process's environment (whose PYTHONPATH
        gets the repository, so the server can load test components)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="minivllm-server-", suffix=".log")
        if env is None:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env = {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env.pop("MINIVLLM_TRACE", None)
        env.pop("MINIVLLM_API_KEY", None)
        cmd = [*(command or [sys.executable, "-m", module]), *args]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not become healthy in {timeout} s:\n{self.output()}")

    def url_for(self, *parts: str) -> str:
        return "/".join([self.base_url, *parts])

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

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def send_signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the process group and wait; SIGKILL it if it hangs.
        Returns the exit status (negative: killed by that signal)."""
        if self.proc.poll() is None:
            try:
                self.send_signal(sig)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (nothing, normally)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()
