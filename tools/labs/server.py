"""A real `minivllm` API server for a lab notebook: a subprocess on
127.0.0.1 and a free port, in its own process group, always stopped (the
notebook's last cell, or `with LabServer() as server:`).

The tests' `RemoteOpenAIServer` (tests/server_utils.py) extends it;
notebooks do not import from tests/.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


API_SERVER = "minivllm.entrypoints.openai.api_server"


class LabServer:
    """`python -m minivllm.entrypoints.openai.api_server ARGS` on 127.0.0.1,
    waited for (GET /health). `stop()` ends the whole process group.

    `command` replaces `python -m <api_server>` (the tests start `minivllm
    serve` this way); `env` replaces this process's environment.
    """

    def __init__(
        self,
        args: list[str] = (),
        startup_timeout: float = 180.0,
        *,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="minivllm-server-", suffix=".log")
        env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        env.pop("MINIVLLM_TRACE", None)
        env.pop("MINIVLLM_API_KEY", None)
        cmd = [*(command or [sys.executable, "-m", API_SERVER]), *args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        atexit.register(self.stop)  # a kernel that exits never leaves the server behind
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
                if httpx.get(self.url("health"), timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not become healthy in {timeout} s:\n{self.output()}")

    def url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}"

    def output(self) -> str:
        """The server's log so far."""
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def send_signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the process group (SIGTERM), SIGKILL it if it hangs;
        returns the exit status (negative: killed by that signal)."""
        if self.proc.poll() is None:
            try:
                self.send_signal(sig)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:  # whatever is left of the group (nothing, normally)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> LabServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
