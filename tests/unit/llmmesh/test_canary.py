"""`llm-mesh canary`: split arithmetic, and writes to the routing file and to Consul KV."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import consul
import pytest

from llmmesh.canary import (
    CanaryError,
    ConsulRouting,
    FileRouting,
    Observed,
    new_split,
    parse_weights,
    status_table,
)
from llmmesh.cli import main
from services.router.routing import parse_policy
from tests.consul_double import ConsulDoubleThread


def test_named_weights_are_set_and_the_rest_share_what_is_left() -> None:
    assert new_split({"stable": 100, "canary": 0}, {"canary": 10}) == {
        "canary": 10,
        "stable": 90,
    }
    assert new_split({"a": 30, "b": 10, "c": 60}, {"c": 20}) == {"a": 60, "b": 20, "c": 20}
    assert new_split({}, {"canary": 100}) == {"canary": 100}
    with pytest.raises(CanaryError, match="more than 100%"):
        new_split({"stable": 1}, {"a": 60, "b": 60})
    with pytest.raises(CanaryError, match="above 0"):
        new_split({}, {"canary": 0})


@pytest.mark.parametrize("item", ["canary", "canary=", "=5", "canary=x", "canary=101"])
def test_bad_weights_are_refused(item: str) -> None:
    with pytest.raises(CanaryError, match="subset=percent"):
        parse_weights([item])


def test_the_file_keeps_the_rest_of_the_document(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text("# comment\nsplit: {stable: 100, canary: 0}\ncolors: {c: canary}\n")
    assert main(["canary", "set", "--weight", "canary=25", "--routing-file", str(path)]) == 0
    policy = parse_policy(path.read_text())
    assert policy.split == {"canary": 25, "stable": 75}
    assert policy.colors == {"c": "canary"}


def test_a_write_the_router_would_refuse_is_not_made(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text("split: {stable: 100}\nalgorithm: fastest\n")  # already invalid
    before = path.read_text()
    with pytest.raises(CanaryError, match="would be invalid"):
        FileRouting(path).update({"canary": 10})
    assert path.read_text() == before


def test_consul_writes_check_and_set_so_concurrent_edits_both_land() -> None:
    with ConsulDoubleThread() as double:
        host, port = double.address.split(":")
        client = consul.Consul(host=host, port=int(port))
        client.kv.put("llm-mesh/routing", json.dumps({"split": {"stable": 100}, "regions": ["b"]}))
        routing = ConsulRouting(client)
        writers = [
            threading.Thread(target=routing.update, args=({subset: 10},))
            for subset in ("canary", "blue")
        ]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join(10)
        split = routing.read()["split"]
        # Neither write was lost: the second one started from the first one's document.
        assert set(split) == {"stable", "canary", "blue"}
        assert 10 in (split["canary"], split["blue"])
        assert sum(split.values()) == pytest.approx(100)
        assert routing.read()["regions"] == ["b"]


def test_status_puts_configured_and_observed_side_by_side() -> None:
    table = status_table({"stable": 90, "canary": 10}, Observed({"stable": 45, "canary": 6}))
    rows = [line.split() for line in table.splitlines()[1:]]
    assert rows == [["canary", "10.0%", "11.8%", "6"], ["stable", "90.0%", "88.2%", "45"]]
