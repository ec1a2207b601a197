"""The one-command GPU acceptance run: does this library do on this GPU what the README says it should?

    python -m bench.gpu                        # 1 GPU (and torchrun checks when there are >= 2)
    python -m bench.gpu --steps 100 --hellaswag 1000 --hellaswag_model path/to/gpt2_hf_dir
    python -m bench.gpu --device=cpu --tiny    # the same checks on a tiny model on the CPU (what CI runs)
    python -m bench.gpu --slot --out DIR       # what fits one GPU in 8 minutes, offline (docs/gpu-checklist.md)
    python -m bench.gpu --slot --tiny --device=cpu --out DIR   # the slot's rows on a tiny model (the test suite's)

It prints one table, check | result | reference or limit | status, and exits 1 if any check FAILs:

  train      train.py itself, with configs/gpt2_124m.py's settings (GPT-2 124M, bf16, compile, micro-batch
             64 x 1024, halved while it runs out of memory) on random tokens, no accumulation: tokens/s, MFU
             and peak memory (step 1 and steps >= 3 apart) from its metrics.jsonl, next to the 465K tokens/s one
             H100 measured (bench.eval_cost's step). FAIL if train.py fails or a loss is not finite.
  compile    torch.compile's first forward+backward (empty inductor cache) and a steady step after it.
  chunked    the chunked loss (return_logits=False) against full logits + cross-entropy on the same weights
             and batch: loss and gradients in fp32 (TF32 off) and under bf16 autocast.
  hellaswag  --hellaswag examples scored with train.py's final checkpoint (or --hellaswag_model) in bf16 and
             in fp32: every ending's mean loss must agree; accuracy is reported.
  memory     memory.estimate_memory's plan for the train row, at the micro-batch it ran (a halving changes it),
             against its measured peaks, step 1 (process start, compile trial, first step) and the steady steps
             (the largest over steps >= 3) apart (CUDA only). FAIL if the plan underestimates the steady peak by
             more than 10%.
  ddp, fsdp  with >= 2 GPUs (or --nproc N): torchrun with N ranks against one process with N accumulation
             steps, per-step losses over a few steps (fsdp only where config.TrainConfig has `parallel`).
  sigterm    train.py stopped by SIGTERM mid-run (as a preemption does), then resumed: the same losses as an
             uninterrupted run (--tiny: exactly; GPU: within 1e-3).
  host syncs (CUDA) the host-device synchronisations per training step, counted with torch.profiler: expect 1.
  sync debug (CUDA) the same with torch.cuda.set_sync_debug_mode('warn'), 2 accumulation steps: one process, and
             a torchrun rank with loss masks (their count all-reduced during the first forward): expect <= 1.
  oom        (CUDA) batch_size='auto' must finish; so must a micro-batch twice what the plan says fits (a real
             out-of-memory, halved until it fits).
  fsdp bf16  (>= 2 GPUs) FSDP in bf16 with compile, activation checkpointing and 2 accumulation steps, saved,
             then resumed on half the ranks: its losses against the uninterrupted run's.
  ddp x8     (8 GPUs) gpt2_124m DDP on 8 ranks with evaluation, HellaSwag (when it has the data) and samples
             on: the steps' tokens/s against 8x the one-GPU train row (FAIL below 85% scaling), and tokens over
             wall time (summary.json's wall_s), what the evaluations cost included, against the same of the
             train row.
  1558m      (CUDA) configs/gpt2_1558m.py with 2 accumulation steps, 3 steps: as `memory`, at the micro-batch
             it ran (the dry run agrees with the plan within 1%: docs/dry-run.md, so it is not run here).
The header names torch, CUDA and NCCL versions and the GPU topology (nvidia-smi topo -m).

Each train.py run gets its own empty torch.compile cache, so compile times are first-run times.
"""

import argparse
import gc
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from gpt2train.config import TrainConfig, make_config, model_config, parse_args
from gpt2train.devices import autocast, device_type, resolve_device, resolve_dtype, use_cuda_device
from gpt2train.files import atomic_write, error_message, report_error
from gpt2train.optim import product_dtype
from gpt2train.tracking import EXIT_CODES
from model import GPT

ROOT = Path(__file__).resolve().parent.parent
GPT2_124M = ROOT / "configs" / "gpt2_124m.py"
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=50304)  # the real tokenizer fits its vocab
SMALL = dict(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=50304)  # the torchrun comparisons on GPUs
# GPT-2 124M on one H100 SXM, bf16 + compile + fused AdamW, 64 x 1024: 65,536 tokens in 141 ms per step, measured
# with bench.eval_cost (docs/evaluation.md; no loader, clip or per-step sync: train.py's step is ~1.5 ms longer)
REFERENCE_TOKENS_PER_S = 465e3
MEMORY_SLACK = 1.10  # the plan may underestimate the measured peak by at most this factor
# tolerances, |chunked - full|: loss (absolute), gradients (max abs difference over max abs gradient)
CHUNKED_TOL = {"float32": (1e-4, 1e-4), "bfloat16": (1e-3, 5e-2)}
HELLASWAG_TOL = 0.1  # max |bf16 - fp32| of an ending's mean loss (nats)
# Inputs for --tiny's HellaSwag row (a CI machine may have no copy of the real file); never scored for accuracy.
SYNTHETIC_EXAMPLES = [
    {"ind": i, "ctx": ctx, "label": i % 4, "endings": endings}
    for i, (ctx, endings) in enumerate(
        [
            ("The chef cracks two eggs into a bowl and", ["whisks them.", "sings.", "leaves.", "paints the wall."]),
            ("A man climbs a ladder to the roof. He", ["fixes a tile.", "swims.", "eats soup.", "reads a map."]),
            ("The kids run onto the beach and", ["build a sandcastle.", "file taxes.", "sleep.", "type."]),
            ("She tunes the guitar, then", ["plays a song.", "mows it.", "bakes it.", "mails it."]),
        ]
    )
]


class Report:
    """The table: one row per check; failed() says whether any check failed."""

    def __init__(self):
        self.rows = []

    def add(self, check, result, reference, status):
        self.rows.append((check, result, reference, status))
        print(f"[{status}] {check}: {result}", file=sys.stderr, flush=True)  # progress while the run goes on

    def failed(self):
        return any(status == "FAIL" for *_, status in self.rows)

    def table(self):
        head = ("check", "result", "reference / limit", "status")
        widths = [max(len(str(row[i])) for row in [head, *self.rows]) for i in range(4)]
        lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in [head, *self.rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def describe(device):
    if device_type(device) == "cuda":
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else "none"
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
        return (
            f"{torch.cuda.get_device_name(device)} x {torch.cuda.device_count()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, NCCL {nccl}"
        )
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def topology(device):
    """nvidia-smi topo -m: how the GPUs are linked (NVLink, PCIe), what the torchrun rows' speed depends on."""
    if device_type(device) != "cuda":
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        out = f"(nvidia-smi topo -m: {e})"
    return f"GPU topology (nvidia-smi topo -m):\n{out}\n"


def sync(device):
    if device_type(device) == "cuda":
        torch.cuda.synchronize(device)


def write_random_shards(data_dir, tokens, vocab, seed=0):
    """Train and val shards of uniformly random token ids: throughput and equivalence need no real text."""
    from gpt2train.shards import write_shard

    rng = np.random.default_rng(seed)
    write_shard(Path(data_dir) / "random_train_000000.bin", rng.integers(0, min(vocab, 50257), tokens))
    write_shard(Path(data_dir) / "random_val_000000.bin", rng.integers(0, min(vocab, 50257), 100_000))


def run_train(args, out_dir, env, nproc=0, timeout=3600, log=None, script=None):
    """train.py (under torchrun with nproc ranks if nproc) -> (return code, stderr tail, metrics records).
    log: a file for its whole output, stdout and stderr (the tail returned is then the output's); script: a
    file that runs train.main in train.py's place."""
    launcher = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    )
    cmd = [*launcher, str(script or ROOT / "train.py"), *args, f"--out_dir={out_dir}"]
    if log is None:
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        tail = result.stderr[-3000:]
    else:
        with open(log, "w") as f:
            result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        tail = Path(log).read_text()[-3000:]
    return result.returncode, tail, run_train_records(out_dir)


def train_env(tmp, name):
    """The environment of a train.py subprocess: this checkout importable, its own empty compile cache."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / f"inductor_{name}"),
    }


# ----------------------------------------------------------------------------- the checks


def check_train(report, opts, tmp, data_dir):
    """train.py on the acceptance config; returns (cfg it ran, out_dir, its step records) or None if it failed."""
    batch_size = opts.batch_size
    while True:
        cfg = make_config({**opts.user, "batch_size": batch_size})
        args = [
            *opts.train_args,
            f"--data_dir={data_dir}",
            f"--max_steps={opts.steps}",
            f"--batch_size={batch_size}",
            f"--total_batch_size={batch_size * cfg.block_size}",
            "--eval_interval=0",
            "--hellaswag_interval=0",
            "--sample_interval=0",
            "--save_interval=0",
            f"--device={opts.device}",
        ]
        out_dir = Path(tmp) / f"train_b{batch_size}"
        rc, err, records = run_train(args, out_dir, train_env(tmp, f"train_b{batch_size}"))
        if rc and "out of memory" in err.lower() and batch_size > 1:
            print(f"micro-batch {batch_size} ran out of memory; trying {batch_size // 2}", file=sys.stderr)
            batch_size //= 2
            continue
        break
    what = f"micro-batch {batch_size} x {cfg.block_size}, {cfg.dtype}, compile {cfg.compile}"
    if rc or not records:
        report.add(
            "train",
            f"train.py failed ({what}): {err.strip().splitlines()[-1] if err.strip() else rc}",
            "exit 0",
            "FAIL",
        )
        return None
    losses = [r["train_loss"] for r in records]
    result = f"{speed(records)}, {peaks_line(records)}; {what}; loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    result += f" over {len(losses)} steps"
    reference = "-"
    if not opts.tiny:
        with torch.device("meta"):  # FLOPs per token need the shapes only
            ref_mfu = GPT(model_config(cfg)).flops_per_token() * REFERENCE_TOKENS_PER_S / 989e12
        reference = f"~{REFERENCE_TOKENS_PER_S / 1e3:.0f}K tokens/s, ~{ref_mfu:.0%} MFU (1x H100 SXM, measured)"
    finite = all(math.isfinite(x) for x in losses)
    report.add("train", result if finite else f"non-finite loss: {losses}", reference, "INFO" if finite else "FAIL")
    return (cfg, out_dir, records) if finite else None


def speed(records):
    """'465,000 tokens/s, MFU 40.2%': medians over the steps after the first quarter (allocator, autotuning)."""
    timed = records[max(1, len(records) // 4) :] or records
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return f"{statistics.median(r['tokens_per_s'] for r in timed):,.0f} tokens/s" + (
        f", MFU {statistics.median(mfus):.1%}" if mfus else ""
    )


def step_peaks(records):
    """(step 1's peak, the steady peak: the largest over steps >= 3, None in a shorter run), allocated MiB.
    train.py resets the peak statistics after each step only, so step 1's spans the process's start, the compile
    trial and the first step (first-call costs); from step 3 on a step holds what every step holds (step 2 is the
    first with the optimizer state from its start)."""
    later = [r["peak_mem_mb"] for r in records if r["step"] >= 3]
    return records[0]["peak_mem_mb"], max(later) if later else None


def peaks_line(records):
    first, steady = step_peaks(records)
    reserved = max((r.get("peak_reserved_mb") or 0) for r in records)
    return (
        f"peak step 1 {first:,.0f} MiB"
        + (f", steps >= 3 {steady:,.0f} MiB" if steady is not None else "")
        + (f" ({reserved:,.0f} reserved)" if reserved else "")
    )


def plan_vs_peaks(records, model_cfg, dtype, optimizer="adamw"):
    """(status, result, plan): the memory plan at the micro-batch the run ended at (its records' micro_batch: an
    out-of-memory halves it) against the steady peak (step 1's in a run shorter than 3 steps), step 1's apart."""
    from gpt2train import memory

    micro = records[-1]["micro_batch"]
    plan = memory.estimate_memory(model_cfg, micro, dtype=dtype, optimizer=optimizer)
    first, steady = step_peaks(records)
    status, ratio = memory_verdict(plan.total, (first if steady is None else steady) * 2**20)
    result = (
        f"planned {plan.total / 2**30:.2f} GiB at micro-batch {micro}; measured step 1 {first / 1024:.2f} GiB "
        f"({first * 2**20 / plan.total:.2f}x)"
    )
    if steady is not None:
        result += f", steps >= 3 {steady / 1024:.2f} GiB ({ratio:.2f}x)"
    return status, result, plan


def check_compile(report, opts, cfg, device, dtype, tmp):
    if opts.tiny:
        report.add("compile", "not timed with --tiny (inductor on a CPU is not the GPU path)", "-", "SKIP")
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor_compile")  # empty: a first-run time
    torch.manual_seed(0)
    model = GPT(model_config(cfg, dropout=0.0)).to(device)
    compiled = torch.compile(model)
    x = torch.randint(0, 50257, (cfg.batch_size, cfg.block_size), device=device)
    times = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        with autocast(device, dtype):
            _, loss = compiled(x, x, return_logits=False)
        loss.backward()
        sync(device)
        times.append(time.perf_counter() - t0)
    del model, compiled, loss
    torch.cuda.empty_cache() if device_type(device) == "cuda" else None
    report.add(
        "compile", f"first forward+backward {times[0]:.1f} s (compile included), then {times[-1]:.3f} s", "-", "INFO"
    )


def chunked_vs_full(model, x, y, device, dtype):
    """(|loss difference|, max |grad difference| / max |grad|) of the chunked loss against full logits."""
    out = []
    for return_logits in (True, False):
        model.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            _, loss = model(x, y, return_logits=return_logits)
        loss.backward()
        out.append((loss.item(), [p.grad.float().clone() for p in model.parameters()]))
    (full, g_full), (chunked, g_chunked) = out
    scale = max(g.abs().max().item() for g in g_full)
    grad_err = max((a - b).abs().max().item() for a, b in zip(g_full, g_chunked)) / scale
    return full, chunked, grad_err


def check_chunked(report, opts, cfg, device):
    torch.manual_seed(0)
    model = GPT(model_config(cfg, dropout=0.0)).to(device)
    with torch.no_grad():  # logits of std ~2 as a trained model's, not the initial near-uniform ones: errors show
        model.lm_head.weight.mul_(2 / (0.02 * math.sqrt(cfg.n_embd)))
    rows = min(cfg.batch_size, 8)
    x = torch.randint(0, 50257, (rows, cfg.block_size), device=device)
    y = torch.randint(0, 50257, (rows, cfg.block_size), device=device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    for dtype in ("float32", "bfloat16"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here: the tight comparison
        try:
            full, chunked, grad_err = chunked_vs_full(model, x, y, device, dtype)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        if opts.inject == "chunked":
            chunked += 1.0  # test hook: a wrong result must fail the run
        loss_tol, grad_tol = CHUNKED_TOL[dtype]
        loss_err = abs(full - chunked)
        ok = loss_err <= loss_tol and grad_err <= grad_tol
        report.add(
            f"chunked loss ({dtype})",
            f"loss {chunked:.6f} vs full logits {full:.6f}: |diff| {loss_err:.1e}, gradients {grad_err:.1e} of max",
            f"<= {loss_tol:g}, <= {grad_tol:g}",
            "PASS" if ok else "FAIL",
        )
    del model


def check_hellaswag(report, opts, device, ckpt_dir):
    from gpt2train.assets import fetch_hellaswag, get_tokenizer
    from gpt2train.loading import load_model
    from gpt2train.scoring import Suite
    from gpt2train.tasks import HELLASWAG_LLMC, load_hellaswag

    try:
        enc = get_tokenizer()
        if opts.tiny:
            examples = SYNTHETIC_EXAMPLES
        else:
            examples = load_hellaswag(opts.hellaswag_file or fetch_hellaswag(), limit=opts.hellaswag)
    except Exception as e:  # offline GPU machine: no tokenizer or examples to be had
        report.add("hellaswag", f"no data ({type(e).__name__}: {str(e)[:120]}); --hellaswag_file PATH", "-", "SKIP")
        return
    if opts.hellaswag_model:
        model, info = load_model(init_from=opts.hellaswag_model, device=device)
    else:
        model, info = load_model(ckpt=ckpt_dir, device=device)
    t0 = time.perf_counter()
    suite = Suite({HELLASWAG_LLMC.name: examples}, enc)  # hellaswag.py's scoring
    low = suite.score(model, device, dtype="bfloat16")
    rate = len(examples) / (time.perf_counter() - t0)
    full = suite.score(model, device, dtype="float32")
    endings = [cont for _, pairs, *_ in suite.examples[HELLASWAG_LLMC.name] for _, cont in pairs]
    low_ll, full_ll = ([v for p in r["preds"] for v in p["log_likelihoods"]] for r in (low, full))
    diff = max(abs(a - b) / len(end) for a, b, end in zip(low_ll, full_ll, endings))  # of the mean loss per token
    same = sum(p["pred_norm"] == q["pred_norm"] for p, q in zip(low["preds"], full["preds"])) / len(examples)
    low, full = low["tasks"][HELLASWAG_LLMC.name], full["tasks"][HELLASWAG_LLMC.name]
    source = "synthetic examples" if opts.tiny else f"model {info['source']}"
    reference = f"max |bf16 - fp32| <= {HELLASWAG_TOL}"
    if opts.hellaswag_model and not opts.tiny:
        reference += "; GPT-2 124M: acc_norm 0.2955 on all 10,042"
    ok = math.isfinite(diff) and diff <= HELLASWAG_TOL
    report.add(
        "hellaswag",
        f"{low['n']} examples ({source}): acc_norm {low['acc_norm']:.4f} bf16, {full['acc_norm']:.4f}"
        f" fp32; max |bf16 - fp32| mean loss {diff:.1e}, same prediction {same:.0%}; {rate:.0f} examples/s bf16",
        reference,
        "PASS" if ok else "FAIL",
    )


def memory_verdict(predicted_bytes, measured_bytes, slack=MEMORY_SLACK):
    """('PASS' or 'FAIL', measured / predicted): the plan may be loose, but must not underestimate."""
    ratio = measured_bytes / predicted_bytes
    return ("PASS" if ratio <= slack else "FAIL"), ratio


def check_memory(report, cfg, device, dtype, records):
    status, result, plan = plan_vs_peaks(records, model_config(cfg), dtype)
    if device_type(device) != "cuda":
        report.add(
            "memory plan",
            f"predicted {plan.total / 2**30:.2f} GiB; not compared: the CPU's peak RSS includes the whole process",
            "-",
            "INFO",
        )
        return
    report.add("memory plan", f"{result}; {plan.line()}", f"steps >= 3 <= {MEMORY_SLACK:.2f}x planned", status)


def check_torchrun(report, opts, tmp, data_dir, nproc):
    """torchrun with nproc ranks (DDP, and FSDP where it exists) equals 1 process with nproc accumulation steps."""
    model_args = TINY if opts.tiny else SMALL
    batch = 4 if opts.tiny else 8
    common = [
        *(f"--{k}={v}" for k, v in model_args.items()),
        f"--data_dir={data_dir}",
        "--max_steps=5",
        f"--batch_size={batch}",
        f"--total_batch_size={batch * model_args['block_size'] * nproc}",
        "--dtype=float32",
        "--compile=False",
        "--dropout=0.0",
        "--eval_interval=0",
        "--save_interval=0",
        "--warmup_steps=1",
        "--learning_rate=1e-3",
        f"--device={'cpu' if opts.tiny else 'cuda'}",
    ]
    rc, err, single = run_train(common, Path(tmp) / "single", train_env(tmp, "single"))
    tol = 1e-5 if opts.tiny else 1e-4  # GPUs: fp32 with TF32 matmuls (train.py turns them on)
    modes = ["ddp"] + (["fsdp"] if "parallel" in {f.name for f in fields(TrainConfig)} else [])
    for mode in modes:
        extra = [f"--parallel={mode}"] if mode != "ddp" else []
        rc2, err2, ranks = run_train([*common, *extra], Path(tmp) / mode, train_env(tmp, mode), nproc=nproc)
        if rc or rc2 or not single or len(ranks) != len(single):
            tail = (err2 or err).strip().splitlines()[-1:] or [f"exit {rc or rc2}"]
            report.add(mode, f"a run failed: {tail[0]}", "exit 0", "FAIL")
            continue
        diff = max(abs(a["train_loss"] - b["train_loss"]) for a, b in zip(ranks, single))
        report.add(
            mode,
            f"{nproc} ranks vs 1 process x {nproc} accumulation steps, {len(single)} steps: max |loss diff| {diff:.1e}",
            f"<= {tol:g}",
            "PASS" if diff <= tol else "FAIL",
        )


def train_args(opts, data_dir, model_args=None, steps=8, batch=4, dtype="float32"):
    """A few train.py steps on random tokens: the tiny model (--tiny) or SMALL, no evaluation, no compile. --tiny
    trains in float32, as its help says: bfloat16 is emulated on a CPU without AVX512-BF16 (seconds a step)."""
    model_args = model_args or (TINY if opts.tiny else SMALL)
    return [
        *(f"--{k}={v}" for k, v in model_args.items()),
        f"--data_dir={data_dir}",
        f"--max_steps={steps}",
        f"--batch_size={batch}",
        f"--dtype={'float32' if opts.tiny else dtype}",
        "--compile=False",
        "--eval_interval=0",
        "--save_interval=0",
        "--warmup_steps=1",
        "--learning_rate=1e-3",
        "--log_interval=0",
        f"--device={opts.device}",
    ]


def losses(records):
    return {r["step"]: r["train_loss"] for r in records}


def check_sigterm_resume(report, opts, tmp, data_dir):
    """SIGTERM after step 5 (train.py saves after the step and exits 5, interrupted), resume, and compare every step's
    loss with an uninterrupted run's. Of 60 steps (--tiny: 20; a step of its 50K-vocab head takes ~0.1 s on one CPU
    thread, so the signal, sent within 50 ms of step 5, still lands mid-run)."""
    args = [*train_args(opts, data_dir, steps=20 if opts.tiny else 60), "--dropout=0.1"]
    env, out = train_env(tmp, "sigterm"), Path(tmp) / "sigterm"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args, f"--out_dir={out}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:  # until it has trained 5 steps
        metrics = out / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().count('"train_loss"') >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=600)[1]
    stopped = len(run_train_records(out))
    rc, err2, resumed = run_train([*args, "--init_from=resume"], out, env)
    rc2, err3, straight = run_train(args, Path(tmp) / "sigterm_straight", env)
    if proc.returncode not in (0, EXIT_CODES["interrupted"]) or rc or rc2 or not straight:  # 0: it ended first
        tail = (err3 or err2 or err).strip().splitlines()[-1:] or ["?"]
        report.add("sigterm", f"a run failed: {tail[0]}", "exit 5, then 0", "FAIL")
        return
    if stopped >= len(straight):
        report.add("sigterm", "the run finished before the signal arrived: nothing checked", "-", "SKIP")
        return
    a, b = losses(resumed), losses(straight)
    diff = max(abs(a[k] - b[k]) for k in b) if set(a) == set(b) else math.inf
    tol = 0.0 if opts.tiny else 1e-3  # a GPU's kernels need not be deterministic
    report.add(
        "sigterm",
        f"stopped after step {stopped} of {len(straight)}, resumed: max |loss diff| {diff:.1e}",
        f"<= {tol:g}",
        "PASS" if diff <= tol else "FAIL",
    )


def run_train_records(out_dir):
    path = Path(out_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "train_loss" in r] if path.exists() else []


COUNT_SYNCS = """
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile, schedule
import train
from gpt2train import tracking
# the CUDA runtime calls that make the host wait for the device
SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=schedule(wait=3, warmup=1, active=4))
real_log = tracking.Tracker.log
def log(self, record):
    real_log(self, record)
    if "train_loss" in record:
        prof.step()  # one profiler step per training step
tracking.Tracker.log = log
prof.start()
code = train.main(sys.argv[2:])
prof.stop()
counts = {e.key: e.count for e in prof.key_averages() if e.key in SYNCS}
json.dump({"code": code, "per_step": sum(counts.values()) / 4, "counts": counts}, open(sys.argv[1], "w"))
"""


def check_host_syncs(report, opts, tmp, data_dir):
    if device_type(opts.device) != "cuda":
        report.add("host syncs", "CUDA only (counts CUDA runtime synchronisations)", "-", "SKIP")
        return
    script, result = Path(tmp) / "count_syncs.py", Path(tmp) / "syncs.json"
    script.write_text(COUNT_SYNCS)
    cmd = [
        sys.executable,
        str(script),
        str(result),
        *train_args(opts, data_dir, steps=10, dtype="bfloat16"),
        f"--out_dir={Path(tmp) / 'syncs'}",
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=train_env(tmp, "syncs"), capture_output=True, text=True, timeout=1800)
    if run.returncode or not result.exists():
        report.add("host syncs", f"failed: {run.stderr.strip().splitlines()[-1:]}", "exit 0", "FAIL")
        return
    found = json.loads(result.read_text())
    report.add(
        "host syncs",
        f"{found['per_step']:g} per step over 4 profiled steps ({found['counts']})",
        "1",
        "PASS" if found["per_step"] <= 1 else "FAIL",
    )


SYNC_DEBUG = """
import json, sys, warnings
import torch
import torch.distributed as dist
import train
from gpt2train import step, tracking
# torch's own sync check: every CUDA call that makes the host wait for the device warns while it is on (CUDA only:
# elsewhere the script runs to count the all-reduces)
masked = sys.argv[2] == "masked"
if masked:  # SFT-style loss masks: about half the targets not trained, and under torchrun the masked count all-reduced
    real = step.micro_batches  # what step.forward_backward calls for train.py's step

    class Masked:
        masked = True  # what micro_batches reads: weigh micro-batches by their trained targets

        def __init__(self, loader):
            self.loader = loader

        def next_batch(self):
            x, y = self.loader.next_batch()
            return x, torch.where(torch.rand(y.shape) < 0.5, y, -1)

    step.micro_batches = lambda model, loader, *a, **k: real(model, Masked(loader), *a, **k)
# the masked path's collective: the trained-token count all-reduced asynchronously, once a step; counted, so that
# the masked row cannot pass without taking that path
issued = [0]
real_all_reduce = dist.all_reduce
def all_reduce(tensor, *args, **kwargs):
    issued[0] += bool(kwargs.get("async_op"))
    return real_all_reduce(tensor, *args, **kwargs)
dist.all_reduce = all_reduce
steps = [0]
real_log = tracking.Tracker.log
def log(self, record):
    real_log(self, record)
    if "train_loss" in record:  # count over steps 4-8, after warm-up
        steps[0] += 1
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn" if 3 <= steps[0] < 8 else 0)
tracking.Tracker.log = log
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    code = train.main(sys.argv[3:])
if torch.cuda.is_available():
    torch.cuda.set_sync_debug_mode(0)
found = [str(w.message).splitlines()[0] for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
result = {"code": code, "per_step": len(found) / 5, "first": found[:3], "steps": steps[0]}
json.dump({**result, "async_all_reduces": issued[0]}, open(sys.argv[1], "w"))
"""


def check_sync_debug(report, opts, tmp, data_dir, timeout=1800):
    """torch.cuda.set_sync_debug_mode('warn') over 5 steady steps with 2 accumulation steps: one process, and one
    torchrun rank with loss masks (the masked token count is all-reduced, overlapped with the first forward).
    Expect at most 1 sync per step: train.py's one copy of the step's numbers to the host; and on the masked rank
    the count's asynchronous all-reduce issued in every step. Returns {row: what the script found}."""
    if device_type(opts.device) != "cuda":
        report.add("sync debug", "CUDA only (torch.cuda.set_sync_debug_mode)", "-", "SKIP")
        return {}
    results = {}
    for name, nproc in (("plain", 0), ("masked", 1)):
        check = f"sync debug {name}" + (" (torchrun)" if nproc else "")
        try:
            run, found = run_sync_debug(opts, tmp, data_dir, name, nproc, timeout)
        except subprocess.TimeoutExpired:
            report.add(check, f"timed out after {timeout} s", "exit 0", "FAIL")
            continue
        if found is None:
            errors = [line for line in run.stderr.splitlines() if "Error" in line or "error:" in line]
            report.add(check, f"failed: {(errors or run.stderr.strip().splitlines())[-1:]}", "exit 0", "FAIL")
            continue
        results[check] = found
        status, reference = sync_debug_verdict(name, found)
        report.add(
            check,
            f"{found['per_step']:g} per step over 5 steps, {found['async_all_reduces']} async all-reduces in "
            f"{found['steps']} steps {found['first']}",
            reference,
            status,
        )
    return results


def run_sync_debug(opts, tmp, data_dir, name, nproc, timeout=1800):
    """The sync debug script through train.main ('plain', or 'masked' under torchrun with nproc ranks): (the
    finished process, what the script found or None if it failed). Off CUDA it only counts the all-reduces."""
    script = Path(tmp) / "sync_debug.py"
    script.write_text(SYNC_DEBUG)
    block = (TINY if opts.tiny else SMALL)["block_size"]
    result = Path(tmp) / f"sync_debug_{name}.json"
    launcher = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    )
    cmd = [
        *launcher,
        str(script),
        str(result),
        name,
        *train_args(opts, data_dir, steps=10, dtype="bfloat16"),
        f"--total_batch_size={2 * 4 * block}",
        f"--out_dir={Path(tmp) / f'sync_debug_{name}'}",
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=train_env(tmp, "sync"), capture_output=True, text=True, timeout=timeout)
    return run, json.loads(result.read_text()) if not run.returncode and result.exists() else None


def sync_debug_verdict(name, found):
    """(status, reference) of a sync debug row: at most 1 sync per step; the masked rank must also have issued
    its asynchronous all-reduce in every step, or the row did not take the path it is about."""
    if name != "masked":
        return ("PASS" if found["per_step"] <= 1 else "FAIL"), "<= 1"
    ok = found["per_step"] <= 1 and found["async_all_reduces"] == found["steps"] > 0
    return ("PASS" if ok else "FAIL"), "<= 1; 1 async all-reduce per step"


def check_oom(report, opts, tmp, data_dir):
    if device_type(opts.device) != "cuda":
        report.add("oom", "CUDA only (batch_size='auto' probes the GPU; a real out-of-memory)", "-", "SKIP")
        return
    from gpt2train import memory

    cfg = make_config(opts.user)
    free = torch.cuda.mem_get_info(opts.device)[0]
    b = 1
    while memory.estimate_memory(model_config(cfg), b, dtype=resolve_dtype(cfg.dtype, opts.device)).total < 2 * free:
        b *= 2
    base = [
        *opts.train_args,
        f"--data_dir={data_dir}",
        "--max_steps=3",
        "--eval_interval=0",
        "--save_interval=0",
        "--hellaswag_interval=0",
        "--sample_interval=0",
        f"--device={opts.device}",
        f"--total_batch_size={b * cfg.block_size}",
    ]
    for name, extra in (
        ("auto", ["--batch_size=auto"]),
        (f"micro-batch {b}", [f"--batch_size={b}", "--memory_check=False"]),
    ):
        rc, err, records = run_train([*base, *extra], Path(tmp) / f"oom_{name.split()[-1]}", train_env(tmp, "oom"))
        ok = rc == 0 and len(records) == 3
        micro = sorted({r.get("micro_batch") for r in records})
        report.add(
            f"oom ({name})",
            f"finished 3 steps at micro-batch {micro}" if ok else f"failed: {err.strip().splitlines()[-1:] or rc}",
            "exit 0, 3 steps",
            "PASS" if ok else "FAIL",
        )


def check_fsdp_bf16_resume(report, opts, tmp, data_dir, nproc):
    """FSDP in bf16 with compile, activation checkpointing and accumulation; checkpoint at step 4; resumed on
    nproc // 2 ranks (one process for 2) to step 8, against the uninterrupted run."""
    if opts.tiny or nproc < 2:
        report.add("fsdp bf16", "needs >= 2 GPUs (tests/test_fsdp.py covers its CPU part)", "-", "SKIP")
        return
    batch = 4
    args = [
        *train_args(opts, data_dir, steps=8, batch=batch, dtype="bfloat16"),
        "--compile=True",
        "--parallel=fsdp",
        "--activation_checkpointing=True",
        f"--total_batch_size={2 * batch * SMALL['block_size'] * nproc}",
        "--save_interval=4",
        "--keep_last=0",
    ]
    out, straight = Path(tmp) / "fsdp_bf16", Path(tmp) / "fsdp_bf16_straight"
    rc, err, full = run_train(args, straight, train_env(tmp, "fsdp_bf16"), nproc=nproc)
    if not rc:
        import shutil

        shutil.copytree(straight / "ckpt_000004", out / "ckpt_000004")
        half = nproc // 2 if nproc > 2 else 0
        rc, err, resumed = run_train(
            ["--init_from=resume", f"--device={opts.device}"], out, train_env(tmp, "fsdp_bf16_resume"), nproc=half
        )
    if rc or not full:
        report.add("fsdp bf16", f"a run failed: {err.strip().splitlines()[-1:] or rc}", "exit 0", "FAIL")
        return
    a, b = losses(resumed), {k: v for k, v in losses(full).items() if k > 4}
    diff = max(abs(a[k] - b[k]) for k in b) if set(a) == set(b) else math.inf
    report.add(
        "fsdp bf16",
        f"{nproc} ranks, compile + checkpointing + 2 accumulation steps; resumed at step 4 on "
        f"{half or 1}: max |loss diff| {diff:.1e} over steps 5-8",
        "<= 0.02",
        "PASS" if diff <= 0.02 else "FAIL",
    )


def check_ddp_scaling(report, opts, tmp, data_dir, trained):
    """8 ranks at the train row's micro-batch (what fitted one GPU) against 8x that row's tokens/s."""
    if device_type(opts.device) != "cuda" or torch.cuda.device_count() < 8:
        report.add("ddp x8", "needs 8 GPUs", "-", "SKIP")
        return
    try:  # train.py reads HellaSwag from the cache fetch_hellaswag fills; an offline node may not have it
        from gpt2train.assets import fetch_hellaswag

        fetch_hellaswag()
        hellaswag = 20
    except Exception:  # noqa: BLE001 -- no data: the row runs without HellaSwag and says so
        hellaswag = 0
    if trained is None:
        report.add("ddp x8", "the train row failed: no one-GPU reference", "-", "FAIL")
        return
    cfg, one_dir, one = trained
    one_gpu_tokens_per_s = statistics.median(r["tokens_per_s"] for r in one[max(1, len(one) // 4) :])
    args = [
        *opts.train_args,
        f"--data_dir={data_dir}",
        f"--max_steps={opts.steps}",
        f"--batch_size={cfg.batch_size}",
        f"--total_batch_size={8 * cfg.batch_size * cfg.block_size}",
        "--eval_interval=10",
        "--eval_steps=5",
        f"--hellaswag_interval={hellaswag}",
        "--hellaswag_limit=200",
        "--sample_interval=20",
        "--save_interval=0",
    ]
    rc, err, records = run_train(args, Path(tmp) / "ddp8", train_env(tmp, "ddp8"), nproc=8)
    if rc or not records:
        report.add("ddp x8", f"failed: {err.strip().splitlines()[-1:] or rc}", "exit 0", "FAIL")
        return
    timed = records[max(1, len(records) // 4) :]
    steps = statistics.median(r["tokens_per_s"] for r in timed)
    scaling = steps / (8 * one_gpu_tokens_per_s)
    wall, one_wall = wall_tokens_per_s(Path(tmp) / "ddp8"), wall_tokens_per_s(one_dir)
    report.add(
        "ddp x8",
        f"steps {scaling:.0%} of 8x one GPU; over wall time {wall:,.0f} tokens/s, {wall / (8 * one_wall):.0%} of 8x "
        f"one GPU's (eval every 10 steps, samples" + (", HellaSwag" if hellaswag else "") + f" on: "
        f"{1 - wall / steps:.0%} of the wall time outside the steps)",
        "steps >= 85%",
        "PASS" if scaling >= 0.85 else "FAIL",
    )


def wall_tokens_per_s(out_dir):
    """A run's tokens over its wall time (summary.json's tokens / wall_s): the steps and all between them, the
    evaluations, samples and saves included (from the model's build on: the compile trial is before it)."""
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    return summary["tokens"] / summary["wall_s"]


def check_1558m_memory(report, opts, tmp, data_dir):
    if opts.tiny:
        report.add("1558m memory", "CUDA only", "-", "SKIP")
        return
    config = ROOT / "configs" / "gpt2_1558m.py"
    cfg = make_config(parse_args([str(config)]))
    cfg = make_config(parse_args([str(config), f"--total_batch_size={2 * cfg.batch_size * cfg.block_size}"]))
    args = [
        str(config),
        f"--data_dir={data_dir}",
        "--max_steps=3",
        "--eval_interval=0",
        f"--total_batch_size={cfg.total_batch_size}",
        "--hellaswag_interval=0",
        "--sample_interval=0",
        "--save_interval=0",
        f"--device={opts.device}",
        "--memory_check=False",
    ]
    rc, err, records = run_train(args, Path(tmp) / "1558m", train_env(tmp, "1558m"))
    if rc or not records:
        report.add("1558m memory", f"failed: {err.strip().splitlines()[-1:] or rc}", "exit 0", "FAIL")
        return
    dtype = resolve_dtype(cfg.dtype, opts.device)
    status, result, _ = plan_vs_peaks(records, model_config(cfg), dtype, cfg.optimizer)
    report.add(
        "1558m memory",
        f"2 accumulation steps: {result}",
        f"steps >= 3 <= {MEMORY_SLACK:.2f}x planned (dry run = plan within 1%: docs/dry-run.md)",
        status,
    )


# ----------------------------------------------------------------------------- the slot: one GPU, 8 minutes

SLOT_SECONDS = 480  # a 15-minute GPU loan, less the machine's start and room to run it again
GPT2_1558M = ROOT / "configs" / "gpt2_1558m.py"
GPT2_124M_MODERN = ROOT / "configs" / "gpt2_124m_modern.py"
MODERN = ROOT / "configs" / "modern.py"
MUON_TOL = 1e-3  # the batched Muon's matrices after 3 steps against torch.optim.Muon's: max relative difference
MUON_TOL_FP32_PRODUCTS = 1e-2  # the same where ours multiplies bf16 values in fp32 (a CPU without bf16 in hardware)
QUIET = ["--eval_interval=0", "--hellaswag_interval=0", "--sample_interval=0", "--save_interval=0"]  # no tokenizer
# train.py as the slot runs it: without the checkpoint it writes at the last step (18.7 GB at 1.5B: a minute or more
# of the slot's 8, and nothing it measures)
NO_SAVE = """
import sys
import train
train.Checkpointer.save = lambda self, *args, **kwargs: None
sys.exit(train.main(sys.argv[1:]))
"""


def slot(opts):
    """python -m bench.gpu --slot --out DIR: the rows that fit one GPU in SLOT_SECONDS of work, offline (random
    shards, no evaluation: no tokenizer and nothing to download), in this order: environment; gpt2_124m compiled
    at micro-batch 64, 40 steps; gpt2_124m_modern (the modern recipe) the same, 20 steps; the modern recipe's
    optimizer step, torch.optim.Muon against the batched Muon (slot_optimizer); gpt2_124m eager, 6 steps; memory
    by phase, compiled against eager; the sync debug rows; gpt2_1558m eager, micro-batch 16 x 2 accumulation
    steps, 3 steps. A row that would start with less
    than a minute left is skipped, and each runs under the time left. One table on stdout; DIR/slot.json holds
    everything measured (each run's per-step records and summary.json) and DIR/<row>.log each run's output, both
    written as the rows finish, so a run cut short keeps what it did. --tiny: the same rows on a tiny model on
    the CPU (no compile; the sync debug rows skipped), in seconds: tests/test_bench_gpu.py runs it."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    report, found, t0 = Report(), {"device": describe(opts.device)}, time.perf_counter()

    def save():
        found["seconds"] = round(time.perf_counter() - t0, 1)
        found["rows"] = [dict(zip(("check", "result", "reference", "status"), row)) for row in report.rows]
        atomic_write(out / "slot.json", json.dumps(found, indent=1) + "\n")

    model = opts.train_args  # gpt2_124m's config, or --tiny's model
    modern = [str(MODERN), *model] if opts.tiny else [str(GPT2_124M_MODERN)]
    micro, block = (4, TINY["block_size"]) if opts.tiny else (64, 1024)
    steps = (6, 4) if opts.tiny else (40, 6)
    batch = [f"--batch_size={micro}", f"--total_batch_size={micro * block}"]
    xl = [str(GPT2_1558M), "--batch_size=16", f"--total_batch_size={2 * 16 * 1024}", "--memory_check=False"]
    if opts.tiny:  # 2 accumulation steps, as gpt2_1558m's row
        xl = [*model, "--batch_size=2", f"--total_batch_size={2 * 2 * block}"]
    rows = [  # (row, seconds it may take at most, train.py's arguments)
        ("124m compiled", 240, [*model, *batch, f"--max_steps={steps[0]}"]),
        ("124m modern compiled", 200, [*modern, *batch, f"--max_steps={steps[0] // 2}"]),
        ("optimizer step", None, None),
        ("124m eager", 100, [*model, *batch, f"--max_steps={steps[1]}", "--compile=False"]),
        ("memory by phase", None, None),
        ("sync debug", 300, None),
        ("1558m eager", 150, [*xl, "--max_steps=3", "--compile=False"]),
    ]
    with tempfile.TemporaryDirectory(prefix="gpu_slot_") as tmp:
        data_dir = Path(tmp) / "data"
        write_random_shards(data_dir, tokens=(steps[0] + 2) * micro * block + 100_000, vocab=50304)
        found["environment"] = slot_environment(report, opts.device)
        save()
        for name, seconds, args in rows:
            left = SLOT_SECONDS - (time.perf_counter() - t0)
            if left < 60:
                report.add(name, f"not started: {left:.0f} s of the slot's {SLOT_SECONDS} s left", "-", "SKIP")
            elif name == "memory by phase":
                found[name] = slot_phases(report, opts, tmp)
            elif name == "optimizer step":
                found[name] = slot_optimizer(report, opts)
            elif name == "sync debug":
                found[name] = check_sync_debug(report, opts, tmp, data_dir, timeout=min(seconds, left) / 2)
            else:
                found[name] = slot_train(report, opts, tmp, data_dir, out, name, args, min(seconds, left))
            save()
    print(f"\nbench.gpu --slot on {found['device']} ({found['seconds']:.0f} s); measurements: {out / 'slot.json'}")
    print(report.table())
    return 1 if report.failed() else 0


def slot_environment(report, device):
    """What the numbers were measured on: GPU, torch, CUDA, NCCL, free memory, the driver and clocks."""
    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    result = describe(device)
    if device_type(device) == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        info.update(free_gib=free / 2**30, total_gib=total / 2**30)
        result += f"; {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
        query = "name,driver_version,memory.total,power.limit,clocks.max.sm"
        try:
            smi = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True, timeout=60
            )
            info["nvidia-smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            info["nvidia-smi"] = str(e)
    report.add("environment", result, "-", "INFO")
    return info


def slot_train(report, opts, tmp, data_dir, out, name, args, timeout):
    """One train.py run of the slot, no evaluation and no checkpoint (NO_SAVE): tokens/s (the steps', and over wall
    time), MFU, whether it compiled, and on CUDA the memory plan at the micro-batch it ran against step 1's and the
    steady peaks.
    Returns what slot.json keeps of it: its arguments, per-step records and summary.json."""
    args = [*args, f"--data_dir={data_dir}", *QUIET, "--log_interval=10", f"--device={opts.device}"]
    run, log, script = (
        Path(tmp) / name.replace(" ", "_"),
        out / f"{name.replace(' ', '_')}.log",
        Path(tmp) / "no_save.py",
    )
    script.write_text(NO_SAVE)
    kept = {"args": args}
    env = train_env(tmp, name.replace(" ", "_"))
    try:
        rc, tail, records = run_train(args, run, env, timeout=timeout, log=log, script=script)
    except subprocess.TimeoutExpired:
        report.add(name, f"timed out after {timeout:.0f} s ({log})", "exit 0", "FAIL")
        return {**kept, "timed_out_s": timeout, "steps": run_train_records(run)}
    kept.update(exit=rc, steps=records)
    if rc or not records:
        why = tail.strip().splitlines()[-1:] or rc
        if not tail.strip() and shutil.disk_usage(out).free < 1 << 20:  # the log itself could not be written
            why = f"{rc}; {log} is empty: no space left on its device"
        report.add(name, f"train.py failed: {why} ({log})", "exit 0", "FAIL")
        return kept
    kept["summary"] = json.loads((run / "summary.json").read_text())
    cfg = make_config(parse_args(args))
    dtype = resolve_dtype(cfg.dtype, opts.device)
    status, memory_result, _ = plan_vs_peaks(records, model_config(cfg), dtype, cfg.optimizer)
    reference = f"steps >= 3 <= {MEMORY_SLACK:.2f}x planned"
    if device_type(opts.device) != "cuda":
        status, memory_result, reference = "INFO", "not compared to the plan (a CPU's peak RSS is the process's)", "-"
    compiled = re.search(r"\| compile (True|False) \|", log.read_text())
    result = (
        f"{speed(records)}, {wall_tokens_per_s(run):,.0f} over wall time; compile "
        f"{compiled.group(1) if compiled else '?'}; {peaks_line(records)}; {memory_result}"
    )
    if name == "124m compiled" and not opts.tiny:
        reference = f"~{REFERENCE_TOKENS_PER_S / 1e3:.0f}K tokens/s; {reference}"
    if name == "124m modern compiled" and not opts.tiny:
        reference = f"MFU >= 40% (issue 51; review 5 estimated ~400K tokens/s); {reference}"
    finite = all(math.isfinite(r["train_loss"]) for r in records)
    report.add(name, result if finite else f"non-finite loss: {result}", reference, status if finite else "FAIL")
    return kept


def slot_optimizer(report, opts):
    """The modern recipe's optimizer step (Muon for the 48 block matrices, AdamW for the rest) at GPT-2 124M's size
    (--tiny: the 48 matrices at 32 wide), torch.optim.Muon against the batched Muon (bench.muon.compare): ms per
    step, Muon alone and whole; GPU kernels per step (CUDA; elsewhere the ops dispatched); and the matrices after
    3 steps from the same start, which must agree within MUON_TOL."""
    from bench.muon import compare

    found = compare(opts.device, tiny=opts.tiny, reps=1 if opts.tiny else 20)  # --tiny: the path, not a timing
    gc.collect()
    if device_type(opts.device) == "cuda":
        torch.cuda.empty_cache()  # its model and optimizers: the GPU's memory back for the rows after this one
    parts = []
    for name in ("torch.optim.Muon", "batched"):
        r = found[name]
        launches = f"{r['kernels']} kernels" if r["kernels"] is not None else f"{r['ops']} ops dispatched"
        parts.append(f"{name} {r['muon_ms']:.2f} ms (whole step {r['whole_ms']:.2f}), {launches}")
    diff, in_bf16 = found["max_rel_diff"], product_dtype(opts.device) == torch.bfloat16
    tol = MUON_TOL if in_bf16 else MUON_TOL_FP32_PRODUCTS
    status = "PASS" if diff <= tol else "FAIL"
    result = "; ".join(parts) + f"; matrices after 3 steps max rel diff {diff:.1e}"
    products = "" if in_bf16 else " (ours multiplies in fp32 here)"
    report.add("optimizer step", result, f"diff <= {tol:g}{products}; review 5: ~8-10 ms vs ~2-3.5 ms", status)
    return found


def slot_phases(report, opts, tmp):
    """Memory by phase of the 124M step (the tiny model with --tiny), eager against compiled (memory_phases).
    The compile reuses the compiled row's Inductor cache (the same graph: a warm compile)."""
    cfg = make_config(opts.user)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor_124m_compiled")
    if device_type(opts.device) == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as train.py runs
    micro = 2 if opts.tiny else 64
    backend = "aot_eager" if opts.tiny else "inductor"  # Inductor on a CPU would take minutes
    phases = memory_phases(
        model_config(cfg, dropout=0.0), micro, opts.device, resolve_dtype(cfg.dtype, opts.device), backend
    )
    torch._dynamo.reset()  # its graphs held the model: the GPU's memory back for the rows after this one
    gc.collect()
    if device_type(opts.device) == "cuda":
        torch.cuda.empty_cache()
    if device_type(opts.device) == "cuda":
        parts = [f"{k} " + "/".join(f"{v[p]:.2f}" for p in ("held", "fwd_peak", "bwd_peak")) for k, v in phases.items()]
        result = f"micro-batch {micro}, GiB held for backward/forward peak/backward peak: " + "; ".join(parts)
    else:
        parts = [f"{k} {v['fwd_s'] + v['bwd_s']:.2f} s" for k, v in phases.items()]
        result = f"forward+backward (no allocator statistics on a CPU): {', '.join(parts)}; backend {backend}"
    report.add("memory by phase", result, "compiled - eager ~ 0 (review D4: +2.2 GiB forward peak)", "INFO")
    return phases


def memory_phases(model_cfg, micro, device, dtype, backend="inductor"):
    """One forward+backward of a fresh GPT(model_cfg) at micro-batch `micro`: eager (its first call apart), then
    torch.compile'd (the first call: compile and autotuning; then a steady one). Each: GiB held for the backward
    when the forward ends, the forward's and the backward's peaks, all over what was allocated before (weights);
    seconds of each pass. Bytes on CUDA only (0 elsewhere)."""
    cuda = device_type(device) == "cuda"
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device)
    x, y = (torch.randint(0, 50257, (micro, model_cfg.block_size), device=device) for _ in range(2))
    gib = (lambda f: f(device) / 2**30) if cuda else (lambda f: 0.0)

    def measure(fn):
        sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        base, t0 = gib(torch.cuda.memory_allocated), time.perf_counter()
        with autocast(device, dtype):
            loss = fn(x, y, return_logits=False)[1]
        sync(device)
        held, fwd, t1 = (
            gib(torch.cuda.memory_allocated) - base,
            gib(torch.cuda.max_memory_allocated) - base,
            time.perf_counter(),
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        loss.backward()
        sync(device)
        bwd, t2 = gib(torch.cuda.max_memory_allocated) - base, time.perf_counter()
        model.zero_grad(set_to_none=True)
        return {"held": held, "fwd_peak": fwd, "bwd_peak": bwd, "fwd_s": t1 - t0, "bwd_s": t2 - t1}

    phases = {"eager first": measure(model), "eager": measure(model)}
    compiled = torch.compile(model, backend=backend)
    phases["compiled first"] = measure(compiled)
    phases["compiled"] = measure(compiled)
    return phases


# ----------------------------------------------------------------------------- main


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", default="auto", help="'auto' (cuda if available), 'cuda', 'cuda:1', or 'cpu' with --tiny"
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model, float32, no compile: the checks a CPU can run")
    p.add_argument("--steps", type=int, default=None, help="train.py steps (default 40; --tiny 6)")
    p.add_argument("--batch_size", type=int, default=None, help="micro-batch to try first (default: the config's, 64)")
    p.add_argument("--hellaswag", type=int, default=300, help="HellaSwag examples to score")
    p.add_argument("--hellaswag_file", default=None, help="hellaswag_val.jsonl (default: assets.fetch_hellaswag())")
    p.add_argument(
        "--hellaswag_model", default=None, help="score this Hugging Face GPT-2 dir instead of the trained one"
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="ranks for the torchrun checks (default: 2 if >= 2 GPUs, else none)"
    )
    p.add_argument(
        "--inject", choices=["chunked"], default=None, help="test hook: make that check compute a wrong result"
    )
    p.add_argument("--slot", action="store_true", help="only what fits one GPU in 8 minutes (docs/gpu-checklist.md)")
    p.add_argument("--out", default=None, help="--slot: the directory for slot.json and the runs' logs")
    opts = p.parse_args(argv)
    if opts.slot and not opts.out:
        p.error("--slot needs --out DIR: where slot.json and the runs' logs go")
    opts.device = resolve_device(opts.device)
    if device_type(opts.device) != "cuda" and not opts.tiny:
        p.error(f"device {opts.device!r} is not a CUDA GPU; use --tiny for the checks a CPU can run")
    if opts.tiny:
        opts.train_args = [*(f"--{k}={v}" for k, v in TINY.items()), "--dtype=float32", "--compile=False"]
        opts.user = {**TINY, "dtype": "float32", "compile": False}
    else:
        opts.train_args = [str(GPT2_124M)]
        opts.user = parse_args([str(GPT2_124M)])
    opts.steps = opts.steps or (6 if opts.tiny else 40)
    opts.batch_size = opts.batch_size or (4 if opts.tiny else make_config(opts.user).batch_size)
    if opts.nproc is None:
        opts.nproc = 2 if device_type(opts.device) == "cuda" and torch.cuda.device_count() >= 2 else 0
    return opts


def main(argv=None):
    opts = parse(sys.argv[1:] if argv is None else argv)
    device = opts.device = use_cuda_device(opts.device) if device_type(opts.device) == "cuda" else opts.device
    if opts.slot:
        try:
            return slot(opts)
        except OSError as e:  # --out cannot be made or written: one line naming the path
            sys.exit(error_message("bench.gpu", e))
        except KeyboardInterrupt:  # the rows measured so far are in slot.json, written after each
            report_error("bench.gpu", KeyboardInterrupt(f"interrupted; the rows measured are in {opts.out}/slot.json"))
            return 130
    report = Report()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        data_dir = Path(tmp) / "data"
        block = make_config(opts.user).block_size
        write_random_shards(data_dir, tokens=(opts.steps + 2) * opts.batch_size * block + 100_000, vocab=50304)
        trained = check_train(report, opts, tmp, data_dir)
        if trained is not None:
            cfg, out_dir, records = trained
            dtype = resolve_dtype(cfg.dtype, device)
            check_compile(report, opts, cfg, device, dtype, tmp)
            check_chunked(report, opts, cfg, device)
            check_hellaswag(report, opts, device, out_dir)
            check_memory(report, cfg, device, dtype, records)
        if opts.nproc >= 2:
            check_torchrun(report, opts, tmp, data_dir, opts.nproc)
        else:
            report.add("ddp", "needs >= 2 GPUs (--nproc N runs it; on a CPU with gloo)", "-", "SKIP")
        check_sigterm_resume(report, opts, tmp, data_dir)
        check_host_syncs(report, opts, tmp, data_dir)
        check_sync_debug(report, opts, tmp, data_dir)
        check_oom(report, opts, tmp, data_dir)
        check_fsdp_bf16_resume(report, opts, tmp, data_dir, opts.nproc)
        check_ddp_scaling(report, opts, tmp, data_dir, trained)
        check_1558m_memory(report, opts, tmp, data_dir)
    print(f"\nbench.gpu on {describe(device)} ({time.perf_counter() - t_start:.0f} s)\n{topology(device)}")
    print(report.table())
    if report.failed():
        print("\nFAILED: at least one check gave a wrong result (see the rows marked FAIL)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
