"""Host memory of a sharded run's start: each rank's peak RSS through train.py's setup, model build, sharding and
initialisation (--max_steps=0), against the whole fp32 model's bytes; and whether the ranks' initial weights are
bit-identical to one process's.

    python -m bench.meta_init                         # pythia-1b, 2 FSDP ranks (gloo) vs 1 process
    python -m bench.meta_init --preset=gpt2 --nproc=4

Each run is train.py itself (run as a script by a wrapper that keeps the model parallelize() got, to hash its
weights after): one plain process, then torchrun with --nproc FSDP ranks. Each rank reports its peak RSS
(ru_maxrss) when main() returns, and a sha256 of each parameter's slice it holds (the one process: of every
rank's slice of it). The done-criterion of issue 24: every rank below 0.75x the whole fp32 model, and every
slice's hash equal.
"""

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 0.75  # peak RSS per rank / the whole fp32 model's bytes


def worker(out, nproc, argv):
    """One rank (or the one process): train.py as a script (runpy, as `python train.py` runs it; the library's
    parallelize() wrapped to keep the model it gets), then its peak RSS and the hashes of the slices it holds."""
    import runpy

    from gpt2train import meta_init, parallel

    kept = []
    real = parallel.parallelize
    parallel.parallelize = lambda model, *a, **k: (kept.append(model), real(model, *a, **k))[1]
    sys.argv = [str(ROOT / "train.py"), *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        assert not e.code, f"train.py exited with {e.code}"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = int(os.environ.get("RANK", 0))
    hashes = {}
    for name, p in kept[0].named_parameters():
        if hasattr(p, "to_local"):  # one rank's shard
            hashes[f"{name}[{rank}]"] = sha(p.to_local())
        else:  # one process: every rank's slice, for the comparison
            hashes.update({f"{name}[{r}]": sha(meta_init.local_slice(p.detach(), nproc, r)) for r in range(nproc)})
    n = sum(p.numel() for p in kept[0].parameters()) if not hasattr(kept[0].lm_head.weight, "to_local") else None
    Path(f"{out}.{rank}").write_text(json.dumps({"peak_rss": peak, "hashes": hashes, "params": n}))


def sha(t):
    return hashlib.sha256(t.detach().contiguous().cpu().view(-1).view(dtype=t.dtype).numpy().tobytes()).hexdigest()


def run(tmp, name, nproc, args):
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if name != "one" else []
    out = Path(tmp) / name
    cmd = [sys.executable, *launcher, "-m", "bench.meta_init", *args, f"--out_dir={Path(tmp) / ('out_' + name)}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "BENCH_WORKER": f"{out},{nproc}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(1 if name == "one" else nproc)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="pythia-1b")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--parallel", default="fsdp", choices=["fsdp", "hsdp"])
    if "BENCH_WORKER" in os.environ:  # a rank launched by run(): the rest of the command line is train.py's
        out, nproc = os.environ["BENCH_WORKER"].split(",")
        return worker(out, int(nproc), sys.argv[1:] if argv is None else argv)
    opts = p.parse_args(argv)
    import numpy as np

    from bench import machine_line
    from gpt2train.shards import write_shard

    with tempfile.TemporaryDirectory(prefix="meta_init_") as tmp:
        rng = np.random.default_rng(0)
        for split in ("train", "val"):
            write_shard(Path(tmp) / f"random_{split}_000000.bin", rng.integers(0, 50257, 100_000))
        args = [
            f"--preset={opts.preset}",
            f"--data_dir={tmp}",
            "--max_steps=0",
            "--batch_size=1",
            "--device=cpu",
            "--dtype=float32",
            "--compile=False",
            "--eval_interval=0",
            "--hellaswag_interval=0",
            "--sample_interval=0",
            "--log_interval=0",
            "--seed=1337",
            "--memory_check=False",
        ]
        one = run(tmp, "one", opts.nproc, args)[0]
        rows = [("1 process", one)]
        sharded = run(tmp, "sharded", opts.nproc, [*args, f"--parallel={opts.parallel}"])
        rows += [(f"{opts.parallel} rank {r} (meta init)", info) for r, info in enumerate(sharded)]
    model_bytes = one["params"] * 4
    print(
        f"bench.meta_init: {opts.preset}, {one['params'] / 1e6:.0f}M parameters = {model_bytes / 2**30:.2f} GiB "
        f"fp32; {opts.nproc} ranks; {machine_line('cpu')}\n"
    )
    print(f"{'run':<34} {'peak RSS':>10} {'x model':>8}")
    for label, info in rows:
        print(f"{label:<34} {info['peak_rss'] / 2**30:>8.2f} GiB {info['peak_rss'] / model_bytes:>7.2f}x")
    theirs = {k: v for info in sharded for k, v in info["hashes"].items()}
    same = theirs == one["hashes"]
    fits = all(info["peak_rss"] < LIMIT * model_bytes for info in sharded)
    print(
        f"\ninitial weights equal to the 1-process run's: {'yes' if same else 'NO'} ({len(theirs)} slices); "
        f"every meta-init rank below {LIMIT}x the model: {'yes' if fits else 'NO'}"
    )
    return 0 if same and fits else 1


if __name__ == "__main__":
    sys.exit(main())
