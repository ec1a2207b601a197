# GPT-2 124M on 10B tokens of FineWeb-Edu (configs/gpt2_124m.py) trained with the modern recipe
# (configs/modern.py: Muon, QK-norm, ReLU^2, full rotary, untied head, zero-init projections, no biases, value
# embeddings, smear, per-group rates, WSD; no bigram table, as measured there;
# see its header for where each choice comes from). The same run as
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py configs/modern.py
# written out as one file (tests/test_modern.py checks the two stay equal). The learning rates are the small
# model's sweep winners, not tuned at this size; the token budget is GPT-2's, not shortened.
#   python prepare_data.py --dataset fineweb-edu
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_modern.py
data_dir = "data/fineweb-edu"
out_dir = "out/gpt2_124m_modern"

preset = "gpt2"  # 12 layers, 12 heads, 768 wide, 1024 context, vocab_size 50304

batch_size = 64
total_batch_size = 524288  # 2**19 tokens per step, as configs/gpt2_124m.py
max_steps = 19073  # 10e9 tokens

eval_interval = 250
eval_steps = 20
hellaswag_interval = 250
sample_interval = 1000
sample_prompt = "Hello, I'm a language model,"
save_interval = 2000
keep_last = 2
grad_clip = 1.0
dtype = "bfloat16"
compile = True

# the modern recipe (configs/modern.py)
optimizer = "muon"
muon_lr = 0.01
muon_momentum = 0.9
muon_weight_decay = 0.0
learning_rate = 0.006
embedding_lr = 0.05
head_lr = 0.003
min_lr = 0.0
beta1 = 0.7
beta2 = 0.99
weight_decay = 0.0
lr_schedule = "wsd"
warmup_steps = 0
wsd_decay_frac = 0.2
qk_norm = True
activation = "relu2"
rotary_pct = 1.0
tie_embeddings = False
zero_init_proj = True
bias = False
value_embeds = True
smear = True
bigram_embeds = 0
