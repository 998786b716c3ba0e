"""The server's allocator setting: freed message memory serves the next messages without page faults."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's"),
]

ROUNDS, BLOCKS = 20, 16  # each round allocates and frees 16 blocks of 1 MiB, like a burst of 1 MiB messages
CHURN = f"""
import ctypes, resource, sys
from melissa_dl.runtime.allocator import keep_freed_memory
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, and so faults, whatever the kernel's default
kept = keep_freed_memory() if sys.argv[1] == "set" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [bytearray(1 << 20) for _ in range({BLOCKS})]  # the heap grows once
del blocks
before = faults()
for _ in range({ROUNDS}):
    blocks = [bytearray(1 << 20) for _ in range({BLOCKS})]
    del blocks
print(kept, faults() - before)
"""
PAGES = ROUNDS * BLOCKS * (1 << 20) // os.sysconf("SC_PAGE_SIZE")


def churn(mode: str, **environ: str) -> tuple[str, int]:
    """Whether the setting was made, and the page faults of the rounds after the first."""
    env = {
        name: value for name, value in os.environ.items() if name != "GLIBC_TUNABLES" and not name.startswith("MALLOC_")
    }
    result = subprocess.run(
        [sys.executable, "-c", CHURN, mode], env={**env, **environ}, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    kept, faults = result.stdout.split()
    return kept, int(faults)


def test_freed_blocks_are_reused_without_faulting_their_pages_in_again() -> None:
    kept, faults = churn("set")
    assert kept == "True" and faults < PAGES // 100
    kept, faults = churn("default")  # glibc's defaults give the freed heap top back: every page faults again
    assert kept == "None" and faults > PAGES // 2


@pytest.mark.parametrize(
    "environ", [{"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, {"MALLOC_TRIM_THRESHOLD_": "1"}]
)
def test_a_users_own_malloc_setting_wins(environ: dict[str, str]) -> None:
    kept, faults = churn("set", **environ)
    assert kept == "False" and faults > PAGES // 2


RELEASE = """
import sys
from melissa_dl.runtime.allocator import FreedMemory, keep_freed_memory
assert keep_freed_memory()
def resident():
    return int(open("/proc/self/statm").read().split()[1])
blocks = [bytearray(64 << 10) for _ in range(2048)]  # 128 MiB of the heap, each page touched
del blocks[::2]  # every other block freed: holes that no trim of the heap's top reaches
before = resident()
freed = FreedMemory(interval=float(sys.argv[1]))
print(freed.release_if_due(), before - resident())
"""


def release(interval: float) -> tuple[str, int]:
    """Whether freed memory was given back at once, and by how many pages resident memory fell."""
    result = subprocess.run([sys.executable, "-c", RELEASE, str(interval)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    released, pages = result.stdout.split()
    return released, int(pages)


def test_freed_memory_kept_for_messages_goes_back_to_the_kernel_once_an_interval() -> None:
    held = (64 << 20) // os.sysconf("SC_PAGE_SIZE")  # the freed half
    released, pages = release(0.0)
    assert released == "True" and pages > held // 2
    released, pages = release(3600.0)  # not yet due: nothing changes
    assert released == "False" and abs(pages) < held // 10
