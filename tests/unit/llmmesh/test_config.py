from __future__ import annotations

from pathlib import Path

import pytest

from llmmesh.runtime.config import ConfigError, load_config
from services.router.config import RouterConfig


def test_defaults_without_file_or_environment() -> None:
    config = load_config(RouterConfig, "router", environ={})
    assert config.grpc_port == 50051
    assert config.models == ["llm", "llm_canary"]


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("grpc_port: 6000\nmax_tokens_limit: 10\nmodels: [a, b]\n")
    environ = {
        "LLM_MESH_ROUTER_GRPC_PORT": "7000",
        "LLM_MESH_ROUTER_INFERENCE_ADDRESSES": '["h:1", "h:2"]',
        "LLM_MESH_POLICY_GRPC_PORT": "1",  # another service's: ignored
    }
    config = load_config(RouterConfig, "router", path, environ)
    assert config.grpc_port == 7000
    assert config.max_tokens_limit == 10
    assert config.models == ["a", "b"]
    assert config.inference_addresses == ["h:1", "h:2"]


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("default_max_tokens: 3\n")
    config = load_config(RouterConfig, "router", environ={"LLM_MESH_ROUTER_CONFIG": str(path)})
    assert config.default_max_tokens == 3


def test_config_is_frozen() -> None:
    config = load_config(RouterConfig, "router", environ={})
    with pytest.raises(ValueError, match="frozen"):
        config.grpc_port = 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("grpc_port: nope\n", "grpc_port"),
        ("unknown_key: 1\n", "unknown_key"),
        ("- a list\n", "mapping"),
        ("grpc_port: [\n", "cannot read"),
    ],
)
def test_bad_config_names_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_config(RouterConfig, "router", path, environ={})


def test_bad_environment_value_names_the_field() -> None:
    with pytest.raises(ConfigError, match="max_tokens_limit"):
        load_config(RouterConfig, "router", environ={"LLM_MESH_ROUTER_MAX_TOKENS_LIMIT": "x"})
