# The README demo: a small GPT on Tiny Shakespeare with 2 CPU cores, ~300K tokens (one epoch).
#   python prepare_data.py --dataset shakespeare      # -> data/shakespeare (~300K train tokens)
#   python train.py configs/shakespeare_cpu.py
# With the GPT-2 tokenizer the 50304 x n_embd output layer is most of the compute of a model this
# small, so the model stays narrow. Measured: val loss 10.83 -> 5.64 in 300 steps; samples are
# Shakespeare-shaped ("ROMEO:\nNor for myself both is they kill us."). dtype and compile stay 'auto':
# on 2 cores with AVX512-BF16 that is bf16 + compile, ~7,800 tokens/s (eager bf16: ~5,300); on an AVX2
# CPU it is fp32 eager (~1,255 tokens/s), where compile measured no faster.
data_dir = "data/shakespeare"
out_dir = "out/shakespeare"

n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0

batch_size = 8
total_batch_size = 1024  # tokens per step: 8 sequences x 128 tokens, no accumulation
max_steps = 300
learning_rate = 2e-3  # a model this small tolerates (and needs) a large learning rate
min_lr = 2e-4
warmup_steps = 20
weight_decay = 0.1

eval_interval = 50
eval_steps = 8
sample_interval = 100  # from <|endoftext|>: the README reuses this config for your own data
sample_tokens = 48
log_interval = 10
save_interval = 100
keep_last = 2

hellaswag_interval = 0  # HellaSwag is meaningless for a model this size
