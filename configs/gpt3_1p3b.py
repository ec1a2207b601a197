# GPT-3 1.3B following the MosaicML GPT-3 recipe (MosaicML blog, "Mosaic LLMs (Part 1):
# Billion-Parameter GPT Training Made Easy"): the GPT-3 family shape
# with context 2048, cosine decay with 1% warmup, bf16, plain data parallelism. Learning rate and
# batch size are the GPT-3 paper's (Table 2.1) for this size. Heads of 128 dims, as MosaicML's model
# presets. Micro-batch 4 x 2048 = 8192 tokens, the device micro-batch the article reports; the
# article needed activation checkpointing on A100-40GB, an 80 GB GPU does not (set
# activation_checkpointing = True on smaller ones).
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt3_1p3b.py
data_dir = "data/fineweb-edu"
out_dir = "out/gpt3_1p3b"

preset = "gpt3-1.3b"  # the model shape from model.PRESETS; vocab_size stays 50304 (50257 padded)

batch_size = 4  # sequences of 2048 per GPU per micro-step
total_batch_size = 1048576  # 512 sequences x 2048 (1M tokens)
max_steps = 24796  # ~26B tokens = 20 per parameter, the compute-optimal budget the article cites
warmup_steps = max_steps // 100  # 1% of training ("t_warmup: 0.01dur")
learning_rate = 2e-4
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
