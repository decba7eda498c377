"""The commands a user types: `llm-mesh up`, `llm-mesh generate`, as subprocesses."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmmesh.client import authorized_channel, internal_channel
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import StackError, process_group_exists
from llmmesh.runtime.internal_auth import read_token
from llmmesh.v1 import context_pb2, context_pb2_grpc
from tests.conftest import collect, wait_for

CLI = [sys.executable, "-m", "llmmesh.cli"]


def generate(
    *args: str, timeout_s: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "generate", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    workdir = tmp_path_factory.mktemp("up")
    state = workdir / "state.json"
    process = subprocess.Popen(
        [
            *CLI,
            "up",
            "--free-ports",
            "--demo",
            "--models",
            "llm",  # the tiny model: Triton is killed and started again here
            "--context-store",
            "redis",  # so that Redis is supervised too
            "--workdir",
            str(workdir),
            "--state-file",
            str(state),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: state.exists() or process.poll() is not None, 180, "llm-mesh up")
        assert process.poll() is None, process.communicate()[0]
        yield process, state
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()  # its children follow it (they exit with their parent)
                process.wait()


def test_up_writes_every_endpoint_to_the_state_file(
    up: tuple[subprocess.Popen[str], Path],
) -> None:
    state = json.loads(up[1].read_text())
    expected = {
        "router",
        "inference",
        "inference_canary",
        "policy",
        "context",
        "triton_grpc",
        "triton_http",
        "triton_metrics",
    }
    assert expected <= set(state)
    for name in expected:
        host, port = state[name].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    assert "split:" in Path(state["routing_file"]).read_text()
    assert state["api_key"].startswith("llmm-")


def test_generate_streams_and_prints_ttft_and_rate(up: tuple[subprocess.Popen[str], Path]) -> None:
    # The state file gives the router's address and the demo tenant's key.
    # Greedy: random sampling may produce bytes that are not UTF-8, which the byte-level
    # tokenizer counts as tokens but the text shows as replacement characters.
    state = str(up[1])
    result = generate(
        "Once upon a time", "--max-tokens", "64", "--temperature", "0", "--state-file", state
    )
    assert result.returncode == 0, result.stderr
    completion_tokens = int(result.stderr.split(" tokens,")[0].rsplit(" ", 1)[-1])
    assert len(result.stdout.removesuffix("\n")) == completion_tokens > 0
    assert "TTFT" in result.stderr and "tokens/s" in result.stderr


def test_the_local_stack_has_a_canary_that_a_color_reaches(
    up: tuple[subprocess.Popen[str], Path],
) -> None:
    state = str(up[1])
    default = generate("Hello", "--max-tokens", "4", "--state-file", state)
    assert "served by stable@local" in default.stderr, default.stderr
    colored = generate("Hello", "--max-tokens", "4", "--color", "canary", "--state-file", state)
    assert "served by canary@local" in colored.stderr, colored.stderr


def test_generate_errors_exit_nonzero_with_the_status(
    up: tuple[subprocess.Popen[str], Path],
) -> None:
    state = json.loads(up[1].read_text())
    bad = generate("hi", "--max-tokens", "0", "--top-p", "7", "--state-file", str(up[1]))
    assert bad.returncode == 1
    assert "INVALID_ARGUMENT: sampling.top_p" in bad.stderr
    assert "Traceback" not in bad.stderr
    penalty = generate("hi", "--frequency-penalty", "3", "--state-file", str(up[1]))
    assert penalty.returncode == 1
    assert "INVALID_ARGUMENT: sampling.frequency_penalty" in penalty.stderr
    # The key from the environment wins over the state file's; a wrong one is refused.
    wrong = generate("hi", "--router", state["router"], env={"LLM_MESH_API_KEY": "wrong"})
    assert wrong.returncode == 1
    assert "UNAUTHENTICATED" in wrong.stderr
    down = generate("hi", "--router", "127.0.0.1:1", "--timeout", "5")
    assert down.returncode == 1
    assert "UNAVAILABLE" in down.stderr


def _serves(state: dict[str, object]) -> bool:
    """One short generation through the router succeeds."""
    try:
        with authorized_channel(str(state["router"]), str(state["api_key"])) as channel:
            return bool(collect(channel, "hi", timeout_s=10, max_tokens=2)[-1].finish_reason)
    except grpc.RpcError:
        return False


# Killed in this order: the front door, the stateless services, the one with the
# sessions and their store, the inference service, and Triton with its model stubs.
@pytest.mark.parametrize("name", ["router", "policy", "context", "redis", "inference", "triton"])
def test_a_killed_process_is_restarted_and_the_stack_serves_again(
    up: tuple[subprocess.Popen[str], Path], name: str
) -> None:
    process, state_file = up
    before = json.loads(state_file.read_text())
    told = generate("remember me", "--session", f"before-{name}", "--state-file", str(state_file))
    assert told.returncode == 0, told.stderr
    pid = before["pids"][name]
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        state = json.loads(state_file.read_text())
        return bool(state["pids"][name] != pid and state.get("restarts", {}).get(name))

    wait_for(restarted, 120, f"{name} restarted")
    assert process.poll() is None  # the stack did not stop
    # Nothing of the old process is left: for Triton, its backend stubs went with it.
    assert not process_group_exists(pid)
    state = json.loads(state_file.read_text())
    wait_for(lambda: _serves(state), 60, "the stack serving again")
    # The turn acknowledged before the kill is still in its session.
    token = read_token(state_file.parent / "internal_token")
    with internal_channel(str(state["context"]), token) as channel:
        session = context_pb2_grpc.ContextStub(channel).LoadSession(
            context_pb2.LoadSessionRequest(tenant="demo", session_id=f"before-{name}"), timeout=10
        )
    user, assistant = session.turns
    assert (user.role, user.text) == (context_pb2.ROLE_USER, "remember me")
    assert assistant.role == context_pb2.ROLE_ASSISTANT


def test_ctrl_c_stops_everything_and_leaves_no_process(
    up: tuple[subprocess.Popen[str], Path],
) -> None:
    process, state_file = up
    pids = json.loads(state_file.read_text())["pids"]
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=90)
    assert process.returncode == 0, output
    assert "demo:" in output and "TTFT" in output
    assert not state_file.exists()
    # Triton stopped because its streams were done, not because its exit timeout expired.
    assert "Exit timeout expired" not in (state_file.parent / "logs" / "triton.log").read_text()
    for name, pid in pids.items():
        # Each child led its own process group; Triton's backend stubs lived in Triton's.
        assert not process_group_exists(pid), f"a process of {name}'s group is still running"


def test_up_refuses_ports_in_use(stack: Stack, tmp_path: Path) -> None:
    ports = dataclasses.replace(StackPorts.free(), router=stack.ports.router)
    with pytest.raises(StackError, match=f"router \\(127.0.0.1:{stack.ports.router}\\)"):
        Stack(tmp_path, ports).start()
