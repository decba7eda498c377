"""What each process of a run costs in CPU, read from /proc, and where processes run.

A process's CPU time is its threads' user and system time (/proc/<pid>/stat), summed over
the process and its descendants (Triton's model processes are its children). A
benchmark samples every group before and after each measured run; the cost per request
is the run's CPU less what the group spends idle in as long (load reports, metric polls),
divided by the requests served.

Placement: ``pinned`` puts Triton and its model processes on the last CPU and everything
else (the mesh's services, Redis, the load generator) on the others, as on a GPU host
where the engine does not compete with the mesh for CPU; ``shared`` leaves the scheduler
to place them (the default).

CPU budgets: several engines on a few CPUs borrow each other's idle time, as engines on
accelerators of their own cannot; ``cpu_budgets`` holds each engine's backend processes
to a share of a CPU of its own (a CPU cgroup each, a CFS quota), never more however idle
the others are.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PLACEMENTS = ("shared", "pinned")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it, as /proc lists their children now."""
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        for task in _tasks(current):
            try:
                children = Path(f"/proc/{current}/task/{task}/children").read_text().split()
            except OSError:
                continue
            stack.extend(int(child) for child in children)
    return found


def _tasks(pid: int) -> list[int]:
    try:
        return [int(task) for task in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def busy_seconds(cpus: Iterable[int]) -> float:
    """Time the ``cpus`` have spent running anything so far (/proc/stat), in seconds: not
    idling, not waiting for I/O, and not stolen (the hypervisor running another guest)."""
    times = cpu_ticks(Path("/proc/stat").read_text(), cpus)
    return sum(busy for busy, _ in times) / CLOCK_TICKS


def stolen_seconds(cpus: Iterable[int]) -> float:
    """Time the hypervisor has held the ``cpus`` from this machine so far (/proc/stat's
    steal), in seconds: on a shared host, one way a run is slowed from outside."""
    times = cpu_ticks(Path("/proc/stat").read_text(), cpus)
    return sum(stolen for _, stolen in times) / CLOCK_TICKS


def cpu_ticks(proc_stat: str, cpus: Iterable[int]) -> list[tuple[int, int]]:
    """(busy, stolen) ticks of each of ``cpus`` in the text of /proc/stat."""
    wanted = {f"cpu{c}" for c in cpus}
    times = []
    for line in proc_stat.splitlines():
        name, *ticks = line.split()
        if name in wanted:
            values = [int(t) for t in ticks]
            idle, iowait, steal = values[3], values[4], values[7]
            times.append((sum(values) - idle - iowait - steal, steal))
    return times


# A fixed task of the kind a service's request is made of (JSON, a regular expression,
# strings, dicts), timed hot: what it takes says how fast a CPU runs Python right now.
_REFERENCE_TASK = """
import json, os, re, statistics, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
doc = {"messages": [{"role": "user", "content": "a few words " * 30}] * 8, "n": list(range(64))}
address = re.compile(r"[\\w.+-]+@[\\w-]+\\.[\\w.]+")
def task():
    for _ in range(100):
        text = json.dumps(doc)
        json.loads(text)
        address.search(text)
        {word: len(word) for word in text.split()}
task()
times = []
for _ in range(int(sys.argv[2])):
    started = time.perf_counter()
    task()
    times.append(time.perf_counter() - started)
print(statistics.median(times) * 1000)
"""


def reference_ms(cpu: int, repeats: int = 7) -> float:
    """The median time (ms) of a fixed Python task on ``cpu`` now, in a process of its own
    pinned there: this machine's speed drifts (its neighbours on the host), and runs far
    apart are comparable only beside it."""
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE_TASK, str(cpu), str(repeats)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return float(done.stdout)


def cpu_seconds(pid: int) -> float:
    """User and system time of every thread of ``pid`` so far (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass(frozen=True)
class CpuSample:
    at: float  # time.monotonic()
    seconds: Mapping[str, float]  # group -> CPU seconds so far

    def minus(self, earlier: CpuSample) -> CpuSpent:
        return CpuSpent(
            self.at - earlier.at,
            {name: value - earlier.seconds.get(name, 0.0) for name, value in self.seconds.items()},
        )


@dataclass(frozen=True)
class CpuSpent:
    wall_s: float
    seconds: Mapping[str, float]  # group -> CPU seconds over wall_s

    def plus(self, other: CpuSpent) -> CpuSpent:
        names = set(self.seconds) | set(other.seconds)
        return CpuSpent(
            self.wall_s + other.wall_s,
            {n: self.seconds.get(n, 0.0) + other.seconds.get(n, 0.0) for n in names},
        )

    def beyond(self, idle: CpuSpent) -> CpuSpent:
        """What this run spent beyond the groups' idle rate over as long."""
        rates = {n: s / idle.wall_s for n, s in idle.seconds.items()} if idle.wall_s else {}
        return CpuSpent(
            self.wall_s,
            {n: max(s - rates.get(n, 0.0) * self.wall_s, 0.0) for n, s in self.seconds.items()},
        )


class CpuMeter:
    """Samples named groups of processes, each a root process and its descendants, but
    for the groups named ``alone`` (a process that started the others, as a benchmark's
    load generator started the stack: only its own time is its)."""

    def __init__(self, roots: Mapping[str, Iterable[int]], alone: Iterable[str] = ()) -> None:
        self.roots = {name: tuple(pids) for name, pids in roots.items()}
        self._alone = frozenset(alone)

    def sample(self) -> CpuSample:
        return CpuSample(
            time.monotonic(),
            {name: sum(cpu_seconds(p) for p in self._pids(name)) for name in self.roots},
        )

    def _pids(self, name: str) -> list[int]:
        roots = self.roots[name]
        if name in self._alone:
            return list(roots)
        return [pid for root in roots for pid in descendants(root)]

    def idle(self, seconds: float = 3.0) -> CpuSpent:
        """What the groups spend with no request in flight (measured over ``seconds``)."""
        before = self.sample()
        time.sleep(seconds)  # the measuring window itself
        return self.sample().minus(before)


def pin(pids: Iterable[int], cpus: set[int]) -> None:
    """Every thread of every process under ``pids`` onto ``cpus``; threads and processes
    they start later inherit it."""
    for root in pids:
        for pid in descendants(root):
            pin_process(pid, cpus)


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus``, not its children (the bench's process, whose
    children are the stacks it started)."""
    for task in _tasks(pid):
        try:
            os.sched_setaffinity(task, cpus)
        except OSError:  # gone meanwhile
            continue


def split(
    apart: Iterable[int], apart_cpus: set[int], rest: Iterable[int], rest_cpus: set[int]
) -> None:
    """``apart`` and the processes under them on ``apart_cpus``; ``rest`` and this process
    on ``rest_cpus``: this process's own threads only, since the processes it started
    (``apart`` among them) are its children."""
    pin(apart, apart_cpus)
    pin(rest, rest_cpus)
    pin_process(os.getpid(), rest_cpus)


def place(placement: str, engine: Iterable[int], mesh: Iterable[int]) -> str:
    """Applies ``placement``; says where each side runs."""
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "shared":
        return f"shared: every process on CPUs {cpus}"
    if len(cpus) < 2:
        raise SystemExit("--placement pinned needs at least two CPUs")
    engine_cpus, mesh_cpus = set(cpus[-1:]), set(cpus[:-1])
    split(engine, engine_cpus, mesh, mesh_cpus)
    return (
        f"pinned: Triton and its model processes on CPU {sorted(engine_cpus)}, the mesh "
        f"and the load generator on CPUs {sorted(mesh_cpus)}"
    )


# -- CPU budgets --------------------------------------------------------------------------

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Short, so that a budget spent waits at most this long for its next share (the kernel's
# shortest quota is 1 ms: budgets of at least a tenth of a CPU).
BUDGET_PERIOD_US = 10_000


def model_processes(triton_pid: int, models: Iterable[str]) -> dict[str, list[int]]:
    """The backend processes of each of ``models`` under Triton, known by the instance
    name Triton passes each (``<model>_<group>_<index>``)."""
    names = {model: re.compile(rf"{re.escape(model)}_\d+_\d+") for model in models}
    found: dict[str, list[int]] = {model: [] for model in names}
    for pid in descendants(triton_pid):
        arguments = _arguments(pid)
        for model, name in names.items():
            if any(name.fullmatch(argument) for argument in arguments):
                found[model].append(pid)
    missing = sorted(model for model, pids in found.items() if not pids)
    if missing:
        raise RuntimeError(f"no backend process under Triton for {', '.join(missing)}")
    return found


def _arguments(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def quota_settings(cpus: float, unified: bool, period_us: int = BUDGET_PERIOD_US) -> dict[str, str]:
    """A CPU cgroup's files that hold it to ``cpus`` of a CPU: cgroup v2's ``cpu.max``, or
    v1's period and quota."""
    quota = round(cpus * period_us)
    if quota < 1000:
        raise ValueError(f"a CPU budget of {cpus:g} is under the kernel's 1 ms a period")
    if unified:
        return {"cpu.max": f"{quota} {period_us}"}
    return {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota)}


def _cpu_controller(root: Path) -> tuple[Path, bool]:
    """Where CPU cgroups are made, and whether it is cgroup v2 (one hierarchy)."""
    if (root / "cgroup.controllers").exists():
        return root, True
    return root / "cpu", False


@contextlib.contextmanager
def cpu_budgets(
    groups: Mapping[str, Iterable[int]], cpus: float, root: Path = CGROUP_ROOT
) -> Iterator[dict[str, Path]]:
    """Each group of processes (by name) in a CPU cgroup of its own, held to ``cpus`` of
    a CPU together however idle the rest are; yields each group's cgroup. On exit the
    processes go back to the root group and the cgroups are removed."""
    controller, unified = _cpu_controller(root)
    settings = quota_settings(cpus, unified)
    made: dict[str, Path] = {}
    try:
        if unified:  # v2 hands the CPU controller to child groups only when asked
            (controller / "cgroup.subtree_control").write_text("+cpu")
        for name, pids in groups.items():
            group = controller / f"llm-mesh-bench-{os.getpid()}-{name}"
            group.mkdir()
            made[name] = group
            for file, value in settings.items():
                (group / file).write_text(value)
            for pid in pids:
                (group / "cgroup.procs").write_text(str(pid))
    except OSError as err:
        _release(made.values(), controller)
        raise SystemExit(
            f"cannot hold engines to a CPU budget: a CPU cgroup under {controller} ({err}); "
            "it takes root and a writable cgroup filesystem"
        ) from None
    try:
        yield made
    finally:
        _release(made.values(), controller)


def _release(groups: Iterable[Path], controller: Path) -> None:
    """Back to the root group, each cgroup's processes that are still alive; the cgroups
    removed."""
    for group in groups:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                (controller / "cgroup.procs").write_text(pid)
        group.rmdir()


def cpu_stat(group: Path) -> dict[str, int]:
    """A CPU cgroup's counters so far: ``nr_periods`` (periods it had work to run in),
    ``nr_throttled`` (those the kernel held it to its budget in), and the rest."""
    counters = (line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return {name: int(value) for name, value in counters}
