"""Benchmark: the optimisation scoreboard (tokens/s, MFU, peak memory), and the same work done with transformers.

Run from the repository root:

    python -m bench.scoreboard                      # 6L/6H/384d, T=256, B=8: GEMM rates + scoreboard
    python -m bench.scoreboard --compare            # + transformers training and generation, HellaSwag batched/single
    python -m bench.scoreboard --compare --rows none   # only the comparisons
    python -m bench.scoreboard --config gpt2        # GPT-2 124M, T=1024, B=1: tokens/s and peak memory per row
    python -m bench.scoreboard --rows baseline,train --steps 5 --json bench.json

Scoreboard rows add one optimisation at a time to the row above (as in the GPT-2 throughput write-up):
baseline (fp32, manual attention, for-loop AdamW, eager, full logits, glibc malloc defaults) -> bf16
autocast -> SDPA -> torch.compile -> fused AdamW -> TF32 (CUDA only) -> malloc tuning (CPU/glibc only) ->
chunked loss (no full logits) -> larger micro-batch, then "train.py defaults": exactly the settings
train.py picks on this device (config.TrainConfig's defaults through the devices policy). A CPU whose bf16
matmuls are slower than its fp32 ones (no AVX512-BF16/AMX) skips the bf16 row and later rows stay fp32
(--bf16 on forces it). Each row trains a fresh model from the same seed on the same random batch; after
warm-up the rows run interleaved, one step of each per round (--sequential: one row after another), and
tokens/s is the median over the timed steps. On a CPU the MFU denominator is this machine's own measured
GEMM rate (model-shaped matmuls, in the row's dtype); on a known GPU the data-sheet peak
(devices.peak_flops) is reported as well. Timings on a shared machine are noisy: comparisons run in
alternating rounds in one process and report per-round ratios and their median.

Everything is measured first (measure_* functions return plain dicts, also written by --json), then
report() prints the tables.
"""

import argparse
import copy
import gc
import json
import math
import resource
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from bench import machine_line, require
from bench.hellaswag_speed import bench_hellaswag
from gpt2train import devices, optim
from gpt2train.assets import fetch_hellaswag
from gpt2train.config import TrainConfig
from gpt2train.devices import autocast, device_type, glibc, malloc_tuned, resolve_device, set_malloc_tuned
from gpt2train.generation import Sampling, generate
from gpt2train.hf import CONV1D_WEIGHTS, save_pretrained
from gpt2train.tasks import load_hellaswag
from model import GPT, GPT2_VOCAB, PRESETS, GPTConfig

SMALL = dict(n_layer=6, n_head=6, n_embd=384, block_size=256)  # the default config (issue 7 targets)
GEN_PROMPT, GEN_NEW = 16, 200  # generation benchmark: prompt tokens, new tokens
TARGETS = {
    "fp32_eager": 0.95,
    "defaults_vs_fp32": 2.5,
    "defaults_vs_same": 1.0,
    "cache_vs_nocache": 2.5,
    "cache_vs_hf": 1.5,
}
ROW_KEYS = ("baseline", "bf16", "sdpa", "compile", "fused", "tf32", "malloc", "chunked", "batch", "train")


def log(msg):
    print(msg, file=sys.stderr, flush=True)  # progress; the tables go to stdout


# ----------------------------------------------------------------------------- allocator and memory


def release_free_memory():
    """Return freed heap memory to the OS, so the next peak-RSS measurement starts from live memory only."""
    gc.collect()
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


def status_kb(field, path="/proc/self/status"):
    """A 'Field: N kB' value of a /proc file (this process's VmRSS, VmHWM; MemAvailable of /proc/meminfo), or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of a block of work, in MiB: on CUDA the rise of max_memory_allocated; on a CPU the rise of
    the peak RSS (VmHWM, reset through /proc/self/clear_refs) over the RSS at the start. Where VmHWM cannot be
    reset, the process's lifetime peak RSS is reported instead (self.lifetime = True)."""

    def __init__(self, device):
        self.cuda, self.device, self.lifetime = device_type(device) == "cuda", device, False

    def __enter__(self):
        release_free_memory()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            self.lifetime = True
        self.base = (status_kb("VmRSS") or 0) * 1024
        self.lifetime = self.lifetime or status_kb("VmHWM") is None
        return self

    def __exit__(self, *exc):
        return False

    def peak_mb(self):
        if self.cuda:
            return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        if self.lifetime:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        return (status_kb("VmHWM") * 1024 - self.base) / 2**20


def sync(device):
    """Wait for queued GPU work, so wall-clock timings are real."""
    if device_type(device) == "cuda":
        torch.cuda.synchronize(device)
    elif device_type(device) == "mps":
        torch.mps.synchronize()


# ----------------------------------------------------------------------------- device GEMM rate


def gemm_rates(cfg: GPTConfig, batch_size: int, device, budget_s: float = 2.0):
    """Measured matmul FLOP/s for the model's shapes: {'float32': (rate, rows), 'bfloat16': (rate, rows)}.

    Shapes (as nn.Linear runs them, M = B*T rows): attention in (M, C)x(C, 3C), MLP up (M, C)x(C, 4C), MLP down
    (M, 4C)x(4C, C), lm_head (M, C)x(C, V), outputs preallocated; each shape's time is the best of up to
    `budget_s` of runs. A dtype's rate is total FLOPs / total time over the shapes. Rows
    start at 128 and grow towards M while a matmul takes under 0.2 s, so a slow dtype costs seconds, not minutes.
    """
    M, C, V = batch_size * cfg.block_size, cfg.n_embd, cfg.vocab_size
    shapes = [("attn qkv", C, 3 * C), ("mlp up", C, 4 * C), ("mlp down", 4 * C, C), ("lm_head", C, V)]

    def once(a, w, c):
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, w.t(), out=c)  # what F.linear runs; a preallocated output keeps allocator costs out
        sync(device)
        return time.perf_counter() - t0

    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        rows, flops, secs = [], 0.0, 0.0
        for name, k, n in shapes:
            w = torch.randn(n, k, device=device, dtype=dtype)
            m = min(M, 128)
            while True:
                a = torch.randn(m, k, device=device, dtype=dtype)
                c = torch.zeros(m, n, device=device, dtype=dtype)
                once(a, w, c)  # warm-up
                t = once(a, w, c)
                if t >= 0.2 or m == M:
                    break
                m = min(M, m * 4)
            times = [t]
            while sum(times) < budget_s and len(times) < 20:
                times.append(once(a, w, c))
            t = min(times)  # the device's capability: on a shared machine every slower run was disturbed
            rows.append((name, m, k, n, 2 * m * k * n / t))
            flops, secs = flops + 2 * m * k * n, secs + t
            del a, w, c
        result[str(dtype).replace("torch.", "")] = (flops / secs, rows)
    return result


# ----------------------------------------------------------------------------- one training setup


@dataclass
class Setup:
    name: str
    dtype: str = "float32"  # autocast dtype ('float32' = none)
    sdpa: bool = False  # F.scaled_dot_product_attention instead of the explicit softmax(QK^T) attention
    compile: bool = False
    optimizer: str = "loop"  # 'loop' (foreach=False, fused=False), 'default' (torch's), 'fused', 'train' (train.py's)
    tf32: bool = False  # CUDA only
    malloc: bool = False  # glibc malloc tuned (CPU only; see devices.MALLOPT_TUNED)
    chunked: bool = False  # model(x, y, return_logits=False): lm_head + CE in chunks, no full logits
    batch_size: int = 8
    clip: float = 0.0  # gradient clipping as train.py does it (0 = none)
    hf: bool = False  # transformers.GPT2LMHeadModel instead of ours (sdpa attention, full logits)
    note: str = ""

    @property
    def skipped(self):
        return self.note.startswith("skipped")


def scoreboard_setups(device, batch_size, large_batch_size, bf16_note):
    """The cumulative rows. bf16_note (non-empty) skips the bf16 row and keeps later rows fp32."""
    cuda, has_glibc = device_type(device) == "cuda", glibc() is not None
    rows = [Setup("baseline: fp32, manual attention, loop AdamW, eager, full logits", batch_size=batch_size)]
    add = lambda name, **kw: rows.append(replace(rows[-1], name=name, note="", **kw))
    skip = lambda name, why: rows.append(replace(rows[-1], name=name, note=f"skipped: {why}"))
    if bf16_note:
        skip("+ bf16 autocast", bf16_note)
    else:
        add("+ bf16 autocast", dtype="bfloat16")
    add("+ SDPA attention", sdpa=True)
    add("+ torch.compile", compile=True)
    add("+ fused AdamW", optimizer="fused")
    if cuda:
        add("+ TF32 matmuls", tf32=True)
    else:
        skip("+ TF32 matmuls", "CUDA only")
    if not cuda and has_glibc:
        add("+ glibc malloc tuned (no mmap/trim)", malloc=True)
    else:
        skip("+ glibc malloc tuned (no mmap/trim)", "CPU with glibc only")
    add("+ chunked loss (return_logits=False)", chunked=True)
    add(f"+ micro-batch {large_batch_size}", batch_size=large_batch_size)
    return rows


def train_defaults_setup(device, batch_size):
    """The settings train.py uses on this device: TrainConfig's dtype and compile through the devices policy,
    the allocator tuning it always does on a CPU, its optimizer (optim.adamw), chunked loss,
    gradient clipping, TF32 on CUDA."""
    dtype = devices.resolve_dtype(TrainConfig.dtype, device)
    use_compile = bool(devices.resolve_compile(TrainConfig.compile, device, dtype))
    cpu = device_type(device) == "cpu"
    malloc = cpu and glibc() is not None  # train.py calls devices.tune_cpu_allocator
    note = f"{dtype}, compile {use_compile}"
    if cpu:
        note += f", malloc tuned {malloc}"
    return Setup(
        "train.py defaults",
        dtype=dtype,
        sdpa=True,
        compile=use_compile,
        optimizer="train",
        tf32=device_type(device) == "cuda",
        malloc=malloc,
        chunked=True,
        batch_size=batch_size,
        clip=TrainConfig.grad_clip,
        note=note,
    )


def make_model(cfg: GPTConfig, device):
    """Our GPT, seeded so every row starts from the same weights."""
    torch.manual_seed(0)
    return GPT(cfg).to(device)


def explicit_attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0):
    """softmax(QK^T / sqrt(d)) V written out: the attention of the rows before '+ SDPA attention' (model.py always
    calls F.scaled_dot_product_attention; attention(False) swaps this in)."""
    T, S = q.size(-2), k.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, S)
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if attn_mask is not None:
        att = att.masked_fill(~attn_mask, float("-inf"))
    return F.dropout(F.softmax(att, dim=-1), dropout_p) @ v


@contextmanager
def attention(sdpa):
    """SDPA as model.py calls it, or (sdpa=False) explicit_attention in its place while inside."""
    real = F.scaled_dot_product_attention
    if not sdpa:
        F.scaled_dot_product_attention = explicit_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def make_hf_model(cfg: GPTConfig, device):
    """transformers.GPT2LMHeadModel (sdpa attention) with our vocabulary size and our initial weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
    )
    hf = GPT2LMHeadModel._from_config(hf_cfg, attn_implementation="sdpa")
    sd = {k: (v.t() if k.endswith(CONV1D_WEIGHTS) else v) for k, v in make_model(cfg, "cpu").state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]:
        raise RuntimeError(
            f"bench.scoreboard: copying weights to GPT2LMHeadModel: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return hf.to(device).train()


def make_optimizer(model, setup: Setup, device):
    if setup.optimizer == "train":
        c = TrainConfig
        return optim.adamw(
            model.parameters(),
            c.weight_decay,
            c.learning_rate,
            (c.beta1, c.beta2),
            fused=devices.fused_adamw_supported(device_type(device)),
        )
    kw = {"loop": dict(foreach=False, fused=False), "default": {}, "fused": dict(fused=True)}[setup.optimizer]
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **kw)


@contextmanager
def tf32(enabled):
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


class Trainer:
    """One model + optimizer configured by a Setup; step() is one full training step on a fixed batch."""

    def __init__(self, cfg: GPTConfig, setup: Setup, device):
        self.setup, self.device = setup, device
        self.cpu = device_type(device) == "cpu"
        if self.cpu:
            set_malloc_tuned(setup.malloc)
        self.model = make_hf_model(cfg, device) if setup.hf else make_model(cfg, device)
        self.optimizer = make_optimizer(self.model, setup, device)
        # dynamic=False: each batch size gets its own static graph, as in a real run
        self.forward = torch.compile(self.model, dynamic=False) if setup.compile else self.model
        g = torch.Generator().manual_seed(1)
        xy = torch.randint(0, min(cfg.vocab_size, GPT2_VOCAB), (setup.batch_size, cfg.block_size + 1), generator=g)
        self.x, self.y = xy[:, :-1].to(device), xy[:, 1:].to(device)  # (B, T) each
        self.tokens = setup.batch_size * cfg.block_size

    def step(self):
        """One training step; returns its wall time in seconds."""
        s = self.setup
        if self.cpu:
            set_malloc_tuned(s.malloc)
        sync(self.device)
        t0 = time.perf_counter()
        with tf32(s.tf32), attention(s.sdpa or s.hf), autocast(self.device, s.dtype):
            if s.hf:
                logits = self.forward(input_ids=self.x).logits  # (B, T, V)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), self.y.reshape(-1))
            else:
                _, loss = self.forward(self.x, self.y, return_logits=not s.chunked)
        loss.backward()
        if s.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)
        return time.perf_counter() - t0


def fits_interleaved(n_params, n_setups, device):
    """Whether n_setups models with AdamW state (~16 bytes/parameter) fit in half the free memory."""
    if device_type(device) == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        kb = status_kb("MemAvailable", "/proc/meminfo")
        free = None if kb is None else kb * 1024
    return free is None or 16 * n_params * n_setups < free / 2


def measure(cfg, setups: dict, device, rounds, warmup, interleave=True):
    """Warm up each setup in turn (its first step's time and peak memory measured while it runs alone), then
    time `rounds` steps of each. Interleaved: one step of every setup per round, in a fixed order, so a machine
    whose load drifts slows all setups alike; else one setup after another (when they do not fit in memory
    together). Returns {key: {'tok_s': [per round], 'first_step_s', 'peak_mem_mb', 'peak_mem_lifetime'}}."""
    results, trainers = {}, {}
    for key, setup in setups.items():
        if not interleave:
            torch._dynamo.reset()  # each compiled setup compiles afresh
        log(f"  {setup.name} ...")
        if device_type(device) == "cpu":
            set_malloc_tuned(setup.malloc)  # before the memory baseline is taken
        with PeakMemory(device) as mem:
            trainer = Trainer(cfg, setup, device)
            first = trainer.step()
            for _ in range(warmup - 1 + (1 if setup.compile else 0)):
                trainer.step()
            peak = mem.peak_mb()
        results[key] = {"tok_s": [], "first_step_s": first, "peak_mem_mb": peak, "peak_mem_lifetime": mem.lifetime}
        if interleave:
            trainers[key] = trainer
        else:
            results[key]["tok_s"] = [trainer.tokens / trainer.step() for _ in range(rounds)]
            del trainer
            release_free_memory()
    for r in range(rounds if interleave else 0):
        for key, trainer in trainers.items():
            if trainer.cpu and trainer.setup.malloc != malloc_tuned():
                trainer.step()  # the allocator mode changed: settle the heap untimed, as a run in this mode would
            results[key]["tok_s"].append(trainer.tokens / trainer.step())
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{key} {results[key]['tok_s'][-1]:.0f}" for key in trainers))
    del trainers
    release_free_memory()
    return results


def ratios(results, a, b):
    """Per-round tokens/s ratios of setup a over setup b."""
    return [x / y for x, y in zip(results[a]["tok_s"], results[b]["tok_s"])]


# ----------------------------------------------------------------------------- comparisons with transformers


def compare_training(cfg, device, batch_size, rounds, rates, flops_per_token, interleave=True):
    """Ours vs transformers, measured in alternating rounds (see measure). Returns {'variants': [{key, setup,
    tok_s per round}], 'ratios': [{name, target or None, per_round}], 'ceiling_tok_s': {dtype: tokens/s at
    100% of the measured GEMM rate}, 'ceiling_vs_hf': {dtype: that over transformers fp32 eager}}."""
    defaults = train_defaults_setup(device, batch_size)
    hf = Setup("transformers fp32 eager", sdpa=True, optimizer="default", hf=True, batch_size=batch_size)
    hf_same = replace(
        hf,
        name="transformers, train.py's dtype/compile",
        dtype=defaults.dtype,
        compile=defaults.compile,
        tf32=defaults.tf32,
    )
    variants = {
        "hf": hf,
        "ours": Setup("ours fp32 eager", sdpa=True, optimizer="default", batch_size=batch_size),
        "defaults": replace(defaults, name="ours, train.py defaults"),
    }
    if (hf_same.dtype, hf_same.compile, hf_same.tf32) != (hf.dtype, hf.compile, hf.tf32):
        variants["hf_same"] = hf_same
    if defaults.malloc:  # what transformers gets from the same allocator setting, for an apples-to-apples ratio
        base = variants.get("hf_same", hf)
        variants["hf_malloc"] = replace(base, name=base.name + " + malloc tuned", malloc=True)
    results = measure(cfg, variants, device, rounds, warmup=1, interleave=interleave)
    ratio = lambda a, b: ratios(results, a, b)
    same = "hf_same" if "hf_same" in variants else "hf"
    rows = [
        ("ours fp32 eager / transformers fp32 eager", TARGETS["fp32_eager"], ratio("ours", "hf")),
        ("ours train.py defaults / transformers fp32 eager", TARGETS["defaults_vs_fp32"], ratio("defaults", "hf")),
        (
            f"ours train.py defaults / transformers with train.py's dtype+compile ({defaults.dtype}, compile "
            f"{defaults.compile})",
            TARGETS["defaults_vs_same"],
            ratio("defaults", same),
        ),
    ]
    if "hf_malloc" in variants:
        rows.append((f"ours train.py defaults / {variants['hf_malloc'].name}", None, ratio("defaults", "hf_malloc")))
    # the most any implementation could reach here: every FLOP at the measured GEMM rate (MFU 100%)
    ceiling = {d: rate / flops_per_token for d, rate in rates.items()}
    hf_median = statistics.median(results["hf"]["tok_s"])
    return {
        "variants": [{"key": key, "setup": asdict(v), "tok_s": results[key]["tok_s"]} for key, v in variants.items()],
        "ratios": [{"name": n, "target": t, "per_round": vs} for n, t, vs in rows],
        "ceiling_tok_s": ceiling,
        "ceiling_vs_hf": {d: c / hf_median for d, c in ceiling.items()},
    }


def compare_generation(cfg, device, rounds, dtypes, slow_dtypes=()):
    """Greedy generation of GEN_NEW tokens after a GEN_PROMPT-token prompt, batch 1: ours with and without the
    KV cache vs transformers' generate on the same weights (save_pretrained/from_pretrained round trip).
    In slow_dtypes (emulated bf16 on a CPU) the no-cache run, minutes of recomputation, is left out.
    Returns one dict per (dtype, variant): tok_s per round, cached_ratio (median per-round ratio of ours with
    the KV cache over this variant), n_tokens, same_tokens and first_difference against ours with the cache."""
    from transformers import GPT2LMHeadModel

    ours32 = make_model(cfg, device).eval()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, min(cfg.vocab_size, GPT2_VOCAB), (1, GEN_PROMPT), generator=g).to(device)  # (1, T)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours32, tmp)
        for dtype in dtypes:
            ours = copy.deepcopy(ours32).to(dtype)  # weights stored in the dtype: decoding reads half the bytes in bf16
            hf = GPT2LMHeadModel.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa").to(device).eval()
            hf.generation_config.eos_token_id = None  # never stop early: GEN_NEW tokens, as ours
            hf.generation_config.pad_token_id = 0
            runs = {
                "ours, KV cache": partial(generate, ours, prompt, GEN_NEW, Sampling(temperature=0.0)),
                "ours, no cache": partial(
                    generate, ours, prompt, GEN_NEW, Sampling(temperature=0.0), use_kv_cache=False
                ),
                "transformers generate": partial(hf.generate, prompt, max_new_tokens=GEN_NEW, do_sample=False),
            }
            if dtype in slow_dtypes:
                del runs["ours, no cache"]
            names, per_round, tokens = list(runs), {name: [] for name in runs}, {}
            with torch.no_grad():
                for name, fn in runs.items():  # warm-up, and the tokens for the agreement check
                    log(f"  generation {dtype}: {name} ...")
                    tokens[name] = fn()[0, GEN_PROMPT:].tolist()
                for r in range(rounds):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        sync(device)
                        t0 = time.perf_counter()
                        runs[name]()
                        sync(device)
                        per_round[name].append(GEN_NEW / (time.perf_counter() - t0))
            ref, cached = tokens["ours, KV cache"], per_round["ours, KV cache"]
            for name in runs:
                same = sum(a == b for a, b in zip(tokens[name], ref))
                first_diff = next((i for i, (a, b) in enumerate(zip(tokens[name], ref)) if a != b), None)
                results.append(
                    {
                        "dtype": str(dtype).replace("torch.", ""),
                        "variant": name,
                        "tok_s": per_round[name],
                        "cached_ratio": statistics.median(a / b for a, b in zip(cached, per_round[name])),
                        "n_tokens": len(tokens[name]),
                        "same_tokens": same,
                        "first_difference": first_diff,
                    }
                )
            del ours, hf
    return results


def hellaswag_rates(cfg, device, n, batch_size):
    """bench.hellaswag_speed.bench_hellaswag on a fresh model of this config (weights do not matter for speed),
    in train.py's dtype."""
    if cfg.vocab_size < GPT2_VOCAB:
        return {"note": f"skipped: HellaSwag needs the GPT-2 vocabulary, this config has vocab_size {cfg.vocab_size}"}
    try:
        examples = load_hellaswag(fetch_hellaswag(), limit=n)
    except Exception as e:  # no network and no cached copy
        return {"note": f"skipped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    dtype = train_defaults_setup(device, 1).dtype
    model = make_model(cfg, device).eval()
    r = bench_hellaswag(model, examples, device, batch_size=batch_size, dtype=dtype)
    return {**r, "dtype": dtype}


# ----------------------------------------------------------------------------- output


def md_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def mfu(tok_s, flops_per_token, rate):
    if not rate:
        return None
    return tok_s * flops_per_token / rate


# ----------------------------------------------------------------------------- measuring: plain data out


def datasheet_peak(out, dtype):
    """The data-sheet FLOP/s of this CUDA device in dtype, or None (no dtype, a CPU, or a GPU
    devices.peak_flops does not know)."""
    return devices.peak_flops(out["device_name"], dtype) if out["cuda"] and dtype else None


def measure_gemm(cfg, batch_size, device, bf16_mode):
    """(gemm_flops {dtype: {'all', 'shapes'}}, bf16_note): the matmul rates, and why the bf16 rows are skipped
    ('' when they run). bf16_mode 'auto' skips them on a CPU whose bf16 matmuls are slower than fp32."""
    measured = gemm_rates(cfg, batch_size, device)
    gemm = {
        d: {"all": r, "shapes": [dict(zip(("name", "m", "k", "n", "flops"), s)) for s in shapes]}
        for d, (r, shapes) in measured.items()
    }
    f32, bf16 = gemm["float32"]["all"], gemm["bfloat16"]["all"]
    if bf16_mode == "off":
        return gemm, "--bf16 off"
    if bf16_mode == "auto" and bf16 < f32 and device_type(device) != "cuda":
        return gemm, f"bf16 matmuls run at {bf16 / 1e9:.1f} GFLOP/s vs fp32 {f32 / 1e9:.1f} here; later rows stay fp32"
    return gemm, ""


def measure_scoreboard(out, cfg, device, wanted, large_batch_size, steps, warmup, sequential):
    """The scoreboard rows in ROW_KEYS order: {key, setup} for a row not run, plus the measure() fields and
    tokens_per_s (median), speedup (over the baseline), mfu_gemm and mfu_datasheet for a row that ran."""
    B = out["batch_size"]
    rows = scoreboard_setups(device, B, large_batch_size, out["bf16_note"]) + [train_defaults_setup(device, B)]
    setups = dict(zip(ROW_KEYS, rows))
    run = {key: setup for key, setup in setups.items() if key in wanted and not setup.skipped}
    interleave = not sequential and fits_interleaved(out["n_params"], len(run), device)
    log(
        f"## scoreboard: {len(run)} setups, {steps} timed steps each, "
        f"{'interleaved' if interleave else 'one after another'} ..."
    )
    measured = measure(cfg, run, device, steps, warmup, interleave)
    fpt = out["flops_per_token"]
    result = []
    for key, setup in setups.items():
        if key not in wanted:
            continue
        row = {"key": key, "setup": asdict(setup)}
        if key in measured:
            r = measured[key]
            tok = statistics.median(r["tok_s"])
            speedup = None
            if "baseline" in measured and interleave:
                speedup = statistics.median(ratios(measured, key, "baseline"))  # per-round ratios
            elif "baseline" in measured:
                speedup = tok / statistics.median(measured["baseline"]["tok_s"])
            peak_dtype = setup.dtype  # a bf16/fp16 row runs at that peak even with TF32 on for its fp32 matmuls
            if setup.dtype == "float32":
                peak_dtype = "tf32" if setup.tf32 else None  # plain fp32 matmuls: no data-sheet row
            row.update(
                r,
                tokens_per_s=tok,
                speedup=speedup,
                interleaved=interleave,
                mfu_gemm=mfu(tok, fpt, out["gemm_flops"].get(setup.dtype, {}).get("all")),
                mfu_datasheet=mfu(tok, fpt, datasheet_peak(out, peak_dtype)),
            )
        result.append(row)
    return result


def measure_all(args, device, cfg, B, large_B, wanted):
    """Every measurement this invocation asks for, as one JSON-able dict (what --json writes)."""
    t_start = time.perf_counter()
    cuda = device_type(device) == "cuda"
    probe = make_model(cfg, "cpu")
    out = {
        "machine": machine_line(device),
        "device": str(device),
        "cuda": cuda,
        "device_name": torch.cuda.get_device_name(device) if cuda else device_type(device),
        "config": asdict(cfg),
        "batch_size": B,
        "flops_per_token": probe.flops_per_token(cfg.block_size),
        "n_params": probe.num_params(),
        "steps": args.steps,
        "rounds": args.rounds,
    }
    del probe
    log("## matmul rates ...")
    out["gemm_flops"], out["bf16_note"] = measure_gemm(cfg, B, device, args.bf16)
    if wanted:
        out["scoreboard"] = measure_scoreboard(
            out, cfg, device, wanted, large_B, args.steps, args.warmup, args.sequential
        )
    if args.compare:
        log(f"## training vs transformers, {args.rounds} rounds ...")
        rates = {d: g["all"] for d, g in out["gemm_flops"].items()}
        interleave = not args.sequential and fits_interleaved(out["n_params"], 5, device)
        out["compare_training"] = compare_training(
            cfg, device, B, args.rounds, rates, out["flops_per_token"], interleave
        )
        dtypes = [torch.float32, torch.bfloat16]
        if cfg.block_size < GEN_PROMPT + GEN_NEW:  # transformers cannot go past n_positions
            dtypes = []
            out["generation_note"] = f"block_size {cfg.block_size} < {GEN_PROMPT} + {GEN_NEW} tokens"
        log("## generation ...")
        slow = [torch.bfloat16] if out["bf16_note"] else []
        out["compare_generation"] = compare_generation(cfg, device, args.gen_rounds, dtypes, slow) if dtypes else []
        log("## HellaSwag ...")
        out["hellaswag"] = hellaswag_rates(cfg, device, args.hellaswag_n, 16)
    out["wall_s"] = time.perf_counter() - t_start
    return out


# ----------------------------------------------------------------------------- printing: tables from that data


def report(out):
    """Print the Markdown tables of a measure_all() result."""
    cfg = out["config"]
    print(
        f"# bench.scoreboard: {cfg['n_layer']} layers, {cfg['n_head']} heads, {cfg['n_embd']} dims, "
        f"T={cfg['block_size']}, V={cfg['vocab_size']}, micro-batch {out['batch_size']}; "
        f"{out['n_params'] / 1e6:.1f}M parameters, {out['flops_per_token'] / 1e6:.0f} MFLOP/token (training)"
    )
    print(f"machine: {out['machine']}\n")
    report_gemm(out)
    if "scoreboard" in out:
        report_scoreboard(out)
    if "compare_training" in out:
        report_training(out)
        report_generation(out)
        report_hellaswag(out["hellaswag"])
    print(f"(bench.scoreboard took {out['wall_s']:.0f} s)")


def report_gemm(out):
    table = []
    for d, g in out["gemm_flops"].items():
        table += [
            (d, s["name"], f"({s['m']}, {s['k']}) x ({s['k']}, {s['n']})", f"{s['flops'] / 1e9:,.1f}")
            for s in g["shapes"]
        ]
        total = f"**{g['all'] / 1e9:,.1f}**"
        sheet = datasheet_peak(out, d)
        if sheet:
            total += f" (data sheet {sheet / 1e12:,.0f} TFLOP/s)"
        table.append((d, "**all shapes**", "", total))
    print("## Matmul rate (GFLOP/s, nn.Linear shapes of this model)\n")
    print(md_table(("dtype", "shape", "GEMM", "GFLOP/s"), table) + "\n")


def report_scoreboard(out):
    cuda, B = out["cuda"], out["batch_size"]
    headers = ["setup", "tokens/s", "speedup", "MFU (measured GEMM)"]
    if cuda:
        headers.append("MFU (data sheet)")
    headers += ["peak mem (MiB)", "first step (s)", "note"]
    table, interleaved = [], False
    for r in out["scoreboard"]:
        setup = r["setup"]
        if "tokens_per_s" not in r:
            table.append([setup["name"], "-", "-", "-"] + (["-"] if cuda else []) + ["-", "-", setup["note"]])
            continue
        interleaved = r["interleaved"]
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        row = [setup["name"], f"{r['tokens_per_s']:,.0f}", speedup, pct(r["mfu_gemm"])]
        if cuda:
            row.append(pct(r["mfu_datasheet"]))
        note = setup["note"]
        if not note and setup["batch_size"] != B:
            note = f"B={setup['batch_size']}"
        peak = f"{r['peak_mem_mb']:,.0f}"
        if r["peak_mem_lifetime"]:
            peak += " (lifetime)"
        table.append(row + [peak, f"{r['first_step_s']:.1f}", note])
    if interleaved:
        how = f"median of {out['steps']} interleaved rounds (speedup: median of per-round ratios)"
    else:
        how = f"median of {out['steps']} timed steps"
    print(f"## Scoreboard: training tokens/s, {how}; each row adds one change to the row above\n")
    print(md_table(headers, table))
    mem_how = "rise of max_memory_allocated" if cuda else "rise of the process's peak RSS (VmHWM) during the row"
    sheet = " and over the data-sheet peak" if cuda else ""
    print(
        f"\npeak mem: {mem_how}. MFU: {out['flops_per_token'] / 1e6:.0f} MFLOP/token x tokens/s over the measured "
        f"GEMM rate in the row's dtype{sheet}.\n"
    )


def report_training(out):
    c, B = out["compare_training"], out["batch_size"]
    print(
        f"## Training vs transformers.GPT2LMHeadModel (sdpa): micro-batch {B}, {out['rounds']} alternating "
        "rounds, one step per variant per round\n"
    )
    rows = []
    for v in c["variants"]:
        setup, med = v["setup"], statistics.median(v["tok_s"])
        rate = out["gemm_flops"].get(setup["dtype"], {}).get("all")
        rows.append(
            (
                setup["name"],
                " ".join(f"{t:.0f}" for t in v["tok_s"]),
                f"{med:,.0f}",
                pct(mfu(med, out["flops_per_token"], rate)),
                f"{setup['dtype']}, compile {setup['compile']}, malloc tuned {setup['malloc']}",
            )
        )
    print(md_table(("variant", "tokens/s per round", "median", "MFU (measured GEMM)", "settings"), rows) + "\n")
    rows = []
    for r in c["ratios"]:
        med, target = statistics.median(r["per_round"]), r["target"]
        if target is None:
            wanted, met = "(for reference)", "-"
        else:
            wanted, met = f">= {target}x", "yes" if med >= target else "NO"
        rows.append((r["name"], " ".join(f"{v:.2f}" for v in r["per_round"]), f"**{med:.2f}x**", wanted, met))
    print(md_table(("ratio", "per round", "median", "target", "met"), rows) + "\n")
    print(
        "Ceiling (MFU 100% of the measured GEMM rate): "
        + ", ".join(
            f"{d} {ceiling:,.0f} tokens/s = {c['ceiling_vs_hf'][d]:.2f}x transformers fp32 eager"
            for d, ceiling in c["ceiling_tok_s"].items()
        )
        + ".\n"
    )


def report_generation(out):
    if "generation_note" in out:
        print(f"Generation comparison skipped: {out['generation_note']}.\n")
        return
    rows = []
    for r in out["compare_generation"]:
        same = f"{r['same_tokens']}/{GEN_NEW}"
        if r["first_difference"] is not None:
            same += f" (first differs at {r['first_difference']})"
        ratio = "-" if r["variant"] == "ours, KV cache" else f"**{r['cached_ratio']:.2f}x**"
        rows.append(
            (
                r["dtype"],
                r["variant"],
                " ".join(f"{v:.1f}" for v in r["tok_s"]),
                f"{statistics.median(r['tok_s']):,.1f}",
                ratio,
                same,
            )
        )
    print(
        f"## Greedy generation: {GEN_NEW} new tokens after a {GEN_PROMPT}-token prompt, batch 1, weights "
        f"stored in the dtype (targets in fp32: cached >= {TARGETS['cache_vs_nocache']}x no cache, "
        f">= {TARGETS['cache_vs_hf']}x transformers)\n"
    )
    print(
        md_table(
            (
                "dtype",
                "variant",
                "new tokens/s per round",
                "median",
                "ours cached / this (median of rounds)",
                "same tokens as ours cached",
            ),
            rows,
        )
        + "\n"
    )
    if out["bf16_note"]:
        print(f"bf16 without the KV cache not run: {out['bf16_note'].split(';')[0]}.\n")


def report_hellaswag(hs):
    print("## HellaSwag evaluation rate (bench.hellaswag_speed.bench_hellaswag, random weights)\n")
    if "note" in hs:
        print(hs["note"] + "\n")
        return
    print(
        md_table(
            (
                "examples",
                "dtype",
                "1 per forward (ex/s)",
                f"{hs['batch_size']} per forward (ex/s)",
                "speedup",
                "same predictions",
            ),
            [
                (
                    hs["n"],
                    hs["dtype"],
                    f"{hs['single_ex_per_s']:.1f}",
                    f"{hs['batched_ex_per_s']:.1f}",
                    f"{hs['speedup']:.2f}x",
                    hs["same_preds"],
                )
            ],
        )
        + "\n"
    )


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.strip().splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    p.add_argument("--config", default="small", help=f"'small' (6L/6H/384d, T=256) or a preset: {', '.join(PRESETS)}")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        p.add_argument(f"--{key}", type=int, help="override the config's value")
    p.add_argument("--batch_size", type=int, default=None, help="micro-batch (default 8 for 'small', else 1)")
    p.add_argument("--large_batch_size", type=int, default=None, help="the larger micro-batch row (default 2x)")
    p.add_argument("--device", default="auto", help="'auto' (cuda > mps > cpu), 'cpu', 'cuda', 'cuda:1', ...")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps (rounds) per scoreboard row, median reported (default 5 on CPU, 20 on GPU)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per row (+1 for compiled rows)")
    p.add_argument(
        "--rows", default="all", help=f"'all', 'none' or a comma list of {','.join(ROW_KEYS)} (rows stay cumulative)"
    )
    p.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bf16 rows: 'auto' skips them where bf16 matmuls measure slower than fp32",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="time setups one after another instead of in interleaved rounds (less memory)",
    )
    p.add_argument("--compare", action="store_true", help="also: transformers training and generation, HellaSwag")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="alternating rounds of the training comparison (default 5 on CPU, 20 on GPU)",
    )
    p.add_argument("--gen_rounds", type=int, default=5, help="alternating rounds of the generation comparison")
    p.add_argument("--hellaswag_n", type=int, default=40, help="HellaSwag examples for the batched-vs-single row")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="also write all results to this JSON file")
    return p.parse_args(argv)


def resolve_args(args):
    """(device, GPTConfig, micro-batch, large micro-batch, wanted row keys) from the flags; bad ones exit."""
    device = resolve_device(args.device)
    on_cpu = device_type(device) == "cpu"
    args.steps = args.steps or (5 if on_cpu else 20)
    args.rounds = args.rounds or (5 if on_cpu else 20)
    if args.config != "small" and args.config not in PRESETS:
        raise SystemExit(f"bench.scoreboard: --config {args.config!r} is not 'small' or one of {', '.join(PRESETS)}")
    base = dict(SMALL if args.config == "small" else PRESETS[args.config])
    base.update(
        {
            k: getattr(args, k)
            for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
            if getattr(args, k) is not None
        }
    )
    B = args.batch_size or (8 if args.config == "small" else 1)
    if args.rows == "all":
        wanted = set(ROW_KEYS)
    elif args.rows == "none":
        wanted = set()
    else:
        wanted = set(args.rows.split(","))
    if bad := wanted - set(ROW_KEYS):
        raise SystemExit(
            f"bench.scoreboard: --rows has unknown {sorted(bad)}; expected 'all', 'none' or some of {ROW_KEYS}"
        )
    return device, GPTConfig(**base), B, args.large_batch_size or 2 * B, wanted


def main(argv=None):
    args = parse_args(argv)
    if args.compare:  # transformers' model and generate; safetensors for the save_pretrained round trip
        require("bench.scoreboard --compare", "transformers", "safetensors")
    for limit in ("cache_size_limit", "recompile_limit"):  # interleaved setups keep several compiled models alive
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    if args.threads:
        torch.set_num_threads(args.threads)
    out = measure_all(args, *resolve_args(args))
    report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
