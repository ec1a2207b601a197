"""Know before you start: predicted peak memory per rank, whether it fits the device, and the micro-batch that fits.

estimate_memory(cfg, batch_size, ...) -> MemoryPlan adds up, per rank and in bytes: parameters, gradients and
optimizer state (fp32 under autocast; divided by the shard size under FSDP/HSDP), the tensors autograd saves
for backward in one micro-batch (with or without activation checkpointing) plus the backward's working set,
and the chunked loss's buffers (the loss and the backward's peak are never live together: the larger counts).
MemoryPlan.line() is the one line train.py prints before step 1.
headroom.device_memory(env) says what a rank's plan may use of its device; check_fits() refuses a plan that cannot
fit, naming the settings that would. batch_size='auto' uses plan_micro_batch() (CPU/MPS: from the plan) or
step.probe_batch_size() (CUDA: real forward+backward, halving on out-of-memory; devices.is_oom classifies errors).

The activation model follows what eager PyTorch saves per block (dropout 0, SDPA's fused kernel): the block
input and the residual after attention (fp32 under autocast too), the LayerNorm outputs as the next matmul
sees them, q/k/v in one (B, T, 3C) buffer, the attention output, the MLP's pre- and post-activation (B, T, 4C)
and, under autocast, the low-precision copies of the block's matmul weights. torch.compile saves less, so the
plan is an upper bound there.

A run calls resolve_batch_size() before anything is built (the plan line, a refusal, batch_size='auto' from the
plan) and step.probe_batch_size() once the bare model exists (batch_size='auto' on CUDA); step.py halves the
micro-batch on an out-of-memory mid-run (smaller_micro_batch). dryrun.py proves a plan at the real size and
world size on fake tensors.
"""

import gc
from dataclasses import dataclass, replace

import torch

from gpt2train.config import CHOICES, ConfigError, batch_layout
from gpt2train.console import log
from gpt2train.headroom import GiB, device_memory, gib
from gpt2train.layout import microbatches, stage_blocks
from model import GPT, GRAD_W_SLICE_ROWS, LOSS_CHUNK_ROWS, SMEAR_CHANNELS

SPLIT = ("attn.c_attn", "mlp.c_fc", "attn.c_proj.weight", "mlp.c_proj.weight")  # tensor_parallel.split_blocks'
# batch_size='auto' from the plan (CPU/MPS): use at most this share of the available memory. On a CPU the peak
# RSS runs above the plan (docs/memory.md): glibc's heap keeps freed blocks as holes larger requests cannot reuse
AUTO_FIT_FRACTION = 0.5


class MemoryPlanError(ValueError):
    """Nothing fits; the message is one line naming what was tried."""


@dataclass
class MemoryPlan:
    """Predicted peak memory of one rank, in bytes, by part. total is their sum."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    batch_size: int
    optimizer_name: str = "AdamW"
    gathered: int = 0  # FSDP/HSDP: the all-gathered (unsharded) parameters and gradients of the units in use

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.gathered

    def line(self) -> str:
        """'estimated peak memory per rank: 21.3 GiB (params 2.9 + grads 2.9 + AdamW 5.8 + activations 9.1 at
        micro-batch 16 + logits 0.6)'. The prefix and the total first are a contract: tools parse them."""
        parts = [f"params {gib(self.params)}", f"grads {gib(self.grads)}"]
        parts += [f"{self.optimizer_name} {gib(self.optimizer)}"]
        parts += [f"all-gathered {gib(self.gathered)}"] if self.gathered else []
        parts += [f"activations {gib(self.activations)} at micro-batch {self.batch_size}", f"logits {gib(self.logits)}"]
        return f"estimated peak memory per rank: {gib(self.total)} GiB ({' + '.join(parts)})"


# ----------------------------------------------------------------------------- the plan

_PARAM_STATS = {}  # repr(cfg) -> param_stats(cfg)


def param_stats(cfg) -> dict:
    """Parameter counts of GPT(cfg), read off a model built on the meta device (no memory, any config fields):
    total (tied tensors once), block (one block's), block_matmul (its Linear weights), hidden (MLP width)."""
    key = repr(cfg)
    if key not in _PARAM_STATS:
        _PARAM_STATS[key] = _count_params(cfg)
    return _PARAM_STATS[key]


def _count_params(cfg) -> dict:
    # one and two blocks stand for all: they are alike (a 2000-layer model took 25 s to build), and the second's
    # count is what each layer adds, inside its block or not (the bigram table's per-block share)
    with torch.device("meta"):
        one, two = GPT(replace(cfg, n_layer=1)), GPT(replace(cfg, n_layer=2))
    block = one.transformer.h[0]
    count = [sum(p.numel() for p in m.parameters()) for m in (one, two)]
    return {
        "total": count[0] + (cfg.n_layer - 1) * (count[1] - count[0]),
        "block": sum(p.numel() for p in block.parameters()),
        "block_matmul": sum(mod.weight.numel() for mod in block.modules() if isinstance(mod, torch.nn.Linear)),
        # what tensor parallelism splits (tensor_parallel.split_blocks): the matrices, and c_attn's and c_fc's biases
        "block_split": sum(p.numel() for n, p in block.named_parameters() if n.startswith(SPLIT)),
        "hidden": block.mlp.c_fc.out_features,
    }


def _bytes_per_element(dtype) -> int:
    """Bytes of an activation the matmuls produce: 4 in fp32, 2 under bf16/fp16 autocast."""
    name = str(dtype).replace("torch.", "")
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"estimate_memory: dtype {dtype!r}, expected 'float32', 'bfloat16' or 'float16'")
    return 4 if name == "float32" else 2


def saved_bytes_per_token(cfg, dtype="float32", low_params: bool = False, tp: int = 1) -> tuple[int, int]:
    """(bytes per token of one block, bytes per token outside the blocks) that autograd saves for backward.

    Per block: the residual stream x and x + attn (fp32 under autocast too: r bytes each), the ln_1/ln_2
    outputs as the matmuls read them, q/k/v in one (B, T, 3C) buffer, the attention output and the MLP's pre-
    and post-activation (hidden each), all in the compute dtype (a bytes), plus LayerNorm statistics and SDPA's
    log-sum-exp. Outside: token ids, ln_f's input and statistics; the recipe's value embeddings, smear and bigram
    table add their own. tp: a tensor-parallel rank's share, its heads' and hidden units' (all but the residual
    stream and the LayerNorm outputs) divided by tp."""
    C, nh = cfg.n_embd, cfg.n_head
    H, a = param_stats(cfg)["hidden"], _bytes_per_element(dtype)
    r = a if low_params else 4  # FSDP's low-precision parameters make the residual stream low-precision too
    residuals = 1 if cfg.parallel_residual else 2  # parallel: both branches read ln(x)
    # rotary/QK-norm: new (B, nh, T, hs) q and k, so the attention output comes out in that layout and
    # (B, T, C) is one more copy
    rotated = cfg.rotary_pct is not None or cfg.qk_norm
    block = residuals * r * C + a * (2 * C + (4 * C + 2 * H + (3 * C if rotated else 0)) // tp) + 2 * 8 + 4 * nh // tp
    if cfg.qk_norm and a < 4:  # autocast runs rms_norm in fp32: it saves fp32 copies of q and k
        block += 2 * 4 * C
    if cfg.dropout > 0:  # rough: dropout masks, and attention's (T, T) math path
        block += 2 * a * C + nh * cfg.block_size * (2 * a + 1)
    outside = 8 + r * C + 8
    if cfg.value_embeds:  # the fp32 table lookup; per block v becomes its own tensor, and the q/k/v buffer is
        # freed where nothing else keeps a view of it (rotated q and k are copies, except fp32 QK-norm's input)
        outside += 4 * C
        block += a * C if not rotated or (cfg.qk_norm and a == 4) else -2 * a * C
    if cfg.smear:  # the previous embeddings (fp32), the gate's input (fp32: all of x; autocast: a copy), its output
        outside += 4 * C + (4 * C if a == 4 else a * SMEAR_CHANNELS) + 8
    if cfg.bigram_embeds:  # the table's rows (int64) and its fp32 lookup, which every block's share reads
        outside += 8 + 4 * C
    return block, outside


def _activation_parts(cfg, tokens, dtype, activation_checkpointing, low_params, tp=1) -> tuple[int, int]:
    """(saved through the whole backward of a micro-batch of `tokens`, the backward's working set: the recomputed
    block, its weights' low-precision copies and the gradients in flight). With activation checkpointing only each
    block's input is saved, and one block is recomputed at a time; low_params: FSDP/HSDP all-gathers low-precision
    parameters (the residual stream is in that dtype too); tp: a tensor-parallel rank's (saved_bytes_per_token)."""
    stats, a = param_stats(cfg), _bytes_per_element(dtype)
    r = a if low_params else 4
    block, outside = saved_bytes_per_token(cfg, dtype, low_params, tp)
    backward = r * cfg.n_embd + a * stats["hidden"] // tp  # the residual's gradient and the MLP hidden's
    # autocast's copies, saved by the matmuls
    weights = stats["block_matmul"] // tp * 2 if a < 4 and not low_params else 0
    L = cfg.n_layer
    recomputed = sum(map(replace(cfg, activation_checkpointing=activation_checkpointing).recomputes, range(L)))
    if recomputed == L:
        return tokens * (L + 1) * r * cfg.n_embd, tokens * (8 + block + backward) + weights
    if recomputed == 0:
        return tokens * (L * block + outside) + L * weights, tokens * backward
    kept = L - recomputed  # 'selective': the recomputed blocks save their input, the others everything
    return (
        tokens * (recomputed * r * cfg.n_embd + kept * block + outside) + kept * weights,
        tokens * (8 + block + backward) + weights,
    )


def loss_bytes(cfg, batch_size: int, dtype="float32", seq_len: int | None = None, low_params: bool = False) -> int:
    """Peak bytes of ChunkedLMHeadLoss's forward: its (V, C) weight-gradient and (N, C) input-gradient
    buffers, its input, and the one chunk of fp32 logits it reuses (under autocast also the chunk's
    low-precision logits, the weight's low-precision copy, the (V, C) buffer of a chunk's low-precision weight
    product and the fp32 conversion of the slice of it being added to the fp32 gradient). low_params (FSDP's bf16
    weight and input): no copy of the weight, and the input and its gradient in bf16; the weight gradient is still
    accumulated in fp32."""
    N = batch_size * (seq_len or cfg.block_size)
    n, V, C = min(N, LOSS_CHUNK_ROWS), cfg.vocab_size, cfg.n_embd
    if _bytes_per_element(dtype) == 4:
        return n * V * 4 + V * C * 4 + 2 * N * C * 4
    added = min(V, GRAD_W_SLICE_ROWS) * C * 4
    if low_params:
        return n * V * (4 + 2) + V * C * (4 + 2) + added + 2 * N * C * 2
    return n * V * (4 + 2) + V * C * (4 + 2 + 2) + added + 2 * N * C * 4 + n * C * 2


def estimate_memory(
    model_cfg,
    batch_size: int,
    dtype="float32",
    parallel: str = "ddp",
    world_size: int = 1,
    optimizer: str = "adamw",
    activation_checkpointing: bool | None = None,
    shard_size: int | None = None,
    seq_len: int | None = None,
    pipeline: tuple | None = None,
    tensor_parallel: int = 1,
) -> MemoryPlan:
    """Predicted peak memory per rank of one training step at micro-batch batch_size.

    dtype: the autocast dtype ('float32' = none); parameters, gradients and AdamW state stay fp32.
    parallel: 'ddp' (full copies; at world_size > 1 the gradients are views of DDP's all-reduce buckets, one
    copy: parallel.keeps_grads), 'fsdp' (sharded over
    world_size) or 'hsdp' (sharded over shard_size, default world_size); with tensor_parallel the data-parallel
    world is world_size / tensor_parallel and each rank holds 1/tensor_parallel of the blocks' split weights
    (param_stats' block_split) and of their activations, the rest whole. activation_checkpointing None:
    model_cfg's. The sum assumes gradients are resident during the forward (any accumulation step after
    the first), which makes it an upper bound for a step without accumulation. pipeline (stages, schedule,
    micro-batches per step): the plan of the heaviest stage (stage_plan), batch_size rows per micro-batch."""
    if pipeline is not None:
        kwargs = {"dtype": dtype, "activation_checkpointing": activation_checkpointing, "seq_len": seq_len}
        kwargs["tensor_parallel"] = tensor_parallel
        plans = [stage_plan(model_cfg, batch_size, stage, pipeline, kwargs) for stage in range(pipeline[0])]
        return max(plans, key=lambda plan: plan.total)
    for key, value in (("optimizer", optimizer), ("parallel", parallel)):
        if value not in CHOICES[key]:
            raise ValueError(f"estimate_memory: {key} {value!r}, expected one of {CHOICES[key]}")
    if batch_size < 1 or world_size < 1:
        raise ValueError(f"estimate_memory: batch_size={batch_size}, world_size={world_size}; expected >= 1")
    if activation_checkpointing is None:
        activation_checkpointing = model_cfg.activation_checkpointing
    stats, tp = param_stats(model_cfg), tensor_parallel
    block = stats["block"] - stats["block_split"] * (tp - 1) // tp  # a tensor-parallel rank's share of one
    n = stats["total"] - model_cfg.n_layer * (stats["block"] - block)
    if optimizer == "adamw":
        state = 2 * n * 4  # exp_avg, exp_avg_sq
    else:  # Muon: one momentum buffer for the blocks' 2-D matrices, AdamW's two for everything else
        hidden = model_cfg.n_layer * stats["block_matmul"]
        state = hidden * 4 + 2 * (n - hidden) * 4
    dp = world_size // tp
    shard = 1 if parallel == "ddp" else (shard_size or dp) if parallel == "hsdp" else dp
    fsdp = parallel != "ddp" or tp > 1 and dp > 1  # parallel.shard: FSDP, whose MixedPrecisionPolicy gathers
    low = fsdp and _bytes_per_element(dtype) < 4  # low-precision weights
    tokens = batch_size * (seq_len or model_cfg.block_size)
    saved, working = _activation_parts(model_cfg, tokens, dtype, activation_checkpointing, low, tp)
    at_loss = loss_bytes(model_cfg, batch_size, dtype, seq_len, low)
    gathered = 0
    if shard > 1:
        # FSDP's mixed precision gathers in the compute dtype. During the loss the root unit (embeddings, ln_f, head)
        # is gathered; at the backward's peak (dry run) also one block, the root's unsharded gradient (its
        # reduce-scatter comes last) and one block's fp32 gradient going into its reduce-scatter
        p_bytes = _bytes_per_element(dtype)
        root = n - model_cfg.n_layer * block
        at_loss += root * p_bytes
        gathered = (2 * root + block) * p_bytes + block * 4
    # the loss runs before the backward: logits counts only what the loss phase needs beyond the backward's peak
    # (its working set and gathered units), which is never live at the same time
    return MemoryPlan(
        params=-(-n * 4 // shard),
        grads=-(-n * 4 // shard),
        optimizer=-(-state // shard),
        activations=saved + working,
        logits=max(0, at_loss - working - gathered),
        batch_size=batch_size,
        optimizer_name="AdamW" if optimizer == "adamw" else "Muon+AdamW",
        gathered=gathered,
    )


def stage_plan(model_cfg, batch_size, stage, pipeline, kwargs):
    """The plan of pipeline stage `stage` of pipeline (stages, schedule, micro-batches per step), replicated by DDP:
    its blocks' parameters, gradients and AdamW state (the first stage's also the embeddings', the last's ln_f's and
    the head's); the saved activations of the micro-batches the schedule keeps in flight there (1F1B: stages - stage
    of them, GPipe: all) and one backward's working set; the chunked loss in the last stage only. kwargs'
    tensor_parallel (default 1): a rank of the stage holds its share of the blocks' split weights (param_stats'
    block_split) and of their activations, as estimate_memory counts them; the rest whole."""
    stages, schedule, pieces = pipeline
    blocks, tp = len(stage_blocks(model_cfg.n_layer, stages, stage)), kwargs.get("tensor_parallel", 1)
    stats, part = param_stats(model_cfg), replace(model_cfg, n_layer=blocks)
    block = stats["block"] - stats["block_split"] * (tp - 1) // tp  # a tensor-parallel rank's share of one
    head = 0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.n_embd  # refused tied anyway
    head += (2 if model_cfg.bias else 1) * model_cfg.n_embd  # ln_f
    embeddings = stats["total"] - model_cfg.n_layer * stats["block"] - head
    n = blocks * block + (embeddings if stage == 0 else 0) + (head if stage == stages - 1 else 0)
    ckpt = kwargs["activation_checkpointing"]
    ckpt = model_cfg.activation_checkpointing if ckpt is None else ckpt
    tokens = batch_size * (kwargs["seq_len"] or model_cfg.block_size)
    saved, working = _activation_parts(part, tokens, kwargs["dtype"], ckpt, False, tp)
    in_flight = pieces if schedule == "GPipe" else min(pieces, stages - stage)
    at_loss = loss_bytes(model_cfg, batch_size, kwargs["dtype"], kwargs["seq_len"]) if stage == stages - 1 else 0
    return MemoryPlan(
        params=n * 4,
        grads=n * 4,
        optimizer=2 * n * 4,
        activations=saved * in_flight + working,
        logits=max(0, at_loss - working),
        batch_size=batch_size,
    )


# ----------------------------------------------------------------------------- does it fit, and what would


def divisors(n: int) -> list[int]:
    """Divisors of n, largest first."""
    return [d for d in range(n, 0, -1) if n % d == 0]


def rows_per_rank(total_batch_size: int, block_size: int, world_size: int = 1) -> int:
    """Sequences each rank processes per optimizer step."""
    if total_batch_size % (block_size * world_size):
        raise ValueError(
            f"total_batch_size={total_batch_size} is not a multiple of block_size*world_size = "
            f"{block_size}*{world_size}"
        )
    return total_batch_size // (block_size * world_size)


def suggest_fits(model_cfg, batch_size: int, available: int, rows: int | None = None, **plan_kwargs) -> list[str]:
    """Settings that would fit in `available` bytes, each with its predicted total: the largest smaller
    micro-batch dividing `rows` (sequences per rank per step; default batch_size) with the accumulation
    that keeps total_batch_size, activation checkpointing, parallel='fsdp' at the same world size, and
    combinations of them when no single change is enough."""
    rows = rows or batch_size
    ckpt = plan_kwargs.pop("activation_checkpointing", None)
    ckpt = model_cfg.activation_checkpointing if ckpt is None else ckpt
    world = plan_kwargs.get("world_size", 1)
    fsdp_options = [False, True] if plan_kwargs.get("parallel", "ddp") == "ddp" and world > 1 else [False]

    def first_fit(ckpt_on, fsdp):
        kw = {**plan_kwargs, "parallel": "fsdp"} if fsdp else plan_kwargs
        for b in divisors(rows):
            if b <= batch_size:
                plan = estimate_memory(model_cfg, b, activation_checkpointing=ckpt_on, **kw)
                if plan.total <= available:
                    return b, plan
        return None, None

    by_changes = {}  # number of settings changed -> descriptions
    for ckpt_on in dict.fromkeys([ckpt, True]):
        for fsdp in fsdp_options:
            b, plan = first_fit(ckpt_on, fsdp)
            if b is None:
                continue
            what = [f"batch_size={b} with {rows // b} accumulation steps"] if b < batch_size else []
            what += ["activation_checkpointing=True"] if ckpt_on is True and ckpt is not True else []
            what += [f"parallel='fsdp' over {world} ranks"] if fsdp else []
            if what:
                by_changes.setdefault(len(what), []).append(f"{' + '.join(what)} ({gib(plan.total)} GiB)")
    return by_changes[min(by_changes)] if by_changes else []


def check_fits(
    model_cfg, batch_size: int, available: int, description: str = "", rows: int | None = None, **plan_kwargs
) -> str | None:
    """None if the plan at batch_size fits in `available` bytes, else a one-line refusal with the settings
    that would fit (see suggest_fits), computed from the plan before anything is allocated."""
    plan = estimate_memory(model_cfg, batch_size, **plan_kwargs)
    if plan.total <= available:
        return None
    where = f" ({description})" if description else ""
    head = f"estimated peak memory per rank {gib(plan.total)} GiB exceeds the {gib(available)} GiB available{where}"
    fits = suggest_fits(model_cfg, batch_size, available, rows, **plan_kwargs)
    if fits:
        return f"{head}; settings that fit: {'; '.join(fits)}"
    ckpt = {k: v for k, v in plan_kwargs.items() if k != "activation_checkpointing"}
    smallest = estimate_memory(model_cfg, 1, activation_checkpointing=True, **ckpt)
    return (
        f"{head}; nothing fits on one rank: even micro-batch 1 with activation_checkpointing=True needs "
        f"{gib(smallest.total)} GiB; use more ranks with parallel='fsdp' or a smaller model"
    )


CHECKPOINTING_ORDER = (False, "selective", True)  # least recomputation first


def choose_checkpointing(model_cfg, batch_size: int, available: int, **plan_kwargs) -> tuple[object, str]:
    """activation_checkpointing='auto': the least recomputation (none, every other block, every block) whose plan
    at batch_size fits in `available` bytes (what a plan may use: headroom.within_margin on a GPU); every block when
    none does (the memory check then names what would fit). Returns (the choice, a line saying why)."""
    tried = []
    for mode in CHECKPOINTING_ORDER:
        plan = estimate_memory(model_cfg, batch_size, activation_checkpointing=mode, **plan_kwargs)
        tried.append(f"{CHECKPOINTING_NAMES[mode]} {gib(plan.total)} GiB")
        if plan.total <= available:
            break
    return mode, (
        f"activation_checkpointing='auto': {CHECKPOINTING_NAMES[mode]} (plans at micro-batch {batch_size}: "
        f"{', '.join(tried)}; {gib(available)} GiB usable)"
    )


CHECKPOINTING_NAMES = {False: "none", "selective": "every other block", True: "every block"}


# ----------------------------------------------------------------------------- batch_size='auto'


def plan_micro_batch(
    model_cfg, rows: int, available: int, fraction: float = AUTO_FIT_FRACTION, description: str = "", **plan_kwargs
) -> tuple[int, str]:
    """CPU/MPS batch_size='auto': the largest divisor of rows (sequences per rank per step) whose plan fits
    in fraction * available. Returns (micro_batch, why); MemoryPlanError if not even 1 fits."""
    budget = int(available * fraction)
    for b in divisors(rows):
        plan = estimate_memory(model_cfg, b, **plan_kwargs)
        if plan.total <= budget:
            up = None if b == rows else next(d for d in reversed(divisors(rows)) if d > b)
            bigger = (
                f"; micro-batch {up} would need {gib(estimate_memory(model_cfg, up, **plan_kwargs).total)} GiB"
                if up
                else ""
            )
            return b, (
                f"micro-batch {b} x {rows // b} accumulation steps: its plan ({gib(plan.total)} GiB) fits in "
                f"{fraction:.0%} of {gib(available)} GiB{f' ({description})' if description else ''}{bigger}"
            )
    msg = check_fits(
        model_cfg, 1, budget, f"{fraction:.0%} of {description or gib(available) + ' GiB'}", rows, **plan_kwargs
    )
    raise MemoryPlanError(f"batch_size='auto': {msg}")


def smaller_micro_batch(rows: int, batch_size: int) -> int | None:
    """After an out-of-memory at batch_size: the largest divisor of rows at most half of it (None below 1)."""
    return next((d for d in divisors(rows) if d <= batch_size // 2), None)


def free_cached_memory(device) -> None:
    """What an out-of-memory left behind, back to the device: unreachable tensors, CUDA's cached blocks."""
    gc.collect()
    if device is not None and str(device).startswith("cuda"):
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- a run's micro-batch

PROBED_KINDS = ("cuda",)  # batch_size='auto' probes the real model on these devices; the others use the plan
# held free while probing under torchrun: NCCL allocates its communication buffers after the probe (a few hundred MB
# per communicator by default; DDP/FSDP may open several)
NCCL_RESERVE = GiB


# batch_size='auto' probes the eager bare model while the run trains compiled: held aside for what compile adds,
# this share of the plan's activations. Measured on Inductor's CPU backend at GPT-2 124M's shape, bf16 autocast: the
# compiled graph saves 332.2 MiB per 1024 tokens for the backward against eager's 330.7 (+0.5%, here rounded up to
# 1%), and peaks lower at one loss chunk (the loss is a custom op, so the compiled graph no longer keeps every chunk's
# (vocab x n_embd) weight-gradient product alive until the loss ends); if a compiled step still does not fit, the
# compile trial halves the micro-batch (one process: step.compile_works).
COMPILE_RESERVE_FRACTION = 0.01


def probes_device(env):
    """Whether batch_size='auto' probes (probe_batch_size) rather than plans: not for a sharded run, whose bare
    model is built on the CPU and would not fit one device whole."""
    return env.kind in PROBED_KINDS and not env.sharded


def plan_kwargs(cfg, env):
    """estimate_memory's arguments besides the model and the micro-batch."""
    pipeline = None
    if env.pipeline > 1:  # the plan's micro-batch is then a pipeline micro-batch's rows (micro_batch_rows)
        pipeline = (env.pipeline, cfg.pipeline_schedule, microbatches(cfg, env.dp_size)[0])
    return {
        "dtype": env.dtype,
        "parallel": env.parallel,
        "world_size": env.world_size,
        "shard_size": cfg.shard_size,
        "optimizer": cfg.optimizer,
        "pipeline": pipeline,
        "tensor_parallel": env.tensor_parallel,
    }


def micro_batch_rows(cfg, env):
    """The rows one forward runs at: batch_size, or a pipeline micro-batch's (layout.microbatches)."""
    return microbatches(cfg, env.dp_size)[1] if env.pipeline > 1 else cfg.batch_size


def resolve_batch_size(cfg, env, shape):
    """Before anything big is allocated: log the memory plan and the device's memory; refuse (ConfigError, one line
    naming settings that fit) a batch_size whose plan exceeds it; resolve activation_checkpointing='auto' and
    batch_size='auto' from the plan (the latter on devices that are not probed: probes_device()). shape: the GPTConfig
    the model will have (resume.Source.model; None for a Hugging Face directory, which has no plan before it is
    loaded). Returns cfg with them resolved, or batch_size still 'auto' (probe_batch_size)."""
    auto = cfg.batch_size == "auto"
    if auto:  # sequences per rank per optimizer step; total_batch_size is checked before anything is built
        try:
            rows = rows_per_rank(cfg.total_batch_size, cfg.block_size, env.dp_size)
        except ValueError as e:
            raise ConfigError(f"batch_size='auto': {e}") from None
    else:
        rows = cfg.batch_size * batch_layout(cfg, env.dp_size)[1]
    if shape is None:
        if auto and not probes_device(env):
            raise ConfigError(
                f"batch_size='auto' cannot plan init_from={cfg.init_from!r} before loading it; set batch_size"
            )
        if cfg.activation_checkpointing == "auto":
            log(
                f"activation_checkpointing='auto': every block (init_from={cfg.init_from!r} has no plan before it is "
                "loaded)",
                note=True,
            )
            cfg = replace(cfg, activation_checkpointing=True)
        return cfg
    available, what = device_memory(env)
    if cfg.activation_checkpointing == "auto":  # with batch_size='auto': the least that fits at micro-batch 1
        micro = 1 if auto else micro_batch_rows(cfg, env)
        mode, why = choose_checkpointing(shape, micro, available, **plan_kwargs(cfg, env))
        log(why)
        cfg, shape = replace(cfg, activation_checkpointing=mode), replace(shape, activation_checkpointing=mode)
    if auto and not probes_device(env):
        fraction = 1.0 if env.kind == "cuda" else AUTO_FIT_FRACTION  # a GPU's margin is already taken off
        try:
            b, why = plan_micro_batch(shape, rows, available, fraction, description=what, **plan_kwargs(cfg, env))
        except MemoryPlanError as e:
            raise ConfigError(str(e)) from None
        log(f"batch_size='auto': {why}")
        cfg = replace(cfg, batch_size=b)
    plan = estimate_memory(
        shape, 1 if cfg.batch_size == "auto" else micro_batch_rows(cfg, env), **plan_kwargs(cfg, env)
    )
    log(plan.line() + (" [micro-batch 1; batch_size='auto' probes the rest]" if cfg.batch_size == "auto" else ""))
    log(f"available memory: {what}")
    if cfg.memory_check and not auto and plan.total > available:
        msg = check_fits(shape, micro_batch_rows(cfg, env), available, what, rows, **plan_kwargs(cfg, env))
        raise ConfigError(f"{msg} (memory_check=False skips this check)")
    return cfg
