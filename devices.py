"""Device and precision choices shared by the command-line entry points.

resolve_device('auto') picks cuda > mps > cpu; resolve_dtype('auto') picks bfloat16 where the
device runs it fast (cuda with bf16 support) and float32 elsewhere; autocast() turns a dtype
name into the context manager that runs a forward pass in it.
"""
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


def resolve_dtype(dtype, device):
    """'auto' -> 'bfloat16' on a cuda device with bf16 support, else 'float32'."""
    if dtype == "auto":
        if device_type(device) == "cuda" and torch.cuda.is_bf16_supported():
            return "bfloat16"
        return "float32"
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
