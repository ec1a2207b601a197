# GPT-3 2.7B following the MosaicML GPT-3 recipe (MosaicML blog, "Mosaic LLMs (Part 1): Billion-Parameter
# GPT Training Made Easy", which names 2.7B and 6.7B as the sizes that need ZeRO-style sharding): the
# GPT-3 family shape with context 2048, cosine decay with 1% warmup, bf16. Learning rate and batch size
# are the GPT-3 paper's (Table 2.1) for this size; heads of 128 dims (20 heads), as MosaicML's presets.
# Sharded with FSDP over the ranks of a node (parameters, gradients and AdamW state: 16 bytes/param, 42 GB
# in all, 5.3 GB per GPU on 8). Micro-batch 4 x 2048 tokens per GPU; set activation_checkpointing = True
# if it runs out of memory (on GPUs under 80 GB).
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt3_2p7b.py --parallel=fsdp
#   sbatch --nodes=4 scripts/slurm_train.sh configs/gpt3_2p7b.py --parallel=hsdp   # 4 nodes x 8 GPUs
data_dir = "data/fineweb-edu"
out_dir = "out/gpt3_2p7b"

preset = "gpt3-2.7b"  # the model shape from model.PRESETS; vocab_size stays 50304 (50257 padded)
parallel = "fsdp"  # under torchrun; hsdp to shard within each node and replicate across nodes

batch_size = 4  # sequences of 2048 per GPU per micro-step
total_batch_size = 1048576  # 512 sequences x 2048 (1M tokens)
max_steps = 50577  # ~53B tokens = 20 per parameter (2.65B), the compute-optimal budget the article cites
warmup_steps = max_steps // 100  # 1% of training ("t_warmup: 0.01dur")
learning_rate = 1.6e-4
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
