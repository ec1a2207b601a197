# GPT-2 XL (1.5B) on 10B tokens of FineWeb-Edu, as trained in the GPT-2 scaling write-up that goes
# from a laptop to 8xH100 (section 12:
# micro-batch 16 x 1024 per H100, ~1M tokens per step, so 8 accumulation steps on one 8-GPU node,
# ~9500 steps). The article gives no optimizer settings; these follow llm.c's GPT-2 1.5B run
# (max lr 6e-4 decayed to 10%, 700 warmup steps, weight decay 0.1, grad clip 1.0).
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_1558m.py
data_dir = "data/fineweb-edu"
out_dir = "out/gpt2_1558m"

# GPT-2 XL: 48 layers, 25 heads of 64, 1600 wide
preset = "gpt2-xl"  # the model shape from model.PRESETS; vocab_size stays 50304 (50257 padded)

batch_size = 16  # 16 x 1024 tokens per GPU per micro-step
total_batch_size = 1048576  # 2**20 tokens per step: 8 accumulation steps on 8 GPUs
max_steps = 9537  # 10e9 tokens / 1048576 tokens per step
learning_rate = 6e-4
min_lr = 6e-5
warmup_steps = 700
lr_schedule = "cosine"
weight_decay = 0.1
grad_clip = 1.0

eval_interval = 250
eval_steps = 20
hellaswag_interval = 500
sample_interval = 1000
sample_prompt = "Hello, I'm a language model,"
save_interval = 500  # a checkpoint is ~18 GB with the optimizer state; each is an hour of 8 GPUs
keep_last = 2

dtype = "bfloat16"
compile = True
