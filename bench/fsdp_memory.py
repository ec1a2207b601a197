"""Per-rank training memory of parallel='ddp' against 'fsdp' at world size 2: parameters, gradients and AdamW state.

    python -m bench.fsdp_memory                          # 8L/8H/512d, vocab 50304: ~51M params, 2 CPU ranks (gloo)
    python -m bench.fsdp_memory --n_layer=12 --n_embd=768 --n_head=12     # GPT-2 124M (~4 GB of host memory)

Launches `torchrun --nproc_per_node=2` once per mode. Each rank builds the model as train.py does
(setup, build_model, parallelize, build_optimizer), takes one training step (forward, backward, clip, AdamW
step) and, before zero_grad, counts the bytes of the tensors it holds: every distinct storage behind its
parameters (FSDP: its padded shards), their gradients and the optimizer state. DDP holds all of it on every
rank (16 bytes/param in fp32); FSDP 1/world_size of it. Peak RSS is reported too, but it is not the same
measure: it adds the Python/torch runtime, the whole fp32 model every rank initialises before sharding, and
freed pages the tuned CPU allocator keeps (devices.tune_cpu_allocator).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"n_layer": 8, "n_head": 8, "n_embd": 512, "block_size": 256, "batch_size": 2}


def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (views of one buffer are counted once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def worker(model_keys, out):
    """One rank: a training step as train.py takes it (the same parallelize()), then the bytes this rank holds."""
    import torch
    import torch.distributed as dist

    from gpt2train.config import make_config, model_config
    from gpt2train.layout import Env, mesh_shape
    from gpt2train.optim import adamw
    from gpt2train.parallel import parallelize
    from gpt2train.step import clip_gradients
    from model import GPT

    parallel = os.environ["BENCH_PARALLEL"]
    cfg = make_config(
        {**model_keys, "device": "cpu", "dtype": "float32", "compile": False, "parallel": parallel, "grad_clip": 1.0}
    )
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = mesh_shape(parallel, None, world, world) if parallel != "ddp" else ()
    env = Env(rank, rank, world, True, "cpu", "float32", parallel, mesh)
    torch.manual_seed(cfg.seed)
    raw = GPT(model_config(cfg))
    model = parallelize(raw, cfg, env)
    optimizer = adamw(raw.parameters(), cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2))  # after sharding
    x = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size))
    model(x, x, return_logits=False)[1].backward()
    clip_gradients(raw, cfg.grad_clip)
    optimizer.step()
    params = list(raw.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    result = {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer": storage_bytes(state),
        "num_params": raw.num_params(),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    with open(f"{out}.{env.rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def cpu_name():
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model name")), "?")
    return f"{name}, {os.cpu_count()} cores, avx512_bf16: {'avx512_bf16' in info}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, default in MODEL.items():
        parser.add_argument(f"--{key}", type=int, default=default)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: this process is a torchrun rank
    args = parser.parse_args(argv)
    model_keys = {k: getattr(args, k) for k in MODEL}
    if args.worker:
        return worker(model_keys, args.worker)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("ddp", "fsdp"):
            out = Path(tmp) / mode
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "bench.fsdp_memory",
                f"--worker={out}",
                *(f"--{k}={v}" for k, v in model_keys.items()),
            ]
            env = {**os.environ, "BENCH_PARALLEL": mode, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{mode} run failed:\n{done.stderr[-3000:]}")
            results[mode] = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]

    mib = lambda b: b / 2**20  # noqa: E731
    n = results["ddp"][0]["num_params"]
    print(f"{cpu_name()} | 2 ranks (gloo), fp32 | {n / 1e6:.1f}M parameters | {model_keys}")
    print(
        f"{'mode':<5} {'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'AdamW MiB':>10} {'total MiB':>10} "
        f"{'bytes/param':>11} {'peak RSS MiB':>13}"
    )
    totals = {}
    for mode, ranks in results.items():
        for rank, r in enumerate(ranks):
            total = r["params"] + r["grads"] + r["optimizer"]
            totals.setdefault(mode, []).append(total)
            print(
                f"{mode:<5} {rank:>4} {mib(r['params']):>11.1f} {mib(r['grads']):>10.1f} "
                f"{mib(r['optimizer']):>10.1f} {mib(total):>10.1f} {total / n:>11.2f} {mib(r['peak_rss']):>13.0f}"
            )
    ratio = max(totals["fsdp"]) / max(totals["ddp"])
    rss = max(r["peak_rss"] for r in results["fsdp"]) / max(r["peak_rss"] for r in results["ddp"])
    print(f"fsdp / ddp per rank: params+grads+AdamW {ratio:.3f}, peak RSS {rss:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
