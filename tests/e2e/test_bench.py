"""`llm-mesh bench` against the real stack: both targets, both load shapes, JSON results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmmesh.cli import main
from llmmesh.launcher import Stack


def test_compare_in_closed_loop_writes_results_and_markdown(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLM_MESH_API_KEY", stack.api_key)
    out, doc = tmp_path / "results.json", tmp_path / "bench.md"
    doc.write_text("# Bench\n\nintro\n")
    code = main(
        [
            "bench",
            "--compare",
            "--router",
            stack.address("router"),
            "--triton",
            stack.address("triton_grpc"),
            "--concurrency",
            "1,2",
            "--num-prompts",
            "4",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--warmup",
            "1",
            "--no-progress",
            "--out",
            str(out),
            "--markdown",
            str(doc),
            "--section",
            "t",
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    runs = {(r["target"], r["load"]): r["summary"] for r in results["runs"]}
    assert set(runs) == {(t, f"concurrency {c}") for t in ("triton", "router") for c in (1, 2)}
    for summary in runs.values():
        assert summary["failed"] == 0
        assert summary["output_tokens"] == 4 * 8
        assert 0 < summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]
    text = doc.read_text()
    assert text.startswith("# Bench\n\nintro\n")
    assert "<!-- bench:t:start -->" in text and "output tok/s ratio" in text


def test_poisson_arrivals_against_the_router(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLM_MESH_API_KEY", stack.api_key)
    out = tmp_path / "rate.json"
    code = main(
        [
            "bench",
            "--target",
            "router",
            "--router",
            stack.address("router"),
            "--rate",
            "20",
            "--num-prompts",
            "6",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--warmup",
            "0",
            "--shared-prefix-len",
            "8",
            "--prefix-groups",
            "2",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["load"] == "rate 20.0/s"
    assert run["summary"]["requests"] == 6 and run["summary"]["failed"] == 0


def test_paired_triton_with_a_new_stream_per_request_against_streams_kept(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "bench",
            "--scenario",
            "paired",
            "--target",
            "triton-new-streams",
            "--target",
            "triton",
            "--triton",
            stack.address("triton_grpc"),
            "--num-prompts",
            "6",
            "--output-len",
            "4",
            "--no-progress",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| triton-new-streams | 6 |" in table and "| triton | 6 |" in table


def test_paired_router_calls_against_generations_on_one_stream(
    stack: Stack, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLM_MESH_API_KEY", stack.api_key)
    code = main(
        [
            "bench",
            "--scenario",
            "paired",
            "--target",
            "router",
            "--target",
            "router-stream",
            "--router",
            stack.address("router"),
            "--num-prompts",
            "6",
            "--output-len",
            "4",
            "--no-progress",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| router | 6 |" in table and "| router-stream | 6 |" in table


def test_the_router_to_triton_target_needs_a_stack_of_its_own(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLM_MESH_API_KEY", stack.api_key)
    with pytest.raises(SystemExit, match="router-triton needs --start-stack"):
        main(["bench", "--target", "router-triton", "--num-prompts", "1", "--no-progress"])


def test_a_router_to_triton_beside_the_stack_serves_and_is_metered_as_the_router(
    stack: Stack,
) -> None:
    from bench.stacks import router_to_triton, stack_meter
    from llmmesh.client import authorized_channel
    from tests.conftest import collect

    with router_to_triton(stack) as (address, router):
        with authorized_channel(address, stack.api_key) as channel:
            responses = collect(channel, "hello", max_tokens=4, ignore_eos=True)
        assert responses[-1].served.endpoint == stack.address("triton_grpc")
        meter = stack_meter(stack, router=router)
        assert meter.roots["router"] == (router.process.pid,)
        assert meter.roots["triton"] == stack_meter(stack).roots["triton"]
        assert "inference" not in meter.roots  # not on that router's path
    assert not router.alive
