"""Do all ranks see each other? One all-reduce over every process torchrun started, before a long job.

    torchrun --standalone --nproc_per_node=8 scripts/check_ranks.py
    srun torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
         --rdzv_id=check scripts/check_ranks.py

Every rank prints its host, rank and the sum of ones over all ranks, which must equal the world size. A hang
here (rather than in train.py) points at the network: rerun with NCCL_DEBUG=INFO.
"""

import argparse
import os
import socket
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)  # no options: --help, or an error for anything else
    if "LOCAL_RANK" not in os.environ:
        parser.error("run it under torchrun (no LOCAL_RANK in the environment), as the examples above")
    import torch  # after parsing: --help needs no torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    ones = torch.ones(1, device="cuda" if cuda else "cpu")
    dist.all_reduce(ones)
    rank, world = dist.get_rank(), dist.get_world_size()
    status = "ok" if int(ones.item()) == world else "WRONG"
    print(
        f"{socket.gethostname()}: rank {rank}/{world} (local {os.environ['LOCAL_RANK']}): all_reduce(1) = "
        f"{ones.item():.0f} {status}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
