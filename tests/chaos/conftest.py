"""The fault campaign runs on its own (make chaos, LLM_MESH_CHAOS=1): a few minutes of
kills under load. The suite's short form of it is the kill tests of tests/e2e
(test_cli.py, test_model_health.py); elsewhere these are deselected at collection."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chaos = [item for item in items if "tests/chaos/" in str(item.path)]
    if chaos and not os.environ.get("LLM_MESH_CHAOS"):
        config.hook.pytest_deselected(items=chaos)
        items[:] = [item for item in items if item not in chaos]
