"""A stack's services run the code of the checkout its launcher runs from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llmmesh.launcher import Stack
from llmmesh.launcher.stack import CODE_ROOT


def test_services_import_the_launchers_checkout_from_any_directory(tmp_path: Path) -> None:
    env = Stack(tmp_path).service_env("policy")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(CODE_ROOT)
    where = subprocess.run(
        [sys.executable, "-c", "import services; print(services.__path__[0])"],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()) == CODE_ROOT / "services"


def test_a_stack_given_another_checkout_runs_that_one(tmp_path: Path) -> None:
    other = str(tmp_path / "other-checkout")
    env = Stack(tmp_path, env={"PYTHONPATH": other}).service_env("router")
    assert env["PYTHONPATH"] == other
