"""Policy benchmark: a 200-rule set on 4 KB prompts and on token-sized output chunks,
the default set and the 200 rules on a 32-message 16 KB conversation, in process and
through the policy service; the time to first token through a router whose tenants
differ only in their rule set (none, the default set's input rules, the 200 rules on input
or on input and output); and how other streams' tokens flow while a 60 KB conversation is
checked (the event loop's pauses in process, checked on it and beside it, and the gaps
between a router's streamed tokens), in one run.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml

from bench.metrics import RequestRecord, percentile
from bench.targets import RouterTarget
from bench.workload import BenchRequest, text_of_length
from llmmesh.launcher import Stack, StackPorts
from llmmesh.launcher.process import Child
from llmmesh.launcher.stack import DEMO_KEY_FILE
from llmmesh.policy import OutputScanner, Part, RuleLibrary, RuleSet, check_input
from llmmesh.policy.off_loop import input_verdict, input_verdict_off_loop
from llmmesh.runtime.collector_pauses import freeze_startup_heap
from llmmesh.runtime.internal_auth import token_metadata
from llmmesh.v1 import policy_pb2, policy_pb2_grpc
from llmmesh.waiting import poll_until_async
from services.policy.config import DEFAULT_RULES
from services.router.tenants import hash_key

PROMPT_CHARS = 4096
CONVERSATION_MESSAGES = 32
CONVERSATION_CHARS = 16 * 1024
CHUNK_CHARS = 4  # about one token of English text
LONG_PROMPT_CHARS = 60 * 1024  # under the router's 64 KB limit, with a question after it
DETECTORS = ("email", "phone", "credit_card", "iban", "ip_address", "ip_address_v6", "api_key")


def synthetic_rules(count: int = 200, seed: int = 0) -> str:
    """A rule set of ``count`` rules: the PII detectors, and keyword and regex rules on
    made-up words (so that prompts rarely trip them), on input and output."""
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice("bcdfghjklmnpqrstvwxz") + rng.choice("aeiou") for _ in range(4))

    rules: list[dict[str, object]] = [
        {"id": f"pii-{name}", "stage": "both", "action": "redact", "detectors": [name]}
        for name in DETECTORS
    ]
    regexes = [
        lambda: rf"\b{word()}-\d{{2,6}}\b",
        lambda: rf"(?i)\b{word()}\s+{word()}\b",
        lambda: rf"\b[A-Z]{{3}}-{word()}\b",
    ]
    while len(rules) < count:
        index = len(rules)
        if index % 5 == 0:
            matcher: dict[str, object] = {"regex": [rng.choice(regexes)()]}
        else:
            matcher = {"keywords": [word() for _ in range(4)] + [f"{word()} {word()}"]}
        action = ("deny", "flag", "redact")[index % 3]
        rules.append({"id": f"rule-{index}", "stage": "both", "action": action, **matcher})
    return yaml.safe_dump({"version": f"bench-{count}", "rules": rules})


def prompts(n: int, seed: int) -> list[str]:
    """4 KB prompts of ordinary words, one in four with an email or phone number in it."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = text_of_length(rng, PROMPT_CHARS)
        if i % 4 == 0:
            cut = rng.randrange(len(text))
            text = f"{text[:cut]} reach me at ada{i}@example.com or +1 555 010 {i % 10}999 "
        out.append(text[:PROMPT_CHARS].ljust(PROMPT_CHARS))
    return out


def escaped(text: str) -> str:
    """``text`` with every word's first letter written as an escape a model reads through,
    an HTML character reference, a percent-escape and a backslash escape in turn: the
    views read each back."""
    forms = ("&#{};", "%{:02X}", "\\u{:04x}")
    words = text.split(" ")
    for i, word in enumerate(words):
        if word[:1].isalpha():
            words[i] = forms[i % len(forms)].format(ord(word[0])) + word[1:]
    return " ".join(words)[:PROMPT_CHARS]


def encoded(text: str, words: int = 4) -> str:
    """``text`` written in base64, a run per ``words`` words (the most runs a prompt of its
    size can hold that each read as text): the input check decodes and reads each."""
    split = text.split()
    chunks = (" ".join(split[i : i + words]) for i in range(0, len(split), words))
    runs = " ".join(base64.b64encode(c.encode()).decode() for c in chunks)
    return runs[:PROMPT_CHARS]


def hex_bytes(text: str) -> str:
    """``text`` in hexadecimal, its bytes two digits apart as a dump shows them: the input
    check reads the digits back as one run."""
    return " ".join(f"{b:02x}" for b in text.encode())[:PROMPT_CHARS]


@dataclass(frozen=True)
class Latency:
    label: str
    samples_s: list[float]

    def row(self) -> str:
        p50, p99 = (percentile(self.samples_s, q) * 1000 for q in (50, 99))
        rate = len(self.samples_s) / sum(self.samples_s) if self.samples_s else 0.0
        return f"| {self.label} | {len(self.samples_s)} | {p50:.3f} | {p99:.3f} | {rate:,.0f} |"


def _timed(action: Callable[[], object], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return samples


def _inputs_timed(rules: RuleSet, texts: list[str]) -> list[float]:
    inputs = iter(texts)
    return _timed(lambda: rules.check_input(next(inputs)), len(texts))


def conversations(n: int, seed: int) -> list[list[Part]]:
    """Conversations of 32 messages, 16 KB in all, cut from the benchmark's prompts (so
    one message in four or so holds an email address or a phone number)."""
    rng = random.Random(seed)
    size = CONVERSATION_CHARS // CONVERSATION_MESSAGES
    out = []
    for prompt in prompts(n, seed):
        long = (prompt * (CONVERSATION_CHARS // len(prompt) + 1))[:CONVERSATION_CHARS]
        start = rng.randrange(size)
        text = long[start:] + long[:start]
        out.append(
            [
                Part(f"messages[{i}].content", text[i * size : (i + 1) * size])
                for i in range(CONVERSATION_MESSAGES)
            ]
        )
    return out


def numbers_table(seed: int, chars: int = LONG_PROMPT_CHARS) -> str:
    """``chars`` of five-digit numbers, eight to a line: what a pasted table or report
    looks like, and the costliest text per KB for the input check of those measured
    (every group of digits is a card candidate, every line a run of base64 pieces)."""
    rng = random.Random(seed)
    lines: list[str] = []
    size = 0
    while size < chars:
        lines.append(" ".join(str(rng.randint(10_000, 99_999)) for _ in range(8)))
        size += len(lines[-1]) + 1
    return "\n".join(lines)[:chars]


async def _loop_pause(check: Callable[[], Awaitable[object]]) -> float:
    """The longest the loop goes without a turn while ``check`` runs (a task that wakes
    every millisecond measures it)."""
    pauses: list[float] = []
    checked = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not checked.is_set():
            await asyncio.sleep(0.001)  # the probe's period
            now = time.perf_counter()
            pauses.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # the ticker's first turn: it starts its clock
    await check()
    checked.set()
    await ticker
    return max(pauses)


def loop_pauses(rules: RuleSet, seed: int, rounds: int = 4) -> dict[str, list[float]]:
    """The loop's longest pause while a 60 KB conversation of numbers is checked on the
    loop's thread, and beside it (llmmesh/policy/off_loop.py), alternating, ``rounds`` of
    each."""
    messages = long_conversation(seed)
    parts = [Part(f"messages[{i}].content", m["content"]) for i, m in enumerate(messages)]
    # As a service does once it is up: else a full collection, which holds the
    # interpreter for tens of ms, walks every object the bench has made (the services'
    # start-up heap is frozen, llmmesh/runtime/collector_pauses.py).
    freeze_startup_heap()

    async def on_loop() -> object:
        return input_verdict(rules, parts)

    async def off_loop() -> object:
        return await input_verdict_off_loop(rules, parts)

    pauses: dict[str, list[float]] = {"on the loop": [], "beside the loop": []}
    for _ in range(rounds):
        for name, check in zip(pauses, (on_loop, off_loop), strict=True):
            pauses[name].append(asyncio.run(_loop_pause(check)))
    return pauses


def _checking(rules: RuleSet, chats: Iterator[list[Part]]) -> Callable[[], object]:
    return lambda: check_input(rules, next(chats))


def in_process(rules: RuleSet, default: RuleSet, texts: list[str], seed: int) -> list[Latency]:
    input_check = _inputs_timed(rules, texts)
    escaped_check = _inputs_timed(rules, [escaped(t) for t in texts])
    encoded_check = _inputs_timed(rules, [encoded(t) for t in texts])
    hex_check = _inputs_timed(rules, [hex_bytes(t) for t in texts])
    chats = conversations(200, seed)
    by_set = {
        name: _timed(_checking(rule_set, iter(chats)), len(chats))
        for name, rule_set in (("default set", default), ("200 rules", rules))
    }
    scanner = OutputScanner(rules.output)
    output = "".join(texts)
    chunks = iter([output[i : i + CHUNK_CHARS] for i in range(0, len(output), CHUNK_CHARS)])
    chunk_check = _timed(lambda: scanner.feed(next(chunks)), len(output) // CHUNK_CHARS)
    # A plain completion's first chunk: the prompt it continues is read at the join too.
    leads = iter(texts * 2)
    first = output[:CHUNK_CHARS]
    joined = _timed(lambda: OutputScanner(rules.output, next(leads)).feed(first), len(texts))
    return [
        Latency("input check, 4 KB prompt (in process)", input_check),
        Latency("input check, 4 KB prompt, every word's first letter escaped", escaped_check),
        Latency("input check, 4 KB prompt in base64, a run per 4 words", encoded_check),
        Latency("input check, 4 KB prompt in hexadecimal, its bytes apart", hex_check),
        *(
            Latency(f"input check, 32-message 16 KB conversation, {name} (in process)", v)
            for name, v in by_set.items()
        ),
        Latency(f"output chunk of {CHUNK_CHARS} chars (in process)", chunk_check),
        Latency(
            f"first output chunk of {CHUNK_CHARS} chars after a 4 KB prompt it continues "
            "(in process)",
            joined,
        ),
    ]


async def over_grpc(address: str, token: str, texts: list[str], rule_set: str) -> list[Latency]:
    auth = token_metadata(token)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = policy_pb2_grpc.PolicyStub(channel)
        input_check = []
        for text in texts:
            started = time.perf_counter()
            request = policy_pb2.CheckInputRequest(tenant="bench", text=text, rule_set=rule_set)
            await stub.CheckInput(request, metadata=auth)
            input_check.append(time.perf_counter() - started)
        call = stub.CheckOutput(metadata=auth)
        await call.write(policy_pb2.CheckOutputRequest(tenant="bench", rule_set=rule_set))
        await call.read()
        output = "".join(texts)[: 64 * 1024]
        chunk_check = []
        for i in range(0, len(output), CHUNK_CHARS):
            started = time.perf_counter()
            await call.write(policy_pb2.CheckOutputRequest(text=output[i : i + CHUNK_CHARS]))
            await call.read()
            chunk_check.append(time.perf_counter() - started)
        await call.done_writing()
    return [
        Latency("input check, 4 KB prompt (gRPC round trip)", input_check),
        Latency(f"output chunk of {CHUNK_CHARS} chars (gRPC round trip)", chunk_check),
    ]


@dataclass
class PolicyFleet:
    policy: str
    router: str
    router_http: str  # its OpenAI-compatible API's base URL
    keys: dict[str, str]  # tenant (TENANT_SETS) -> API key
    token: str  # the mesh's credential, for calling the policy service directly


# The router's tenants, and the rule set of each.
TENANT_SETS = {
    "no rules": "none",
    "default set, input rules": "default-input",
    "default set, input and output": "default",
    "200 rules, input only": "bench-input-only",
    "200 rules, input and output": "bench",
}


def _input_only(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "rules": [{**r, "stage": "input"} for r in doc["rules"]]}


def write_default_sets(rules: Path) -> None:
    """The default set (``default``) and its rules on input only (``default-input``)."""
    rules.mkdir(parents=True, exist_ok=True)
    (rules / "default.yaml").write_text(DEFAULT_RULES.read_text())
    default_set = yaml.safe_load(DEFAULT_RULES.read_text())
    (rules / "default-input.yaml").write_text(yaml.safe_dump(_input_only(default_set)))


def input_rules_tenant(workdir: Path) -> dict[str, str]:
    """Prepares a local stack's work directory, before it starts, so that its demo tenant
    has the default set's rules on input only: the rule sets, and the demo tenant's key
    and tenants file (which the stack keeps when it finds them). Returns the environment
    that points the stack's policy service at the rule sets."""
    rules = workdir / "rules"
    write_default_sets(rules)
    key = "llmm-" + secrets.token_urlsafe(24)
    (workdir / DEMO_KEY_FILE).write_text(key + "\n")
    tenant = {"id": "demo", "policy_set": "default-input", "api_key_hashes": [hash_key(key)]}
    (workdir / "tenants.yaml").write_text(json.dumps({"tenants": [tenant]}))
    return {"LLM_MESH_POLICY_RULES_PATH": str(rules)}


@contextmanager
def policy_fleet(workdir: Path, model: str = "llm") -> Iterator[PolicyFleet]:
    """The local stack, a policy service with the 200-rule set as default and a set that
    checks input only, and a router with a tenant on each."""
    rules = workdir / "rules"
    write_default_sets(rules)
    (rules / "none.yaml").write_text(yaml.safe_dump({"version": "none", "rules": []}))
    bench_set = yaml.safe_load(synthetic_rules())
    (rules / "bench.yaml").write_text(yaml.safe_dump(bench_set))
    (rules / "bench-input-only.yaml").write_text(yaml.safe_dump(_input_only(bench_set)))
    keys = {name: secrets.token_urlsafe(16) for name in TENANT_SETS}
    sets = TENANT_SETS
    tenants = workdir / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": [
                    {
                        "id": sets[name],
                        "policy_set": sets[name],
                        "api_key_hashes": [hash_key(key)],
                    }
                    for name, key in keys.items()
                ]
            }
        )
    )
    with Stack(workdir / "stack", StackPorts.free(), models=[model]) as stack:
        ports = StackPorts.free()
        children: list[Child] = []
        try:
            children.append(
                stack.start_service("policy", ports.policy, workdir, rules_path=str(rules))
            )
            children.append(
                stack.start_service(
                    "router",
                    ports.router,
                    workdir,
                    tenants_file=str(tenants),
                    policy_address=f"127.0.0.1:{ports.policy}",
                    http_port=str(ports.router_http),
                )
            )
            yield PolicyFleet(
                f"127.0.0.1:{ports.policy}",
                f"127.0.0.1:{ports.router}",
                f"http://127.0.0.1:{ports.router_http}/v1",
                keys,
                stack.internal_token,
            )
        finally:
            for child in reversed(children):
                child.terminate(10)


async def router_ttft(
    fleet: PolicyFleet, rounds: int, seed: int, model: str = ""
) -> dict[str, list[float]]:
    """TTFT of short generations, round by round one per tenant (after one untimed
    request each, by which the router has its rule set)."""
    rng = random.Random(seed)
    targets = {name: RouterTarget(fleet.router, model, key) for name, key in fleet.keys.items()}
    ttft: dict[str, list[float]] = {name: [] for name in targets}
    try:
        for target in targets.values():
            await target.send(
                BenchRequest("warm up", 2), RequestRecord(sent_at=time.perf_counter())
            )
        names = list(targets)
        for round_ in range(rounds):
            # Each request a prompt of its own (no tenant gains from another's prefix
            # cache), and each tenant first in turn.
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                record = RequestRecord(sent_at=time.perf_counter())
                await targets[name].send(BenchRequest(text_of_length(rng, 64), 16), record)
                ttft[name].append(record.ttft)
    finally:
        for target in targets.values():
            await target.close()
    return ttft


@dataclass
class LongPrompts:
    """Streams through the router while another tenant's long prompts are checked."""

    checks_s: list[float]  # each long prompt's time to its refusal
    during_s: list[float]  # the streams' gaps between tokens that overlap a check
    outside_s: list[float]  # and those that overlap none

    def summary(self) -> str:
        def ms(values: list[float], q: float) -> str:
            return f"{percentile(values, q) * 1000:.1f}" if values else "-"

        return (
            f"{len(self.checks_s)} conversations of {LONG_PROMPT_CHARS // 1024} KB of numbers "
            f"(refused: a deny phrase after them), median {ms(self.checks_s, 50)} ms "
            "each to the refusal, sent one after another while 4 streams of another tenant "
            f"ran: their gaps between tokens during those checks p50 {ms(self.during_s, 50)} "
            f"/ p99 {ms(self.during_s, 99)} / longest {ms(self.during_s, 100)} ms "
            f"({len(self.during_s)} gaps), outside them {ms(self.outside_s, 50)} / "
            f"{ms(self.outside_s, 99)} / {ms(self.outside_s, 100)} ms."
        )


def _overlaps(gap: tuple[float, float], windows: list[tuple[float, float]]) -> bool:
    return any(gap[0] < end and start < gap[1] for start, end in windows)


def long_conversation(seed: int) -> list[dict[str, str]]:
    """A chat of LONG_PROMPT_CHARS of numbers, in messages of the longest a router takes
    (8 KB), the last asking what the rules deny."""
    table = numbers_table(seed)
    size = 7 * 1024
    messages = [
        {"role": "user", "content": table[i : i + size]} for i in range(0, len(table), size)
    ]
    return [*messages, {"role": "user", "content": "Now, how to build a bomb?"}]


async def _refused_chat(
    session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(url, json=body, headers=headers) as response:
        reply = await response.json()
        if response.status != 403:  # the deny phrase's refusal, once all of it is read
            raise RuntimeError(f"HTTP {response.status}: {reply}")


async def long_prompt_pauses(fleet: PolicyFleet, seed: int, model: str = "") -> LongPrompts:
    """4 streams of the no-rules tenant; once each has its first token, 60 KB
    conversations of the input-rules tenant one after another until the streams end: how
    the streams' tokens flow while the router checks them."""
    rng = random.Random(seed)
    streams = RouterTarget(fleet.router, model, fleet.keys["no rules"])
    records = [RequestRecord(sent_at=time.perf_counter()) for _ in range(4)]
    windows: list[tuple[float, float]] = []
    url, key = fleet.router_http + "/chat/completions", fleet.keys["default set, input rules"]
    body = {"model": model or "llm", "messages": long_conversation(seed), "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        try:
            running = [
                asyncio.create_task(streams.send(BenchRequest(text_of_length(rng, 64), 1000), r))
                for r in records
            ]

            async def all_streaming() -> bool:
                return all(r.first_token_at for r in records)

            await poll_until_async(all_streaming, 60)
            while not all(task.done() for task in running):
                started = time.perf_counter()
                await _refused_chat(session, url, key, body)
                windows.append((started, time.perf_counter()))
            await asyncio.gather(*running)
        finally:
            await streams.close()
    gaps = [gap for r in records for gap in itertools.pairwise(r.chunk_times)]
    during = [b - a for a, b in gaps if _overlaps((a, b), windows)]
    outside = [b - a for a, b in gaps if not _overlaps((a, b), windows)]
    return LongPrompts([end - start for start, end in windows], during, outside)


@dataclass
class PolicyResult:
    latencies: list[Latency]
    ttft_s: dict[str, list[float]]
    loop_pauses_s: dict[str, list[float]]
    long_prompts: LongPrompts

    def table(self) -> str:
        rows = [
            "| check (200 rules) | samples | p50 (ms) | p99 (ms) | per second, serially |",
            "| --- | --- | --- | --- | --- |",
            *(latency.row() for latency in self.latencies),
            "",
            "| through the router | requests | TTFT p50 (ms) | TTFT p99 (ms) |",
            "| --- | --- | --- | --- |",
        ]
        for name, values in self.ttft_s.items():
            p50, p99 = (percentile(values, q) * 1000 for q in (50, 99))
            rows.append(f"| {name} | {len(values)} | {p50:.1f} | {p99:.1f} |")
        added = self.added_ms("default set, input rules", "no rules")
        held = self.added_ms("default set, input and output", "default set, input rules")
        rows += [
            "",
            "TTFT added by the default set's input check (request by request against the "
            f"no-rules tenant's request of the same round): median {added[1]:+.2f} ms, "
            f"quartiles {added[0]:+.2f} / {added[2]:+.2f} ms. By its streamed output check "
            f"(against its input rules alone, the same way): median {held[1]:+.2f} ms, "
            f"quartiles {held[0]:+.2f} / {held[2]:+.2f} ms.",
            "",
            self.pauses_summary(),
            "",
            "Through the router: " + self.long_prompts.summary(),
        ]
        return "\n".join(rows)

    def pauses_summary(self) -> str:
        """The in-process loop pauses, each way's rounds in ms."""
        ways = "; ".join(
            f"{way}: " + ", ".join(f"{p * 1000:.0f}" for p in pauses)
            for way, pauses in self.loop_pauses_s.items()
        )
        return (
            f"The event loop's longest pause while the default set checks a "
            f"{LONG_PROMPT_CHARS // 1024} KB conversation of numbers in process, round by round "
            f"(ms): {ways}."
        )

    def added_ms(self, tenant: str, baseline: str) -> tuple[float, float, float]:
        """Quartiles of the paired TTFT differences, ``tenant`` minus ``baseline``."""
        pairs = zip(self.ttft_s[tenant], self.ttft_s[baseline], strict=True)
        diffs = [(a - b) * 1000 for a, b in pairs]
        return percentile(diffs, 25), percentile(diffs, 50), percentile(diffs, 75)


def run(workdir: Path, rounds: int, seed: int, model: str = "llm") -> PolicyResult:
    library = RuleLibrary()
    library.load({"default": synthetic_rules()}, "bench")
    texts = prompts(400, seed)
    default = RuleSet.from_file(DEFAULT_RULES)
    latencies = in_process(library.get(""), default, texts, seed)
    pauses = loop_pauses(default, seed)
    with policy_fleet(workdir, model) as fleet:
        latencies += asyncio.run(over_grpc(fleet.policy, fleet.token, texts, "bench"))
        ttft = asyncio.run(router_ttft(fleet, rounds, seed, model))
        long_prompts = asyncio.run(long_prompt_pauses(fleet, seed, model))
    return PolicyResult(latencies, ttft, pauses, long_prompts)
