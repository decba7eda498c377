"""Which BLAS kernels the launcher names for Triton's engine."""

from __future__ import annotations

from pathlib import Path

from llmmesh.launcher.blas import AVX512, CORETYPE, cpu_flags, openblas_environment

ZEN5_FLAGS = "fpu sse2 avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {ZEN5_FLAGS}\n")
    assert cpu_flags(cpuinfo) >= AVX512
    assert "avx2" in cpu_flags(cpuinfo)


def test_no_cpuinfo_means_no_flags(tmp_path: Path) -> None:
    assert cpu_flags(tmp_path / "absent") == frozenset()


def test_an_avx512_cpu_gets_the_avx512_kernels() -> None:
    env = openblas_environment({"PATH": "/bin"}, frozenset(ZEN5_FLAGS.split()))
    assert env == {"PATH": "/bin", CORETYPE: "SkylakeX"}


def test_a_core_type_the_user_chose_is_kept() -> None:
    env = openblas_environment({CORETYPE: "Haswell"}, frozenset(ZEN5_FLAGS.split()))
    assert env[CORETYPE] == "Haswell"


def test_other_cpus_are_left_to_openblas() -> None:
    assert CORETYPE not in openblas_environment({}, frozenset({"avx2", "fma", "avx512f"}))
