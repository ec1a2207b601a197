#!/bin/bash
# Multi-node training under SLURM: one torchrun per node (srun starts them), rendezvous over c10d at the
# job's first node; each torchrun starts one train.py process per GPU.
#   sbatch scripts/slurm_train.sh configs/gpt3_2p7b.py                     # the nodes/GPUs of the #SBATCH lines
#   sbatch --nodes=8 scripts/slurm_train.sh configs/gpt3_6p7b.py --parallel=hsdp --max_steps=1000
#   sbatch scripts/slurm_train.sh configs/gpt2_1558m.py --init_from=resume   # continue a stopped run
# Arguments: the config file, then train.py's --key=value overrides. Run from the repository (sbatch starts
# the job in the directory it was submitted from); a .venv there is used if present. out_dir must be on a
# filesystem every node sees: sharded checkpoints are written by all ranks into one directory.
# Some clusters spell the GPU request --gres=gpu:8 instead of --gpus-per-node=8.
#SBATCH --job-name=gpt2-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: sbatch scripts/slurm_train.sh CONFIG [--key=value ...]" >&2
    exit 2
fi
cd "${SLURM_SUBMIT_DIR:-.}"
if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi

NNODES=${SLURM_NNODES:-1}
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# When ranks hang at start or in the first all-reduce (README, "Multi-GPU and multi-node"):
# export NCCL_DEBUG=INFO             # which interfaces and transports NCCL picked, per rank
# export NCCL_SOCKET_IFNAME=ib0      # the interface the nodes reach each other on (see `ip addr`)
# export NCCL_IB_DISABLE=1           # no InfiniBand: fall back to TCP sockets
echo "$NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous at $MASTER_ADDR:$MASTER_PORT: train.py $*"

srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$NNODES" --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
    train.py "$@"
