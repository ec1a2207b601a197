"""Benchmarks (not tests): each module is a command run from the repository root.

    python -m bench.scoreboard        # training tokens/s, MFU and memory, one optimisation per row; --compare
    python -m bench.data_prep         # prepare_data.py vs raw tiktoken, the loader's time per batch
    python -m bench.hellaswag_speed   # HellaSwag batched vs one example per forward
    python -m bench.eval_vs_harness   # evaluate.py vs lm-evaluation-harness's hf backend: examples/s, same predictions
    python -m bench.eval_cost         # an evaluation's (val loss, HellaSwag, the suite) share of a run's training time
    python -m bench.recipes           # learning speed: the GPT-2 recipe vs configs/modern.py (steps, time to a loss)
    python -m bench.decode            # KV-cache decoding: this checkout vs a git revision, interleaved
    python -m bench.compiled_loss     # the chunked loss's memory and time compiled vs eager, as the chunks grow
    python -m bench.muon              # the modern recipe's optimizer step: torch.optim.Muon vs optim.Muon (batched)

They import only library modules and their public names, never train.py. A run that needs an optional
package (transformers for `bench.scoreboard --compare`) checks it with require() before measuring anything.
"""

import importlib
import importlib.util
import os
import platform
import sys


def machine_line(device):
    """What the numbers were measured on: the GPU, or the CPU model, whether it multiplies bf16 in hardware,
    its cores and torch's threads; and the torch version."""
    # imported here, not at the top: every `python -m bench.X` imports this package (its --help too), and the
    # launchers that measure child processes (bench.memory, bench.fsdp_memory, bench.meta_init) load no torch
    import torch

    from gpt2train.devices import cpu_has_fast_bf16, device_type

    if device_type(device) == "cuda":
        return f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    bf16 = "with" if cpu_has_fast_bf16() else "without"
    return (
        f"{name} ({bf16} AVX512-BF16/AMX), {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; "
        f"torch {torch.__version__}"
    )


def model_at(rev, folder):
    """model.py as it was at git revision `rev` (written into `folder`), imported as its own module beside the
    current one, so a bench can run old and new code interleaved in one process."""
    from unittest import mock

    import torch

    # the torch.library ops it defines (gpt::...) are registered already by the current model.py: its copies
    # take their own namespace
    custom_op = torch.library.custom_op
    # revisions before the package move import the root optim.py (only for configure_optimizer, which no bench
    # calls): they get today's
    with mock.patch.object(torch.library, "custom_op", lambda name, *a, **kw: custom_op(f"old_{name}", *a, **kw)):
        return module_at(rev, "model.py", folder, {"optim": importlib.import_module("gpt2train.optim")})


def module_at(rev, path, folder, imports=None):
    """The file `path` as it was at git revision `rev` (written into `folder`), imported as its own module beside the
    current one; `imports` ({name: module}) stand in for what it imports by those names (e.g. model.py at `rev`)."""
    import subprocess
    from pathlib import Path
    from unittest import mock

    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True, check=True)
    name = f"{Path(path).stem}_{rev.replace('/', '_').replace('~', '_').replace('^', '_')}"
    file = Path(folder, f"{name}.py")
    file.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, imports or {}):
        spec.loader.exec_module(module)
    module.rev = rev
    return module


def require(what, *packages):
    """Stop with one line naming the optional packages `what` needs that do not import, and the command that
    installs them; called before anything is measured."""
    missing = []
    for name in packages:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(
            f"{what} needs {' and '.join(missing)} (optional, not installed): "
            f"pip install {' '.join(missing)}   (or: pip install -r requirements-dev.txt)"
        )
