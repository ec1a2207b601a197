# GPT-2 124M on 10B tokens of FineWeb-Edu: the recipe of build-nanogpt / llm.c, as reproduced in
# the GPT-2 scaling write-up that goes from a laptop to 8xH100 (one 8xH100 node: ~3M tokens/s, ~1 hour).
#   python prepare_data.py --dataset fineweb-edu      # -> data/fineweb-edu
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py
data_dir = "data/fineweb-edu"
out_dir = "out/gpt2_124m"

# GPT-2 small: 12 layers, 12 heads, 768 wide, 1024 context, vocabulary padded to 50304
preset = "gpt2"  # the model shape from model.PRESETS; vocab_size stays 50304 (50257 padded)

batch_size = 64  # micro-batch 64 x 1024 tokens per GPU (fits an 80 GB GPU)
total_batch_size = 524288  # 2**19 (~0.5M, GPT-3 small); 8 GPUs x 64 x 1024: no accumulation
max_steps = 19073  # 10e9 tokens / 524288 tokens per step
learning_rate = 6e-4
min_lr = 6e-5  # cosine to 10% of the peak
warmup_steps = 715  # 375M tokens, as GPT-3
lr_schedule = "cosine"
weight_decay = 0.1
grad_clip = 1.0

eval_interval = 250
eval_steps = 20
hellaswag_interval = 250
sample_interval = 1000
sample_prompt = "Hello, I'm a language model,"
save_interval = 2000
keep_last = 2

dtype = "bfloat16"
compile = True
