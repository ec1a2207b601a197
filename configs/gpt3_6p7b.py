# GPT-3 6.7B following the MosaicML GPT-3 recipe (MosaicML blog, "Mosaic LLMs (Part 1): Billion-Parameter
# GPT Training Made Easy", which names 2.7B and 6.7B as the sizes that need ZeRO-style sharding): the
# GPT-3 family shape with context 2048, cosine decay with 1% warmup, bf16. Learning rate and batch size
# are the GPT-3 paper's (Table 2.1) for this size; 32 heads of 128 dims. Its parameters, gradients and
# AdamW state take 16 bytes/param, 107 GB, more than one GPU holds: FSDP shards them (13.3 GB per GPU on
# 8). Activation checkpointing is 'auto': the memory plan chooses the least recomputation that fits with its
# margin; on 8 x 80 GiB that is none (plan 47.5 GiB at micro-batch 4; 51.4 GiB with the margin), on 40 GiB
# GPUs every other block, on 24 GiB every block (python dryrun.py configs/gpt3_6p7b.py --world_size=8
# [--device_memory_gib=40] prints the choice beside the simulated step). Initialisation builds the whole fp32 model
# on each rank's host first: 26.6 GB of host memory per rank, 213 GB per 8-GPU node.
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt3_6p7b.py --parallel=fsdp
#   sbatch --nodes=8 scripts/slurm_train.sh configs/gpt3_6p7b.py --parallel=hsdp   # 8 nodes x 8 GPUs
data_dir = "data/fineweb-edu"
out_dir = "out/gpt3_6p7b"

preset = "gpt3-6.7b"  # the model shape from model.PRESETS; vocab_size stays 50304 (50257 padded)
parallel = "fsdp"  # under torchrun; hsdp to shard within each node and replicate across nodes
activation_checkpointing = "auto"  # the plan chooses (docs/memory.md): none at micro-batch 4 on 8 x 80 GiB

batch_size = 4  # sequences of 2048 per GPU per micro-step
total_batch_size = 2097152  # 1024 sequences x 2048 (2M tokens)
max_steps = 63502  # ~133B tokens = 20 per parameter (6.66B), the compute-optimal budget the article cites
warmup_steps = max_steps // 100  # 1% of training ("t_warmup: 0.01dur")
learning_rate = 1.2e-4
min_lr = 0.0  # Composer's cosine_decay_with_warmup decays to alpha_f = 0 by default
lr_schedule = "cosine"
# Composer's decoupled AdamW weight decay of 1e-5 is not multiplied by the learning rate;
# torch's AdamW multiplies it, so the same decay is 1e-5 / learning_rate here.
weight_decay = 1e-5 / learning_rate
grad_clip = 1.0

eval_interval = 500
eval_steps = 20
hellaswag_interval = 1000
sample_interval = 2000
sample_prompt = "Hello, I'm a language model,"
save_interval = 1000
keep_last = 2

dtype = "bfloat16"
compile = True
