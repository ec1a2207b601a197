"""Device, precision, compile and allocator policy: the one place these choices are made.

resolve_device('auto') picks cuda > mps > cpu. resolve_dtype('auto') picks the precision every script
(train.py, sample.py, hellaswag.py, the benchmarks) runs in: bfloat16 on a CUDA GPU with native bf16
(Ampere and newer) and on a CPU with AVX512-BF16 or AMX; float16 on older CUDA GPUs (train.py adds a
GradScaler); float32 elsewhere (MPS, CPUs that would emulate bf16). resolve_compile('auto') compiles on
CUDA and on a CPU running bf16. autocast() turns a resolved dtype into the context manager for a forward
pass. peak_flops() and fused_adamw_supported() describe the hardware for MFU and the optimizer;
set_malloc_tuned() stops glibc from unmapping and re-faulting big CPU tensors every step.

Importing this module (every script that uses torch does) checks the torch version against MIN_TORCH and
exits with a one-line error on an older one, instead of a confusing failure deep inside a run.
"""

import ctypes
import functools
import random
import re
import sys
from contextlib import nullcontext

import numpy as np
import torch

# The oldest torch this library runs on (requirements.txt says the same; a test checks). What sets it, with
# the release that brought each API: torch.amp.GradScaler(device) 2.3; torch.get_autocast_dtype(device),
# torch.is_autocast_enabled(device), torch.cuda.is_bf16_supported(including_emulation=) and fused AdamW on
# the CPU 2.4; torch.OutOfMemoryError 2.5; torch.distributed.fsdp.fully_shard (FSDP2, public) 2.6.
MIN_TORCH = (2, 6)


def torch_version_problem(version, minimum=MIN_TORCH):
    """A one-line message if torch `version` (e.g. '2.5.1+cu124', '2.6.0a0+git1234') is older than `minimum`,
    else None. Pre-releases of the minimum itself (NGC containers ship '2.6.0a0+...') count as it."""
    need = ".".join(map(str, minimum))
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None:
        return f"cannot read the torch version {str(version)!r}; gpt2-train needs torch >= {need}"
    if tuple(map(int, match.groups())) >= tuple(minimum):
        return None
    return (
        f"torch {version} is installed, but gpt2-train needs torch >= {need} (requirements.txt); "
        f"upgrade it, e.g. pip install 'torch>={need}'"
    )


if (_problem := torch_version_problem(torch.__version__)) is not None:
    raise SystemExit(f"error: {_problem}")  # one line on stderr, exit status 1, no traceback

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device="auto"):
    """'auto' -> 'cuda' if available, else 'mps' if available, else 'cpu'; others pass through check_device."""
    if device != "auto":
        check_device(device)
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def check_device(device):
    """Raise ValueError (one line) unless `device` names a device this machine has: 'cpu', 'cuda', 'cuda:N',
    'mps' (other torch device types pass unchecked)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{device!r} is not a device ('auto', 'cpu', 'cuda', 'cuda:N' or 'mps')") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"{device!r}: {why}; use 'cpu' or 'auto'")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"{device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif parsed.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"{device!r}: MPS is not available on this machine; use 'cpu' or 'auto'")


def use_cuda_device(device, local_rank=None):
    """Make a CUDA GPU this process's current device and return its indexed name, 'cuda:N': torchrun's
    local_rank picks each process's GPU; without torchrun 'cuda' is GPU 0 and 'cuda:N' GPU N. Memory stats,
    syncs, the RNG and NCCL follow the current device. (torch.cuda.set_device('cuda') raises ValueError: it
    needs an index.)"""
    index = local_rank if local_rank is not None else torch.device(device).index or 0
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def device_type(device):
    """'cuda:1' -> 'cuda' (what torch.autocast wants)."""
    return str(device).split(":")[0]


def cpu_has_fast_bf16():
    """Whether this x86 CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without it torch emulates
    bf16 matmuls, several times slower than fp32 (docs/training.md, CPU defaults)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private but stable since torch 2.3
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_dtype(dtype, device):
    """The dtype name a run uses: `dtype` itself if not 'auto', else the fast one for `device`:
    cuda -> bfloat16 with native bf16, else float16; cpu -> bfloat16 with AVX512-BF16/AMX, else float32;
    mps and others -> float32. Training and inference use the same rule (fp16 training adds a GradScaler)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
        return dtype
    kind = device_type(device)
    if kind == "cuda":
        # bf16 in hardware (compute capability 8.0+): is_bf16_supported() alone says True on V100/T4, which emulate it
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    if kind == "cpu" and cpu_has_fast_bf16():
        return "bfloat16"
    return "float32"


def resolve_compile(setting, device, dtype):
    """Whether to torch.compile: `setting` if True/False; 'auto' -> on CUDA, and on a CPU running bf16
    (compile fuses the casts autocast adds; in fp32 on a CPU it gains nothing: docs/training.md)."""
    if setting != "auto":
        return bool(setting)
    kind = device_type(device)
    return kind == "cuda" or (kind == "cpu" and dtype == "bfloat16")


def make_compile_deterministic(device):
    """Before torch.compile's graphs are built, on a CPU: torch's deterministic mode, for the whole process.
    Inductor's CPU kernel for an embedding's gradient adds the rows of repeated token ids with atomic adds from
    several threads, so two identical compiled runs (bf16 + compile, the CPU default) drifted apart in the last
    bits from a few steps on; in this mode Inductor calls ATen's serial index_put instead (an eager run is
    deterministic already). Process-wide and kept: Dynamo guards on the mode, so turning it off would recompile.
    Not on CUDA, where Triton's atomic adds are the fast path and the mode needs CUBLAS_WORKSPACE_CONFIG."""
    if device_type(device) == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # the mode's NaN fill of every new tensor


def autocast(device, dtype):
    """Context manager running ops in `dtype` (a resolved name from resolve_dtype, a torch.dtype or None).

    float32/None -> no autocast at all (a nullcontext), so fp32 results are bit-for-bit plain.
    """
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if dtype is None or dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device_type(device), dtype=dtype)


@functools.lru_cache(maxsize=None)
def fused_adamw_supported(device_type: str) -> bool:
    """Whether this torch build has the fused AdamW kernel for device_type (tried on a tiny tensor)."""
    try:
        p = torch.nn.Parameter(torch.zeros(1, device=device_type))
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def is_oom(exc) -> bool:
    """Whether an exception (or one it was raised from) is an out-of-memory error of any device."""
    while exc is not None:
        if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            return True
        message = str(exc).lower()
        if isinstance(exc, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message):
            return True  # CUDA/MPS 'out of memory', the CPU allocator's "can't allocate memory"
        exc = exc.__cause__
    return False


def is_compile_error(exc) -> bool:
    """Whether an exception came from torch.compile itself (Dynamo tracing, Inductor or the backend compiler,
    e.g. no working C++ compiler), the only errors worth retrying eagerly. An out-of-memory or device
    error raised while compiling is not one: it would fail the same way without compile."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import CppCompileError

    return isinstance(exc, (TorchDynamoException, CppCompileError)) and not is_oom(exc)


# Dense (non-sparse) peak FLOP/s from vendor data sheets: bf16/fp16 tensor cores, and "tf32" for fp32 training
# with TF32 matmuls. Matched against the words of torch.cuda.get_device_name() (split on spaces and dashes), the
# first row whose words all appear winning, so "L40" never matches an "L40S" and the NVL/PCIe rows come first.
# Blackwell and Grace rows, per GPU, halving the data sheets' "with sparsity" figures: NVIDIA HGX B200 data sheet
# (8 GPUs: FP16/BF16 36 PFLOPS, TF32 18 PFLOPS, sparse), GB200 NVL72 data sheet (72 GPUs: FP16/BF16 360 PFLOPS,
# TF32 180 PFLOPS, sparse), GH200 Grace Hopper Superchip data sheet (BF16/FP16 1,979 TFLOPS, TF32 989, sparse:
# the H100 SXM's). A Grace GPU's name starts with G ("NVIDIA GH200 480GB"), so "B200" never matches "GB200".
PEAK_FLOPS = [
    (("GB200",), {"bf16": 2500e12, "fp16": 2500e12, "tf32": 1250e12}),
    (("B200",), {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1125e12}),
    (("GH200",), {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12}),
    (("H100", "NVL"), {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12}),
    (("H200", "NVL"), {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12}),
    (("H100", "PCIE"), {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12}),
    (("H100",), {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12}),  # SXM ("NVIDIA H100 80GB HBM3")
    (("H200",), {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12}),
    (("A100",), {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12}),
    (("L40S",), {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12}),
    (("L40",), {"bf16": 181e12, "fp16": 181e12, "tf32": 90e12}),
    (("L4",), {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12}),
    (("RTX", "4090"), {"bf16": 165e12, "fp16": 165e12, "tf32": 83e12}),
    (("V100",), {"fp16": 125e12}),
]
_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "tf32": "tf32",
    "float32": "tf32",
    "fp32": "tf32",
}


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a GPU (a torch.cuda.get_device_name() string) for matmuls in dtype ('bfloat16',
    'float16', or 'float32'/'tf32' meaning fp32 with TF32 matmuls); None if unknown (CPUs included)."""
    key = _DTYPE_ALIASES.get(str(dtype).replace("torch.", "").lower())
    words = set(re.split(r"[\s\-_]+", device_name.upper()))
    for names, table in PEAK_FLOPS:
        if all(name in words for name in names):
            return table.get(key)
    return None


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
    """What every script does on a CPU: set_malloc_tuned(True). No-op elsewhere."""
    return device_type(device) == "cpu" and set_malloc_tuned(True)


def rng_state():
    """Every RNG this process draws from, as tensors and plain lists (weights_only-loadable)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": {
            "name": name,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
    }


def set_rng_state(state):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def peak_memory(kind):
    """(peak allocated, peak reserved) MiB since the last call on CUDA; peak RSS elsewhere (reserved None)."""
    if kind == "cuda":
        out = torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20
        torch.cuda.reset_peak_memory_stats()
        return out
    try:
        import resource
    except ImportError:  # Windows
        return None, None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), None
