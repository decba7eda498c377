"""Watched documents (routing, tenants, rule sets): each version is validated whole
before it replaces the one in force; an invalid one is refused, logged and counted, and
the one in force stays."""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import Counter

log = logging.getLogger(__name__)

REJECTED = Counter(
    "llm_documents_rejected_total",
    "Document versions refused as invalid (the one in force stayed)",
    ["document", "source"],
)


def offer(document: str, source: str, apply: Callable[[], object]) -> bool:
    """Runs ``apply`` (it parses, validates and swaps the new version in, or raises
    ValueError saying why not); True if the version was applied."""
    try:
        apply()
    except ValueError as err:
        REJECTED.labels(document, source).inc()
        log.warning(
            f"{document} document rejected; the previous one stays in force",
            extra={"fields": {"document": document, "source": source, "reason": str(err)}},
        )
        return False
    return True
