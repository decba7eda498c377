"""One supervised child process: spawn, wait until ready, stop gracefully."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmmesh.waiting import poll_until

log = logging.getLogger(__name__)


class StackError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def spawn(
        cls,
        name: str,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        cwd: Path,
        *,
        append: bool = False,
    ) -> Child:
        """Starts ``command``; its output goes to ``log_path`` (after what is there, for
        a restart)."""
        with log_path.open("ab" if append else "wb") as out:
            # Own session: Ctrl-C in the terminal reaches only the launcher, which stops
            # children in order; and killing the group also reaches Triton's backend stubs.
            process = subprocess.Popen(
                _exit_with_parent(command),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=cwd,
            )
        return cls(name, process, log_path)

    @classmethod
    def service(
        cls,
        name: str,
        env: dict[str, str],
        log_path: Path,
        cwd: Path,
        module: str = "",
        *,
        append: bool = False,
    ) -> Child:
        """``python -m services.<module>`` (default: the name) with this interpreter."""
        command = [sys.executable, "-m", f"services.{module or name}"]
        return cls.spawn(name, command, env, log_path, cwd, append=append)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def check_alive(self) -> None:
        if not self.alive:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise StackError(f"{self.name} exited with code {self.process.returncode}:\n{tail}")

    def wait_until(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        """Waits for ``ready`` until it holds, the child dies, or ``deadline`` passes."""
        if not poll_until(ready, deadline - time.monotonic(), 0.1, give_up=self.check_alive):
            raise StackError(f"{self.name} did not {what} in time; see {self.log_path}")

    def wait_serving(self, address: str, deadline: float) -> None:
        with grpc.insecure_channel(address) as channel:
            stub: Any = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

            self.wait_until(serving, deadline, "report SERVING")

    def terminate(self, grace_s: float) -> None:
        """SIGTERM, up to ``grace_s`` to exit, then SIGKILL of whatever is left in its group."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", self.name, grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        # Killed grandchildren (Triton's backend stubs) are reaped by init; wait for that,
        # so that a stopped stack has no process left at all.
        if not poll_until(lambda: not process_group_exists(self.process.pid), 10.0):
            log.warning("processes of %s's group outlived SIGKILL", self.name)


def _exit_with_parent(command: list[str]) -> list[str]:
    """Has the child SIGTERMed when the launcher dies, even by SIGKILL, so a killed launcher
    never leaves a stack behind (PR_SET_PDEATHSIG, set by util-linux's setpriv)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *command] if setpriv else command


def process_group_exists(pgid: int) -> bool:
    """Whether any process (zombies included) is still in group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def free_ports(count: int, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> list[int]:
    """Distinct ports the OS reports free right now, none of ``exclude`` (ports handed
    out earlier that nothing listens on yet, which the OS would hand out again)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket())
            sock.bind((host, 0))  # held until the end: the OS will not hand it out twice
            port = sock.getsockname()[1]
            if port not in exclude:
                ports.append(port)
    return ports
