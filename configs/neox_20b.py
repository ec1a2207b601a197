# GPT-NeoX-20B (Black et al. 2022, "GPT-NeoX-20B: An Open-Source Autoregressive Language Model",
# arXiv:2204.06745) with its published recipe, on FineWeb-Edu shards with the GPT-2 BPE tokenizer (the paper
# used the Pile and its own tokenizer). Model: 44 layers, 6144 wide, 64 heads, context 2048, rotary on 25% of
# each head, parallel residual, untied head, exact GELU, vocabulary 50432 as the released checkpoint; the shape
# comes from model.PRESETS. Recipe as the paper and its configs/20B.yml: ~3.15M tokens per step (1536
# sequences of 2048; the paper's 1538 does not split over 64 ranks), 150k steps, AdamW betas (0.9, 0.95),
# lr 0.97e-4 cosine to 10% after 1% warmup, weight decay 0.01, gradient clipping 1.0, bf16-class mixed precision.
# The paper's layout: tensor parallel 8 (within a node) x pipeline parallel 4 (stages across nodes), here with 2
# data-parallel replicas on 64 GPUs (the paper sharded the optimizer state with ZeRO-1; here each replica holds its
# rank's whole share: 24 GiB peak at stage 0), with activation checkpointing. The FSDP-only alternative: HSDP,
# parameters, gradients and AdamW state (16 bytes/param, 330 GB) sharded within each 8-GPU node (41 GB per GPU)
# and replicated across nodes: --parallel=hsdp --tensor_parallel=1 --pipeline_parallel=1 (docs/multi-gpu.md
# compares the two). Dry runs:
#   python dryrun.py configs/neox_20b.py --world_size=64
#   python dryrun.py configs/neox_20b.py --world_size=64 --parallel=hsdp --tensor_parallel=1 --pipeline_parallel=1
#   sbatch --nodes=8 scripts/slurm_train.sh configs/neox_20b.py     # 8 nodes x 8 GPUs
data_dir = "data/fineweb-edu"
out_dir = "out/neox_20b"

preset = "neox-20b"
tensor_parallel = 8  # each block's heads and MLP width over a node's 8 GPUs
pipeline_parallel = 4  # 11 blocks per stage, stages across nodes (1F1B)
parallel = "ddp"  # the 2 data-parallel replicas of each (stage, tensor) rank
activation_checkpointing = True

batch_size = 4  # sequences of 2048 per GPU per micro-step
total_batch_size = 3145728  # 1536 sequences x 2048 (~3.15M tokens); 64 GPUs x 4 x 2048: 6 accumulation steps
max_steps = 150000  # ~472B tokens, the paper's schedule
learning_rate = 0.97e-4
min_lr = 0.97e-5  # cosine to 10% of the peak
warmup_steps = 1500  # 1% of training
lr_schedule = "cosine"
weight_decay = 0.01
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_steps = 20
hellaswag_interval = 5000
sample_interval = 5000
sample_prompt = "Hello, I'm a language model,"
save_interval = 500  # a sharded checkpoint is ~330 GB with the optimizer state
keep_last = 2

dtype = "bfloat16"
compile = True
