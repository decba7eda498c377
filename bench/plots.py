"""PNG plots of a load benchmark's runs: latency percentiles against load, the TTFT
distribution, and output tokens per second over time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.metrics import RequestRecord
from bench.report import Run

WINDOW_S = 0.5  # tokens/s buckets


@contextmanager
def _figure(path: Path, panels: int = 1) -> Iterator[Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    yield axes[0]
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _by_target(runs: list[Run]) -> dict[str, list[Run]]:
    grouped: dict[str, list[Run]] = {}
    for run in runs:
        grouped.setdefault(run.target, []).append(run)
    return grouped


def latency_vs_load(runs: list[Run], path: Path) -> None:
    loads = list(dict.fromkeys(run.load for run in runs))
    with _figure(path) as (ax,):
        for target, target_runs in _by_target(runs).items():
            by_load = {run.load: run for run in target_runs}
            for q, style in ((50, "-o"), (99, ":o")):
                xs = [i for i, load in enumerate(loads) if load in by_load]
                ys = [by_load[loads[i]].summary.ttft_s[f"p{q}"] * 1000 for i in xs]
                ax.plot(xs, ys, style, label=f"{target} p{q}")
        ax.set_xticks(range(len(loads)), loads)
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.set_title("Time to first token against load")
        ax.legend(fontsize="small")


def ttft_cdf(runs: list[Run], path: Path) -> None:
    loads = list(dict.fromkeys(run.load for run in runs))
    with _figure(path, len(loads)) as axes:
        for ax, load in zip(axes, loads, strict=True):
            for run in (r for r in runs if r.load == load):
                ttfts = sorted(r.ttft * 1000 for r in run.records if r.ok)
                if ttfts:
                    ax.plot(
                        ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=run.target
                    )
            ax.set_xscale("log")
            ax.set_xlabel("TTFT (ms)")
            ax.set_title(load)
        axes[0].set_ylabel("share of requests")
        axes[-1].legend(fontsize="small")


def tokens_over_time(runs: list[Run], path: Path) -> None:
    """Each round's tokens/s from its own start, averaged over the rounds."""
    loads = list(dict.fromkeys(run.load for run in runs))
    with _figure(path, len(loads)) as axes:
        for ax, load in zip(axes, loads, strict=True):
            for run in (r for r in runs if r.load == load):
                rounds = _rounds([r for r in run.records if r.ok and r.chunk_times])
                buckets: dict[int, float] = {}
                for records in rounds:
                    start = records[0].sent_at
                    for record in records:
                        per_chunk = record.output_tokens / len(record.chunk_times)
                        for t in record.chunk_times:
                            key = int((t - start) // WINDOW_S)
                            buckets[key] = buckets.get(key, 0.0) + per_chunk
                xs = sorted(buckets)
                rates = [buckets[x] / WINDOW_S / max(len(rounds), 1) for x in xs]
                ax.plot([x * WINDOW_S for x in xs], rates, label=run.target)
            ax.set_xlabel("time since the round's first request (s)")
            ax.set_title(load)
        axes[0].set_ylabel("output tokens/s (mean of rounds)")
        axes[-1].legend(fontsize="small")


def _rounds(records: list[RequestRecord], gap_s: float = 2.0) -> list[list[RequestRecord]]:
    """Records split into the rounds they were sent in (other targets ran in between)."""
    rounds: list[list[RequestRecord]] = []
    for record in sorted(records, key=lambda r: r.sent_at):
        if rounds and record.sent_at - rounds[-1][-1].sent_at <= gap_s:
            rounds[-1].append(record)
        else:
            rounds.append([record])
    return rounds


def write_plots(runs: list[Run], prefix: Path) -> list[Path]:
    """The three plots as ``<prefix>-latency.png``, ``-ttft-cdf.png``, ``-tokens.png``."""
    paths = [
        prefix.with_name(prefix.name + suffix)
        for suffix in ("-latency.png", "-ttft-cdf.png", "-tokens.png")
    ]
    latency_vs_load(runs, paths[0])
    ttft_cdf(runs, paths[1])
    tokens_over_time(runs, paths[2])
    return paths
