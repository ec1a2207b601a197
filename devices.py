"""Device, precision and allocator choices shared by the command-line entry points.

resolve_device('auto') picks cuda > mps > cpu; resolve_dtype('auto') picks bfloat16 where the
device runs it fast (cuda with bf16 support, a CPU with AVX512-BF16 or AMX) and float32 elsewhere;
autocast() turns a dtype name into the context manager that runs a forward pass in it;
set_malloc_tuned() stops glibc from unmapping and re-faulting big CPU tensors every step.
"""
import ctypes
from contextlib import nullcontext

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device="auto"):
    """'auto' -> 'cuda' if available, else 'mps' if available, else 'cpu'; others pass through."""
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def device_type(device):
    """'cuda:1' -> 'cuda' (what torch.autocast wants)."""
    return str(device).split(":")[0]


def cpu_has_fast_bf16():
    """Whether this x86 CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without it torch emulates
    bf16 matmuls: on the project's AVX2 machine they ran at 16 GFLOP/s against 145 in fp32 (bench.py)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private but stable since torch 2.3
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_dtype(dtype, device):
    """'auto' -> 'bfloat16' on a cuda device with bf16 support or a CPU with fast bf16, else 'float32'."""
    if dtype == "auto":
        kind = device_type(device)
        fast = torch.cuda.is_bf16_supported() if kind == "cuda" else kind == "cpu" and cpu_has_fast_bf16()
        return "bfloat16" if fast else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
    return dtype


def autocast(device, dtype):
    """Context manager running ops in `dtype` (a name, a torch.dtype or None) on `device`.

    float32/None -> no autocast at all (a nullcontext), so fp32 results are bit-for-bit plain.
    """
    if isinstance(dtype, str):
        dtype = DTYPES[resolve_dtype(dtype, device)]
    if dtype is None or dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device_type(device), dtype=dtype)


# glibc serves allocations above its mmap threshold (at most 32 MiB) with mmap and unmaps them on free, so
# every CPU training step page-faults its largest tensors (activations, the lm_head chunks' logits, the wte
# gradient) in again: ~100k faults and ~0.3 s of system time per 400 MB. Tuned: M_MMAP_MAX=0 sends every
# allocation to the heap and M_TRIM_THRESHOLD=INT_MAX stops free() from returning it, so pages are reused.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MALLOPT_TUNED = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}
# glibc's defaults as they settle after the first large free (dynamic threshold: mmap 32 MiB, trim 2x that)
MALLOPT_GLIBC = {M_MMAP_MAX: 65536, M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 64 << 20}
_malloc_tuned = None  # the current setting; None = untouched


def glibc():
    """The C library if it is glibc (has mallopt and malloc_trim), else None (macOS, musl, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def malloc_tuned():
    """The current allocator setting: True (tuned), False (glibc's), None (never switched)."""
    return _malloc_tuned


def set_malloc_tuned(tuned: bool) -> bool:
    """Switch glibc malloc between the tuned and the default behaviour; False where this is not glibc."""
    global _malloc_tuned
    libc = glibc()
    if libc is None:
        return False
    if tuned != _malloc_tuned:
        for param, value in (MALLOPT_TUNED if tuned else MALLOPT_GLIBC).items():
            libc.mallopt(param, value)
        if not tuned:
            libc.malloc_trim(0)  # hand back what the tuned setting kept, as glibc would have
        _malloc_tuned = tuned
    return True


def tune_cpu_allocator(device) -> bool:
    """What train.py, hellaswag.py and bench_eval.py do on a CPU: set_malloc_tuned(True). No-op elsewhere."""
    return device_type(device) == "cpu" and set_malloc_tuned(True)
