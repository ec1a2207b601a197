# GPT-3 350M following the MosaicML GPT-3 recipe (MosaicML blog, "Mosaic LLMs (Part 1):
# Billion-Parameter GPT Training Made Easy"): the GPT-3 family shape
# with context 2048, cosine decay with 1% warmup, bf16, plain data parallelism. Learning rate and
# batch size are the GPT-3 paper's (Table 2.1) for this size. This is the article's own YAML
# example.
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt3_350m.py
data_dir = "data/fineweb-edu"
out_dir = "out/gpt3_350m"

preset = "gpt3-350m"  # the model shape from model.PRESETS; vocab_size stays 50304 (50257 padded)

batch_size = 8  # sequences of 2048 per GPU per micro-step
total_batch_size = 524288  # the article's train_batch_size: 256 x 2048
max_steps = 20000  # the article's max_duration: 20000ba (~10.5B tokens)
warmup_steps = max_steps // 100  # 1% of training ("t_warmup: 0.01dur")
learning_rate = 3e-4
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
