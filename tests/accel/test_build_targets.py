"""The native kernels compile for every instruction set they are written for, whatever CPU runs
the tests: AVX2 with FMA (AVX-512's intrinsics emulated, ``csrc/avx2.h``), AVX-512, and
AVX-512 with AVX512-BF16 and AMX tiles. And on a CPU that has one of them, they build and
load: otherwise a change that breaks one target would leave that CPU on PyTorch's kernels
with every kernel test skipped, which is how the backend's tests went unrun once before."""

import os
import subprocess

import pytest

from postrl.accel import build, library

TARGETS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "avx512-bf16-amx": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                        "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return set(next(line for line in info if line.startswith("flags")).split()[2:])
    except (OSError, StopIteration):
        return set()


def compiles(flags: list[str], out) -> subprocess.CompletedProcess:
    cc = build.compiler()
    common = [flag for flag in build.FLAGS if flag != "-march=native"]
    return subprocess.run([cc, *common, *flags, "-Werror", *map(str, build.SOURCES), "-o",
                           str(out), "-lm"], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("target", list(TARGETS))
def test_the_kernels_compile_for(target, tmp_path):
    probe = subprocess.run([build.compiler(), *TARGETS[target], "-x", "c", "-c", "-", "-o",
                            os.devnull], input="int x;\n", capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"this compiler does not know {' '.join(TARGETS[target])}")
    built = compiles(TARGETS[target], tmp_path / "kernels.so")
    assert built.returncode == 0, built.stderr[-4000:]


@pytest.mark.skipif(build.compiler() is None or os.environ.get(library.SWITCH) == "0",
                    reason="no C compiler, or the kernels switched off")
def test_a_cpu_they_are_written_for_builds_and_loads_them():
    flags = cpu_flags()
    if not ("avx512f" in flags or {"avx2", "fma"} <= flags):
        pytest.skip("this CPU has neither AVX-512F nor AVX2 with FMA")
    assert library.library() is not None, library.unavailable_reason()
