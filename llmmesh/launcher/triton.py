"""Finds the Triton server bundled in the nvidia-pytriton wheel and prepares it to run.

The wheel ships ``pytriton/tritonserver/bin/tritonserver``, its shared libraries in
``nvidia_pytriton.libs/``, the Python backend, and one backend stub per Python version.
Triton expects the stub inside the backend directory, so we assemble one per stack.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmmesh.launcher.blas import cpu_flags, openblas_environment
from llmmesh.launcher.process import Child, StackError


class TritonNotFound(StackError):
    """The Triton server bundled with nvidia-pytriton is missing or incomplete."""


@dataclass(frozen=True)
class TritonDist:
    server: Path
    libs: Path
    python_backend: Path
    stub: Path

    @classmethod
    def locate(cls) -> TritonDist:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonNotFound("nvidia-pytriton is not installed (pip install nvidia-pytriton)")
        root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        dist = cls(
            server=root / "bin" / "tritonserver",
            libs=root.parent.parent / "nvidia_pytriton.libs",
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        )
        for path in (dist.server, dist.libs, dist.python_backend, dist.stub):
            if not path.exists():
                raise TritonNotFound(f"incomplete nvidia-pytriton install: {path} is missing")
        return dist

    def backend_dir(self, workdir: Path) -> Path:
        """A backend directory holding the Python backend and the stub for this Python."""
        target = workdir / "backends" / "python"
        target.mkdir(parents=True, exist_ok=True)
        for source in [
            *self.python_backend.glob("*.so"),
            *self.python_backend.glob("*.py"),
            self.stub,
        ]:
            link = target / source.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(source)
        return workdir / "backends"

    def environment(self) -> dict[str, str]:
        """Environment for tritonserver: its libraries, this venv first on PATH so the
        backend stub's embedded interpreter finds the venv's packages (numpy), and the
        BLAS kernels for this CPU."""
        env = openblas_environment(os.environ, cpu_flags())
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(self.libs), env.get("LD_LIBRARY_PATH", "")) if p
        )
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        return env


def triton_command(
    dist: TritonDist,
    model_repository: Path,
    backend_dir: Path,
    host: str,
    ports: tuple[int, int, int],
    *,
    models: Sequence[str] = (),
) -> list[str]:
    """Triton's command line; ``models``: the models loaded at start (default: all)."""
    grpc_port, http_port, metrics_port = ports
    return [
        str(dist.server),
        f"--model-repository={model_repository}",
        f"--backend-directory={backend_dir}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        f"--http-address={host}",
        f"--http-port={http_port}",
        f"--metrics-address={host}",
        f"--metrics-port={metrics_port}",
        # Explicit model control, the models loaded at start: the inference service
        # reloads a model whose backend process died (services/inference/health.py).
        "--model-control-mode=explicit",
        *(f"--load-model={model}" for model in models or ["*"]),
        "--allow-gpu-metrics=false",
        # Stopped after the inference services have drained, Triton has nothing left to
        # finish but what is stuck (a request to a backend process that died): its exit
        # timeout only delays the stack's stop.
        "--exit-timeout-secs=3",
        "--log-info=false",
    ]


def start_triton(
    workdir: Path,
    model_repository: Path,
    host: str,
    ports: tuple[int, int, int],
    log_path: Path,
    *,
    append: bool = False,
    models: Sequence[str] = (),
) -> Child:
    """Starts tritonserver (gRPC, HTTP, metrics ports) on ``model_repository``, loading
    ``models`` (default: every model there)."""
    dist = TritonDist.locate()
    backends = dist.backend_dir(workdir)
    command = triton_command(dist, model_repository, backends, host, ports, models=models)
    return Child.spawn("triton", command, dist.environment(), log_path, workdir, append=append)


def wait_until_ready(
    triton: Child, grpc_address: str, deadline: float, models: Sequence[str] = ("llm",)
) -> None:
    """Returns once Triton reports itself and ``models`` ready."""
    import tritonclient.grpc as triton_grpc

    client = triton_grpc.InferenceServerClient(grpc_address)
    try:
        triton.wait_until(
            lambda: bool(client.is_server_ready() and all(map(client.is_model_ready, models))),
            deadline,
            f"load {', '.join(models)}",
        )
    finally:
        client.close()
