from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bench.fleets import _admission_plot
from bench.metrics import RequestRecord, Slo, percentile, summarize
from bench.workload import WorkloadSpec, make_requests


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert math.isnan(percentile([], 50))


def _record(sent: float, first: float, end: float, tokens: int) -> RequestRecord:
    record = RequestRecord(
        sent_at=sent, first_token_at=first, finished_at=end, output_tokens=tokens
    )
    record.chunk_times = [first + i * (end - first) / (tokens - 1) for i in range(tokens)]
    return record


def test_summary_follows_the_field_definitions() -> None:
    records = [_record(0.0, 0.1, 1.1, 11), _record(0.0, 0.3, 0.8, 6)]
    failed = RequestRecord(sent_at=0.0, error="UNAVAILABLE")
    summary = summarize([*records, failed], duration_s=2.0, slo=Slo(ttft_s=0.2))
    assert summary.requests == 3
    assert summary.failed == 1
    assert summary.output_tokens == 17
    assert summary.output_tokens_per_s == 8.5
    assert summary.ttft_s["p50"] == 0.2
    assert summary.tpot_s["p50"] == 0.1  # both requests: 0.1 s per token after the first
    assert math.isclose(summary.itl_s["mean"], 0.1)
    assert summary.goodput_per_s == 0.5  # only the first request met the TTFT SLO


def test_workload_is_reproducible_and_shares_prefixes() -> None:
    spec = WorkloadSpec(num_prompts=6, input_len=100, prefix_groups=2, shared_prefix_len=40)
    a, b = make_requests(spec), make_requests(spec)
    assert a == b
    assert a[0].prompt[:40] == a[2].prompt[:40] != a[1].prompt[:40]
    assert all(len(r.prompt) == 100 and r.max_tokens == 64 for r in a)


def test_engine_scenario_times_prefill_and_decode_steps() -> None:
    from bench.engine import engine_table, run_engine_as_served

    spec = WorkloadSpec(num_prompts=4, input_len=24, output_len=5)
    # As the CLI runs it: in a child process, the runs coming back as JSON.
    one, two = run_engine_as_served(spec, [1, 2])
    assert (one.concurrency, two.concurrency) == (1, 2)
    assert one.output_tokens == two.output_tokens == 20
    # One stream prefills each prompt in its own step; two streams start two at once.
    assert len(one.prefill_steps_s) == 4 and len(two.prefill_steps_s) == 2
    assert len(one.decode_steps_s) == 4 * 4 and len(two.decode_steps_s) == 2 * 4
    table = engine_table([one, two])
    assert "| 1 |" in table and "| 2 |" in table and "1.00x" in table
    # Every request's TTFT and TPOT, as its sink saw them.
    assert len(one.ttft_s) == len(one.tpot_s) == 4
    assert all(ttft > 0 and tpot > 0 for ttft, tpot in zip(one.ttft_s, one.tpot_s, strict=True))


def test_admission_report_sets_the_critical_tier_against_its_floor() -> None:
    from bench.admission import AdmissionComparison, EngineWork, MixRuns, RunResult, TierRecord

    def run(name: str, rate: float, ttfts: dict[str, float]) -> RunResult:
        records = [TierRecord(t, _record(0.0, ttft, ttft + 1.0, 64)) for t, ttft in ttfts.items()]
        return RunResult(name, rate, 10.0, records)

    slow = {"critical": 0.8, "standard": 1.5, "sheddable": 3.0}
    fast = {"critical": 0.44, "standard": 0.5, "sheddable": 1.0}
    runs = {"fifo": run("fifo", 60.0, slow), "admission": run("admission", 60.0, slow)}
    runs["engine priority"] = run("engine priority", 60.0, fast)
    runs["fifo"].engine = EngineWork(9.9, 0.0, 14_850.0, 0.0, 990.0, 10.0)
    runs["admission"].engine = EngineWork(9.0, 0.0, 13_500.0, 0.0, 900.0, 10.0)
    runs["engine priority"].engine = EngineWork(10.0, 2.1, 14_250.0, 640.0, 1_900.0, 10.0)
    mix = MixRuns("a third each", runs, run("critical alone", 20.0, {"critical": 0.4}))
    capacity_engine = EngineWork(12.0, 0.0, 18_000.0, 0.0, 600.0, 12.5)
    rounds = [24.0, 30.0, 31.0]
    table = AdmissionComparison(30.0, 0.05, [mix], 30.0, rounds, capacity_engine).table()
    assert "30.00 req/s, the median of 3 rounds (24.00, 30.00, 31.00)" in table
    assert "| a third each | critical alone | critical | 1 |" in table
    assert "| a third each | critical alone | standard" not in table  # not sent: no row
    assert "engine priority 440 ms = 1.10x the floor's 400 ms (goal <= 1.1x)" in table
    # Good: critical within 0.5 s, standard 1 s, sheddable 2 s (TPOT 1/63 s each).
    assert "engine priority 0.30 req/s, admission without it 0.00 (" in table
    # Goodput against what the fleet can serve at all (30 req/s): 1.2x admission's may be
    # more than that.
    assert "of the capacity, engine priority 1% and admission without it 0%" in table
    # The critical tier's good share along the run (one request each here: one part).
    assert "critical good share by tenths of arrival: fifo 0%; admission 0%; engine" in table
    assert "engine priority 100%; critical alone 100%" in table
    ttfts = [0.1] * 15 + [0.9] * 5  # the last quarter late
    ten = RunResult(
        "x", 1.0, 10.0, [TierRecord("critical", _record(0, t, t + 1, 64)) for t in ttfts]
    )
    assert ten.good_shares_by_arrival("critical") == [1.0] * 7 + [0.5] + [0.0] * 2
    # What each run made the engine do: busy share, generated tokens per busy second and
    # per step (its batch).
    assert (
        "busy share, generated tokens per busy second and per step, 1,500 and 30.0 in the "
        "capacity run: fifo 99%, 1,500, 15.0; admission 90%, 1,500, 15.0; engine priority "
        "100%, 1,425, 7.5; engine priority 0.95x admission's per busy second, 640 tokens "
        "recomputed after preemptions, 21% of its step time in steps that left lower tiers "
        "out" in table
    )
    # --out: every request of every run, the floor's too.
    saved = json.loads(json.dumps(AdmissionComparison(30.0, 0.05, [mix], 30.0).as_json()))
    runs_saved = saved["mixes"][0]["runs"]
    assert [r["router"] for r in runs_saved] == [*runs, "critical alone"]
    assert runs_saved[2]["engine"]["recomputed"] == 640.0 and runs_saved[3]["engine"] is None
    first = runs_saved[2]["requests"][0]
    assert first["tier"] == "critical" and first["good"] and first["ttft_s"] == 0.44


def test_the_engines_work_is_read_from_tritons_metrics() -> None:
    from bench.admission import EngineWork, engine_work_of

    def text(steps: float, first_word: float, generated: float) -> str:
        return "".join(
            f"# TYPE {name} counter\n"
            + "".join(f'{name}{{model="{m}"}} {value / 2}\n' for m in ("llm", "llm_canary"))
            for name, value in (
                ("llm_engine_step_seconds_total", steps),
                ("llm_engine_first_word_step_seconds_total", first_word),
                ("llm_engine_generation_tokens_total", generated),
                ("llm_engine_recomputed_tokens_total", 8.0),
                ("llm_engine_steps_total", steps * 100),
            )
        )

    before = engine_work_of(text(10.0, 1.0, 3_000.0))
    after = engine_work_of(text(20.0, 3.5, 18_000.0))
    assert after == EngineWork(20.0, 3.5, 18_000.0, 8.0, 2_000.0)  # summed over the models
    run = after.since(before, wall_s=12.5)
    assert run == EngineWork(10.0, 2.5, 15_000.0, 0.0, 1_000.0, 12.5)
    assert (run.busy_share, run.tokens_per_busy_s, run.first_word_share) == (0.8, 1_500.0, 0.25)
    assert run.tokens_per_step == 15.0
    idle = before.since(before, wall_s=0.0)  # no step in between: no shares, no rates
    rates = (idle.busy_share, idle.tokens_per_busy_s, idle.tokens_per_step, idle.first_word_share)
    assert rates == (0.0, 0.0, 0.0, 0.0)
    assert engine_work_of("") == EngineWork()


def test_an_admission_run_that_records_nothing_leaves_the_documented_plot_alone() -> None:
    def plot(**given: object) -> Path:
        args = {"plot": None, "markdown": None, "out": Path("bench/results/latest.json")}
        return _admission_plot(argparse.Namespace(**(args | given)))

    assert plot() == Path("bench/results/latest-admission.png")
    assert plot(markdown=Path("docs/benchmarks.md")) == Path("docs/img/admission.png")
    assert plot(plot=Path("/tmp/a.png"), markdown=Path("docs/benchmarks.md")) == Path("/tmp/a.png")
