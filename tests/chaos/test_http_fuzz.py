"""The HTTP API fuzzed from its own OpenAPI document (schemathesis): valid and invalid
bodies for every operation, through the real router. No request may be a 5xx but a 504
past a deadline: every dependency is up, so a 503 would be a client's input taken for an
outage (counted against a replica, and retried by clients); and every refusal is
OpenAI's error JSON. The count goes to bench/results/http_fuzz.json."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from llmmesh.launcher import Stack, StackPorts

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "http_fuzz.json"
TALLY: Counter[str] = Counter()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("http-fuzz"), StackPorts.free()) as stack:
        yield stack
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(dict(TALLY), indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def api(stack: Stack) -> Any:
    base = f"http://{stack.address('router_http')}"
    return schemathesis.openapi.from_url(f"{base}/openapi.json")


def test_no_request_is_a_server_error(api: Any, stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) == 14  # every operation of the document, GET probes included
    for operation in operations:

        @settings(
            max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(operation.as_strategy())
        def answered(case: Any) -> None:
            response = case.call(headers=headers, timeout=30)
            TALLY[f"{case.method} {case.path} {response.status_code}"] += 1
            if response.status_code >= 500:
                TALLY[f"{response.status_code}: {response.json()['error']['message']}"] += 1
            assert response.status_code < 500 or response.status_code == 504, response.text
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and isinstance(error["type"], str)

        answered()
