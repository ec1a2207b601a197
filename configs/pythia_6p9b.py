# Pythia-6.9B, the model of "Frugality meets Accuracy: Cost-efficient training of GPT NeoX and Pythia models
# with AWS Trainium" (AWS ML blog,
# https://aws.amazon.com/blogs/machine-learning/frugality-meets-accuracy-cost-efficient-training-of-gpt-neox-and-pythia-models-with-aws-trainium/):
# pre-trained for 10k steps of 256 sequences x 2048 tokens with the GPT-2 BPE tokenizer, bf16, comparing
# loss and gradient-norm curves across hardware. Here on FineWeb-Edu shards (the write-up used a small Wikipedia set).
# Model: Pythia 6.9B (Biderman et al. 2023, arXiv:2304.01373): 32 layers, 4096 wide, 32 heads, context
# 2048, rotary on 25% of each head, parallel residual, untied head, exact GELU, vocabulary 50432 as the
# released checkpoint; the shape comes from model.PRESETS. Optimizer as Pythia's 6.9B config
# (github.com/EleutherAI/pythia, models/6.9B/pythia-6.9b.yml): Adam betas (0.9, 0.95), lr 1.2e-4 cosine to
# 1.2e-5, warmup 1% of training, weight decay 0.1, gradient clipping 1.0.
# Layout as Pythia trained it (GPT-NeoX/Pythia article, 001): tensor parallel 8 within a node, each block's heads
# and MLP width over its 8 GPUs (plan 29.9 GiB per rank at micro-batch 4; python dryrun.py configs/pythia_6p9b.py
# --world_size=8), FSDP over the nodes' data-parallel ranks. The FSDP-only alternative, --tensor_parallel=1:
# 6.9B parameters + gradients + AdamW state (~110 GB in fp32) sharded over the 8 GPUs (plan 52.3 GiB, 56.4 GiB
# with the margin); docs/multi-gpu.md compares the two. activation_checkpointing 'auto': the plan chooses (none).
#   one node:   torchrun --standalone --nproc_per_node=8 train.py configs/pythia_6p9b.py
#   four nodes (the write-up's size), on each node:
#     torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
#         train.py configs/pythia_6p9b.py
data_dir = "data/fineweb-edu"
out_dir = "out/pythia_6p9b"

preset = "pythia-6.9b"
tensor_parallel = 8  # one node's GPUs split each block
parallel = "fsdp"  # over the data-parallel ranks (one per node): 2-D FSDP x TP
activation_checkpointing = "auto"  # the plan chooses (docs/memory.md): none at micro-batch 4 on 8 x 80 GiB

batch_size = 4  # sequences of 2048 per GPU per micro-step
total_batch_size = 524288  # 256 sequences x 2048, the write-up's global batch (8 GPUs: 8 accumulation steps)
max_steps = 10000  # the write-up's 10k pre-training iterations (~5.2B tokens)
learning_rate = 1.2e-4
min_lr = 1.2e-5
warmup_steps = 100  # 1% of training, as Pythia
lr_schedule = "cosine"
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
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
