"""Structured outputs' checks: whether a JSON schema, a pattern or a list of choices
compiles (llguidance's own check, the one the engine makes), kept per tenant, and compiled
off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import NamedTuple

from llmmesh.runtime.errors import InvalidArgument

# The kinds the mesh takes (the router's names; types.py maps them to vLLM's). A choice's
# spec is the JSON text of its list of options.
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice")
MAX_STRUCTURE_CHARS = 65536

_Key = tuple[str, int, int]  # a structure's kind, length and hash (see _key)


class CachePartition(NamedTuple):
    """Where a check's result is kept: ``group``, the tenant's prefix-cache group, which
    has a bounded share of its own, and ``salt``, its partition within that group."""

    group: str = ""
    salt: str = ""


class StructureChecks:
    """Why each structure does not compile ("" if it does), kept: a client sends the same
    schema with every request, and a large one takes tens of milliseconds to compile.
    Each group keeps its own ``per_group`` most recent, keyed by partition and structure: a
    shared cache would answer one tenant's schema faster had another sent it, and one
    tenant's new schemas would evict another's. ``groups`` bounds the groups kept."""

    def __init__(self, per_group: int = 64, groups: int = 256) -> None:
        self._per_group, self._groups = per_group, groups
        self._kept: OrderedDict[str, OrderedDict[tuple[str, _Key], str]] = OrderedDict()
        self._lock = threading.Lock()  # compiles run on worker threads
        self.compiled = 0  # structures compiled (not found kept)

    def kept(self, partition: CachePartition, kind: str, spec: str) -> bool:
        with self._lock:
            return self._find(partition, _key(kind, spec)) is not None

    def error(self, partition: CachePartition, kind: str, spec: str) -> str:
        key = _key(kind, spec)
        with self._lock:
            found = self._find(partition, key)
        if found is not None:
            return found
        error = _compile_error(kind, spec)  # outside the lock: the slow part
        with self._lock:
            self.compiled += 1
            group = self._kept.setdefault(partition.group, OrderedDict())
            self._kept.move_to_end(partition.group)
            group[(partition.salt, key)] = error
            if len(group) > self._per_group:
                group.popitem(last=False)
            if len(self._kept) > self._groups:
                self._kept.popitem(last=False)
        return error

    def _find(self, partition: CachePartition, key: _Key) -> str | None:
        group = self._kept.get(partition.group)
        if group is None or (found := group.get((partition.salt, key))) is None:
            return None
        group.move_to_end((partition.salt, key))
        self._kept.move_to_end(partition.group)
        return found


CHECKED = StructureChecks()
SHARED = CachePartition()  # one partition for all: where requests carry no tenant


def check_structure(
    kind: str,
    spec: str,
    field: str = "sampling.structured_output",
    partition: CachePartition = SHARED,
) -> None:
    """InvalidArgument naming ``field`` unless the structure compiles; the result is kept
    in ``partition`` (at the router, the tenant's prefix-cache partition)."""
    if kind not in STRUCTURED_KINDS:
        raise InvalidArgument(field, f"one of {', '.join(STRUCTURED_KINDS)}, got {kind!r:.40}")
    if len(spec) > MAX_STRUCTURE_CHARS:
        raise InvalidArgument(field, f"at most {MAX_STRUCTURE_CHARS} characters")
    error = CHECKED.error(partition, kind, spec)
    if error:
        raise InvalidArgument(field, error)


async def compile_structure(structure: tuple[str, str], partition: CachePartition) -> None:
    """Compiles a structure not yet kept on a worker thread, so that check_structure then
    finds it: on the event loop a large schema would stall every stream the loop serves.
    Skips what check_structure refuses before compiling."""
    kind, spec = structure
    if kind not in STRUCTURED_KINDS or len(spec) > MAX_STRUCTURE_CHARS:
        return
    if not CHECKED.kept(partition, kind, spec):
        await asyncio.to_thread(CHECKED.error, partition, kind, spec)


def _key(kind: str, spec: str) -> tuple[str, int, int]:
    """The key a structure is kept under: small whatever the schema's size, and cheap to
    make twice (a string keeps its hash). Python's string hash is keyed afresh in every
    process, so no client can make two of its structures collide on purpose; by chance,
    one in 2^64, and only within the partition that sent both."""
    return kind, len(spec), hash(spec)


def _compile_error(kind: str, spec: str) -> str:
    from llguidance import LLMatcher

    try:
        if kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = LLMatcher.grammar_from_regex(_choice_pattern(choice_options(spec)))
        else:
            schema = json.loads(spec) if kind == "json_schema" else {"type": "object"}
            if not isinstance(schema, dict):
                return "a JSON schema is an object"
            grammar = LLMatcher.grammar_from_json_schema(schema)
        error = str(LLMatcher.validate_grammar(grammar))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError included
        return f"not a {kind.replace('_', ' ')}: {str(exc)[:200]}"
    except BaseException as exc:  # a panic in the compiler arrives as a BaseException
        if not type(exc).__name__.startswith("Panic"):
            raise
        return "does not compile (the compiler failed on it)"
    return "" if not error or error.startswith("WARNING") else f"does not compile: {error[:300]}"


def readable(kind: str, spec: str) -> str:
    """A structure's text as the checks read it: a schema's or a choice's JSON written
    again with its strings as they are, so that no escape (``\\u0062omb``) hides from them
    what the model will be made to write; a pattern as given. Not kept between requests:
    a cache shared by tenants would time one tenant's schemas by another's."""
    if kind not in ("json_schema", "choice"):
        return spec
    try:
        return json.dumps(json.loads(spec), ensure_ascii=False)
    except (ValueError, RecursionError):  # refused by the structure's check before
        return spec


def choice_spec(options: list[str]) -> str:
    """A choice's spec: its options' JSON text, as written (policy reads it)."""
    return json.dumps(options, ensure_ascii=False)


def choice_options(spec: str) -> list[str]:
    """A choice's options from its spec; ValueError unless a list of non-empty texts."""
    options = json.loads(spec)
    if not isinstance(options, list) or not options:
        raise ValueError("a list of one option or more")
    if not all(isinstance(o, str) and o for o in options):
        raise ValueError("an option is empty or not a text")
    return options


def _choice_pattern(options: list[str]) -> str:
    """The regular expression that matches exactly one of ``options`` (the engine's)."""
    return "|".join("".join(f"\\{c}" if c in _REGEX_SPECIAL else c for c in o) for o in options)


_REGEX_SPECIAL = frozenset(r"\.^$*+?{}[]|()/-")
