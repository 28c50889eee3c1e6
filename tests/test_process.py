"""keep_freed_memory: large tensors come from malloc's heap and their memory stays there
for reuse, instead of being mapped and unmapped at every allocation; return_freed_memory: the
opposite, down to tensors of a megabyte.

Each case runs in a fresh interpreter: the setting is process-wide, and this one may already
have it (every Trainer applies it).
"""

import subprocess
import sys
import textwrap

import pytest

from postrl.process import _glibc_function

PROBE = textwrap.dedent("""
    import sys
    import torch
    from postrl.process import (_glibc_function, _MallocInfo, free_heap_bytes,
                                keep_freed_memory, return_freed_memory)

    info = _glibc_function("mallinfo2")  # glibc >= 2.33
    info.restype = _MallocInfo
    if sys.argv[1] == "keep":
        applied = keep_freed_memory()
    elif sys.argv[1] == "return":
        applied = return_freed_memory()
    elif sys.argv[1].startswith("trainer"):  # the option, through a real Trainer
        from postrl.config import load_config
        from postrl.train.trainer import Trainer

        Trainer(load_config(None, ["model=tiny", "task=arithmetic", "quiet=true",
                                   f"out={sys.argv[2]}", sys.argv[1].split(":")[1]]))
        applied = None
    else:
        applied = None
    # a freed mapped block of 16 MB raises glibc's own threshold to 16 MB (unless fixed)
    raised = torch.ones(4 * 2**20)
    del raised
    size = 64 * 2**20
    tensor = torch.ones(size // 4)  # 64 MB, twice glibc's largest mmap threshold
    held = info()
    del tensor
    kept = free_heap_bytes() >= size  # the heap holds the freed tensor for reuse
    # 2 MB tensors, more than the heap's free blocks can hold: mapped, or from the heap
    before = info().hblkhd
    small = [torch.ones(2**19) for _ in range(128)]
    small_mapped = info().hblkhd - before >= 64 * 2**21
    print(applied, held.hblkhd >= size, kept, small_mapped)
""")


def probe(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


needs_glibc = pytest.mark.skipif(_glibc_function("mallinfo2") is None,
                                 reason="needs glibc >= 2.33")


@needs_glibc
def test_by_default_a_large_tensor_is_mapped_and_its_memory_returned():
    applied, mapped, kept, small_mapped = probe("default")
    assert (mapped, kept, small_mapped) == ("True", "False", "False")


@needs_glibc
def test_keep_freed_memory_serves_large_tensors_from_the_heap_and_keeps_them():
    applied, mapped, kept, small_mapped = probe("keep")
    assert (applied, mapped, kept, small_mapped) == ("True", "False", "True", "False")


@needs_glibc
def test_return_freed_memory_maps_tensors_of_a_megabyte_and_returns_them():
    applied, mapped, kept, small_mapped = probe("return")
    assert (applied, mapped, kept, small_mapped) == ("True", "True", "False", "True")


@needs_glibc
def test_the_trainer_keeps_freed_memory_unless_told_not_to(tmp_path):
    on = probe("trainer:reuse_freed_memory=true", str(tmp_path / "on"))
    assert on[1:] == ["False", "True", "False"]
    off = probe("trainer:reuse_freed_memory=false", str(tmp_path / "off"))
    assert off[1:] == ["True", "False", "True"]
