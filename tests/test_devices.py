"""devices.py: the one dtype/compile policy, the GPU peak table, error classification, and the glibc
allocator switch every script applies on a CPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2train import devices

ROOT = Path(__file__).resolve().parent.parent


def test_requirements_torch_floor_is_the_one_the_code_checks():
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    torch_specs = [line for line in lines if line.startswith("torch")]
    assert torch_specs == [f"torch>={'.'.join(map(str, devices.MIN_TORCH))}"]


@pytest.mark.parametrize(
    "version, ok",
    [
        ("2.13.0+cpu", True),
        ("2.6.0", True),
        ("2.6.0a0+ecf3bae40a.nv25.01", True),
        ("3.0.0", True),
        ("2.5.1+cu124", False),
        ("2.3.0", False),
        ("1.13.1", False),
        ("2.10.0", True),  # 2.10 > 2.6, not "2.1"
    ],
)
def test_torch_version_floor(version, ok):
    problem = devices.torch_version_problem(version, minimum=(2, 6))
    assert (problem is None) == ok
    if not ok:
        assert version in problem and ">= 2.6" in problem and "\n" not in problem


def test_importing_devices_under_an_old_torch_is_a_one_line_error():
    code = "import torch; torch.__version__ = '2.3.1+cu121'; from gpt2train import devices"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    need = ".".join(map(str, devices.MIN_TORCH))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: torch 2.3.1+cu121 is installed, but gpt2-train needs torch >= {need} (requirements.txt); "
        f"upgrade it, e.g. pip install 'torch>={need}'"
    ]


def test_cpu_dtype_and_compile_follow_native_bf16(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: False)
    assert devices.resolve_dtype("auto", "cpu") == "float32"
    assert devices.resolve_compile("auto", "cpu", "float32") is False  # fp32 eager: compile measured no faster
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: True)
    assert devices.resolve_dtype("auto", "cpu") == "bfloat16"
    assert devices.resolve_compile("auto", "cpu", "bfloat16") is True
    assert (
        devices.resolve_dtype("auto", "mps") == "float32" and devices.resolve_compile("auto", "mps", "float32") is False
    )
    assert (
        devices.resolve_dtype("float16", "cpu") == "float16"
        and devices.resolve_compile(False, "cpu", "bfloat16") is False
    )
    with pytest.raises(ValueError, match="'fp8' is not one of"):
        devices.resolve_dtype("fp8", "cpu")


def test_cuda_dtype_uses_native_bf16_only(monkeypatch):
    """V100/T4 report bf16 support through emulation; only a GPU with bf16 in hardware gets it, others fp16."""
    calls = []

    def is_bf16_supported(including_emulation=True):
        calls.append(including_emulation)
        return including_emulation  # an emulating GPU: True only when emulation counts

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert devices.resolve_dtype("auto", "cuda:1") == "float16" and calls == [False]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # Ampere+
    assert devices.resolve_dtype("auto", "cuda") == "bfloat16"
    assert devices.resolve_compile("auto", "cuda", "float16") is True


@pytest.mark.parametrize(
    "name, dtype, expected",
    [  # real torch.cuda.get_device_name() strings
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
        ("NVIDIA H100 80GB HBM3", "float32", 494e12),  # fp32 training runs TF32 matmuls
        ("NVIDIA H100 PCIe", "bfloat16", 756e12),
        ("NVIDIA H100 NVL", "bfloat16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA H200 NVL", "bfloat16", 835e12),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA A100 80GB PCIe", "float16", 312e12),
        ("NVIDIA L40S", "bfloat16", 362e12),
        ("NVIDIA L40", "bfloat16", 181e12),
        ("NVIDIA L4", "bfloat16", 121e12),
        ("NVIDIA GeForce RTX 4090", "bfloat16", 165e12),
        ("Tesla V100-SXM2-16GB", "bfloat16", None),
        ("NVIDIA GH200 480GB", "bfloat16", 989e12),
        ("NVIDIA GH200 144G HBM3e", "tf32", 494e12),
        ("NVIDIA B200", "bfloat16", 2250e12),
        ("NVIDIA B200", "float32", 1125e12),
        ("NVIDIA GB200", "bfloat16", 2500e12),  # not B200's row
        ("NVIDIA GB200", "tf32", 1250e12),
        ("NVIDIA B100", "bfloat16", None),  # unknown: no MFU rather than a wrong one
        ("cpu", "float32", None),
    ],
)
def test_peak_flops_matches_whole_device_names(name, dtype, expected):
    assert devices.peak_flops(name, dtype) == expected


def test_oom_and_compile_errors_are_told_apart():
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert devices.is_oom(oom) and devices.is_oom(RuntimeError("MPS backend out of memory"))
    assert not devices.is_oom(RuntimeError("NCCL error: unhandled system error"))
    compile_failed = BackendCompilerFailed("inductor", CppCompileError(["g++"], "no working C++ compiler"), None)
    assert devices.is_compile_error(compile_failed) and devices.is_compile_error(CppCompileError(["g++"], "x"))
    try:  # an OOM while compiling (autotuning, say) is an OOM, not a reason to go eager
        try:
            raise oom
        except torch.OutOfMemoryError as e:
            raise BackendCompilerFailed("inductor", e, None) from e
    except BackendCompilerFailed as wrapped:
        assert devices.is_oom(wrapped) and not devices.is_compile_error(wrapped)
    assert not devices.is_compile_error(oom) and not devices.is_compile_error(RuntimeError("NCCL timeout"))


ALLOCATOR_PROBE = """
import resource, sys, torch
from gpt2train import devices

def rss_kb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])

def alloc_touch_free(n_bytes):  # (pages faulted in, bytes of RSS still held afterwards)
    rss0, faults0 = rss_kb(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(n_bytes // 4)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0, (rss_kb() - rss0) * 1024

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
    run = subprocess.run(
        [sys.executable, "-c", ALLOCATOR_PROBE], capture_output=True, text=True, cwd=Path(__file__).parent.parent
    )
    if run.returncode:
        assert "not glibc None" in run.stderr, run.stderr  # only a non-glibc libc may lack the switch
        pytest.skip("not glibc: no malloc tuning to check")
    lines = run.stdout.split("\n")
    n = 128 << 20
    faults, held = map(int, lines[0].split())
    assert faults > n // 4096 // 2 and held < n // 4  # glibc: faulted in, then handed back
    for line in lines[1:4]:  # tuned: whether the heap reuses a freed block or grows, no faulted page is returned
        faults, held = map(int, line.split())
        assert held >= 0.8 * faults * 4096
    assert faults < n // 4096 // 2 or held > n // 2
    assert lines[4] == "True"
