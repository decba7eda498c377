"""CPU accounting from /proc and process placement (bench/cpu.py), on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.cpu import (
    CGROUP_ROOT,
    CpuMeter,
    CpuSpent,
    cpu_budgets,
    cpu_seconds,
    cpu_stat,
    cpu_ticks,
    descendants,
    model_processes,
    pin,
    pin_process,
    quota_settings,
    reference_ms,
    split,
)
from bench.metrics import RequestRecord, Slo, summarize
from bench.report import Run, cpu_ratio_table, cpu_table, idle_table
from tests.conftest import wait_for

# A parent that starts a child which burns CPU until told to stop (a line on stdin).
FAMILY = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import sys, threading\\n"
    "stop = threading.Event()\\n"
    "threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()\\n"
    "print('burning', flush=True)\\n"
    "while not stop.is_set(): sum(range(1000))\\n"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), child.pid, flush=True)
sys.stdin.readline()
child.stdin.write("stop\\n"); child.stdin.flush(); child.wait()
"""


@pytest.fixture
def family() -> Iterator[tuple[subprocess.Popen[str], int]]:
    parent = subprocess.Popen(
        [sys.executable, "-c", FAMILY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None and parent.stdin is not None
    said, child = parent.stdout.readline().split()
    assert said == "burning"
    try:
        yield parent, int(child)
    finally:
        parent.stdin.write("stop\n")
        parent.stdin.flush()
        parent.wait(10)


def test_a_group_counts_its_descendants_cpu(family: tuple[subprocess.Popen[str], int]) -> None:
    parent, child = family
    assert child in descendants(parent.pid)
    meter = CpuMeter({"family": [parent.pid]})
    first = meter.sample()
    wait_for(lambda: cpu_seconds(child) > first.seconds["family"] + 0.2, 30, "the child's CPU")
    spent = meter.sample().minus(first)
    assert spent.seconds["family"] >= 0.2
    assert spent.wall_s > 0


def test_pinning_moves_every_thread_of_every_descendant(
    family: tuple[subprocess.Popen[str], int],
) -> None:
    parent, child = family
    cpus = sorted(os.sched_getaffinity(0))
    pin([parent.pid], {cpus[-1]})
    for task in os.listdir(f"/proc/{child}/task"):
        assert os.sched_getaffinity(int(task)) == {cpus[-1]}


def test_cost_beyond_idle_and_per_request() -> None:
    idle = CpuSpent(2.0, {"router": 0.02, "triton": 0.2})
    run = CpuSpent(4.0, {"router": 1.04, "triton": 0.3})
    beyond = run.beyond(idle)
    assert beyond.seconds == pytest.approx({"router": 1.0, "triton": 0.0})
    records = [RequestRecord(sent_at=0.0, first_token_at=0.01, finished_at=0.1) for _ in range(4)]
    for record in records:
        record.chunk_times = [0.01, 0.02]
        record.output_tokens = 2
    summary = summarize(records, 4.0, Slo())
    table = cpu_table([Run("router", "concurrency 1", 1, summary, records, beyond)])
    row = table.splitlines()[-1]
    # 1 s of router CPU over 4 requests and 8 responses: 250 ms each, 125,000 µs each.
    assert row.startswith("| concurrency 1 | router | 4 | 8 | 250.00 |")
    assert row.endswith("| 250.00 | 125000 |")


def test_idle_cpu_is_reported_per_target_as_a_share_of_a_cpu() -> None:
    summary = summarize([], 1.0, Slo())
    idle = CpuSpent(4.0, {"router": 0.04, "inference": 0.08, "triton": 0.2})
    loads = ("concurrency 1", "concurrency 16")
    runs = [Run("router", load, None, summary, idle=idle) for load in loads]
    table = idle_table([*runs, Run("triton", "concurrency 1", None, summary)]).splitlines()
    assert table[0] == "| target | router | inference | triton | mesh |"
    assert table[2:] == ["| router | 1.0% | 2.0% | 5.0% | 3.0% |"]  # once per target
    assert idle_table([Run("triton", "concurrency 1", None, summary)]) == ""


def test_a_cpu_ratio_is_reported_pooled_and_round_by_round_and_with_idle_rates() -> None:
    records = [RequestRecord(sent_at=0.0, first_token_at=0.01, finished_at=0.1) for _ in range(4)]
    summary = summarize(records, 4.0, Slo())

    def run(name: str, router_s: float, idle_s: float, rounds: list[float]) -> Run:
        cpu = CpuSpent(4.0, {"router": router_s, "inference": 1.0, "triton": 9.0})
        idle = CpuSpent(2.0, {"inference": idle_s, "triton": 1.0})
        whole = [r + idle_s * 2 * 1000 / 4 for r in rounds]  # 4 s of the idle rate / 4 req
        return Run(name, "concurrency 1", 1, summary, records, cpu, rounds, idle, whole)

    runs = [
        run("router (main)", 3.0, 1.0, [1000.0, 800.0, 1200.0]),
        run("router", 1.0, 0.0, [400.0, 600.0, 300.0]),
    ]
    row = cpu_ratio_table(runs, "router (main)", "router").splitlines()[-1]
    # Pooled: (1 + 1) s against (3 + 1) s of router and inference CPU; triton's not counted.
    # By round: 0.4x, 0.75x, 0.25x. Idle included: main's inference idled at half a CPU,
    # 2 s more over the 4 s: 2 s against 6 s; by round 400 / 1500, 600 / 1300, 300 / 1700.
    assert row == (
        "| concurrency 1 | 0.50x | 0.40x (0.25x - 0.75x, 3 rounds) "
        "| 0.33x | 0.27x (0.18x - 0.46x, 3 rounds) |"
    )


def test_a_group_alone_counts_only_its_own_process(
    family: tuple[subprocess.Popen[str], int],
) -> None:
    parent, child = family
    meter = CpuMeter({"parent": [parent.pid], "family": [parent.pid]}, alone=["parent"])
    first = meter.sample()
    wait_for(lambda: cpu_seconds(child) > first.seconds["family"] + 0.2, 30, "the child's CPU")
    spent = meter.sample().minus(first)
    assert spent.seconds["family"] >= 0.2 > spent.seconds["parent"]


def test_a_process_set_apart_stays_apart_from_the_process_that_started_it(
    family: tuple[subprocess.Popen[str], int],
) -> None:
    parent, child = family  # this process's child, as the stack's Triton is the bench's
    cpus = sorted(os.sched_getaffinity(0))
    try:
        split([parent.pid], {cpus[-1]}, [], set(cpus[:-1]))
        for pid in (parent.pid, child):
            for task in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(task)) == {cpus[-1]}
        assert os.sched_getaffinity(0) == set(cpus[:-1])
    finally:
        pin_process(os.getpid(), set(cpus))


def test_busy_time_leaves_out_idle_iowait_and_what_the_hypervisor_stole() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat = "cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 10 1 5 100 7 2 3 40 0 0\ncpu1 1 1 1 1 1 1 1 1 0 0\n"
    assert cpu_ticks(stat, [0]) == [(10 + 1 + 5 + 2 + 3, 40)]
    assert cpu_ticks(stat, [0, 1]) == [(21, 40), (5, 1)]


def test_the_reference_task_is_timed_on_the_cpu_asked() -> None:
    cpu = max(os.sched_getaffinity(0))
    assert 0 < reference_ms(cpu, repeats=3) < 10_000
    with pytest.raises(subprocess.CalledProcessError):  # no such CPU: it cannot be pinned
        reference_ms(os.cpu_count() or 1, repeats=1)


# A parent, as Triton is, of processes with the arguments Triton gives its Python-backend
# processes (the instance's name last); it prints their pids and waits for a line on stdin.
# The names come to it as one argument, which no instance name matches whole.
TRITON_LIKE = """
import subprocess, sys
arguments = ["/m/model.py", "shm_region", "1048576", "1048576", "1", "/b", "336"]
stubs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()",
                           *arguments, name], stdin=subprocess.PIPE)
         for name in sys.argv[1].split(",")]
print(*(stub.pid for stub in stubs), flush=True)
sys.stdin.readline()
for stub in stubs:
    stub.kill()
    stub.wait()
"""


def test_each_models_backend_processes_are_found_by_their_instance_names() -> None:
    names = ("llm_r0_0_0", "llm_r0_1_0", "llm_r1_0_0", "llm_0_0")
    triton = subprocess.Popen(
        [sys.executable, "-c", TRITON_LIKE, ",".join(names)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert triton.stdout is not None and triton.stdin is not None
    stubs = dict(zip(names, (int(pid) for pid in triton.stdout.readline().split()), strict=True))
    try:
        wait_for(
            lambda: all(Path(f"/proc/{pid}/cmdline").read_bytes().count(b"\0") > 8
                        for pid in stubs.values()),
            30,
            "the processes' arguments",
        )  # fmt: skip
        found = model_processes(triton.pid, ["llm_r0", "llm"])
        assert sorted(found["llm_r0"]) == sorted([stubs["llm_r0_0_0"], stubs["llm_r0_1_0"]])
        assert found["llm"] == [stubs["llm_0_0"]]  # llm_r1's instance is not llm's
        with pytest.raises(RuntimeError, match="llm_r2"):
            model_processes(triton.pid, ["llm_r0", "llm_r2"])
    finally:
        triton.stdin.write("stop\n")
        triton.stdin.flush()
        triton.wait(10)


def test_a_budget_is_written_as_either_cgroup_version_reads_it() -> None:
    assert quota_settings(0.4, unified=True) == {"cpu.max": "4000 10000"}
    assert quota_settings(0.4, unified=False) == {
        "cpu.cfs_period_us": "10000",
        "cpu.cfs_quota_us": "4000",
    }
    with pytest.raises(ValueError, match="1 ms"):
        quota_settings(0.05, unified=True)


def _cpu_cgroup(pid: int) -> str:
    """The process's group in the CPU controller's hierarchy (v1), else the one hierarchy's
    (v2; a v1 machine may list that one too)."""
    groups = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else ["unified"]:
            groups[controller] = path
    return groups.get("cpu", groups.get("unified", "no CPU cgroup"))


def test_a_cpu_budget_holds_a_busy_process_to_its_share_and_lets_go(
    family: tuple[subprocess.Popen[str], int],
) -> None:
    _, child = family  # burns a whole CPU when it can
    with cpu_budgets({"burner": [child]}, 0.2, CGROUP_ROOT) as groups:
        group = groups["burner"]
        assert _cpu_cgroup(child) == "/" + group.name
        wait_for(lambda: cpu_stat(group)["nr_throttled"] > 0, 30, "the budget to hold it")
        first = cpu_stat(group)["nr_periods"]
        before, started = cpu_seconds(child), time.monotonic()
        # measured over 100 of the budget's 10 ms periods, counted by the kernel
        wait_for(lambda: cpu_stat(group)["nr_periods"] >= first + 100, 30, "100 periods")
        share = (cpu_seconds(child) - before) / (time.monotonic() - started)
        assert share < 0.3  # 0.2 of a CPU, and a tick of /proc's accounting
    assert not group.exists()
    assert _cpu_cgroup(child) == "/"
