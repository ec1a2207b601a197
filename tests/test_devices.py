"""devices.py: dtype choice per device, and the glibc allocator switch train.py applies on a CPU."""
import subprocess
import sys
from pathlib import Path

import devices
import train


def test_cpu_dtype_follows_native_bf16(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: False)
    assert devices.resolve_dtype("auto", "cpu") == train.choose_dtype("auto", "cpu") == "float32"
    assert train.choose_compile("auto", "cpu", "float32") is False  # fp32 eager: compile measured no faster
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: True)
    assert devices.resolve_dtype("auto", "cpu") == train.choose_dtype("auto", "cpu") == "bfloat16"
    assert train.choose_compile("auto", "cpu", "bfloat16") is True
    assert devices.resolve_dtype("auto", "mps") == "float32"
    assert train.choose_dtype("float16", "cpu") == "float16" and train.choose_compile(False, "cpu", "bfloat16") is False


ALLOCATOR_PROBE = """
import resource, sys, torch, devices
from bench.scoreboard import status_kb

def alloc_touch_free(n_bytes):  # (pages faulted in, bytes of RSS still held afterwards)
    rss0, faults0 = status_kb("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(n_bytes // 4)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0, (status_kb("VmRSS") - rss0) * 1024

if not devices.set_malloc_tuned(False):
    sys.exit(f"not glibc {devices.glibc()}")
n = 128 << 20  # above glibc's largest mmap threshold (32 MiB): mmapped, then unmapped on free
print(*alloc_touch_free(n))
devices.set_malloc_tuned(True)
for _ in range(3):
    print(*alloc_touch_free(n))
print(devices.malloc_tuned())
"""


def test_tuned_malloc_keeps_freed_big_blocks_mapped_and_glibc_mode_returns_them():
    # a fresh process: a heap that earlier tests grew could serve the first block without mmap
    run = subprocess.run([sys.executable, "-c", ALLOCATOR_PROBE], capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent)
    if run.returncode:
        assert "not glibc None" in run.stderr, run.stderr  # only a non-glibc libc may lack the switch
        return
    lines = run.stdout.split("\n")
    n = 128 << 20
    faults, held = map(int, lines[0].split())
    assert faults > n // 4096 // 2 and held < n // 4  # glibc: faulted in, then handed back
    for line in lines[1:4]:  # tuned: whether the heap reuses a freed block or grows, no faulted page is returned
        faults, held = map(int, line.split())
        assert held >= 0.8 * faults * 4096
    assert faults < n // 4096 // 2 or held > n // 2
    assert lines[4] == "True"
