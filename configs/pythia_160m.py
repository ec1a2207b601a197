# Pythia-160M on 10B tokens of FineWeb-Edu with the GPT-2 BPE tokenizer, as "Frugality meets Accuracy:
# Cost-efficient training of GPT NeoX and Pythia models with AWS Trainium" (AWS ML blog,
# https://aws.amazon.com/blogs/machine-learning/frugality-meets-accuracy-cost-efficient-training-of-gpt-neox-and-pythia-models-with-aws-trainium/)
# trained these models; the Pythia counterpart of configs/gpt2_124m.py.
# Model: the Pythia suite's 160M (Biderman et al. 2023, "Pythia: A Suite for Analyzing Large Language Models
# Across Training and Scaling", arXiv:2304.01373): 12 layers, 768 wide, 12 heads, context 2048, rotary on 25%
# of each head, parallel residual, untied output head, exact GELU; the shape comes from model.PRESETS.
# Optimizer: Pythia's own 160M config (github.com/EleutherAI/pythia, models/160M/pythia-160m.yml): Adam
# betas (0.9, 0.95), lr 6e-4 cosine-decayed to 6e-5 after a warmup of 1% of training, weight decay 0.1,
# gradient clipping 1.0. Pythia used 2M-token batches for 300B tokens; on a 10B-token budget this keeps
# gpt2_124m's 2**19-token batch, which is also the write-up's (256 sequences of 2048).
#   python prepare_data.py --dataset fineweb-edu      # -> data/fineweb-edu
#   torchrun --standalone --nproc_per_node=8 train.py configs/pythia_160m.py
data_dir = "data/fineweb-edu"
out_dir = "out/pythia_160m"

preset = "pythia-160m"

batch_size = 32  # micro-batch 32 x 2048 tokens per GPU (65K tokens, as gpt2_124m's 64 x 1024)
total_batch_size = 524288  # 256 sequences x 2048; 8 GPUs x 32 x 2048: no accumulation
max_steps = 19073  # 10e9 tokens / 524288 tokens per step
learning_rate = 6e-4
min_lr = 6e-5  # cosine to 10% of the peak
warmup_steps = 190  # 1% of training, as Pythia
lr_schedule = "cosine"
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
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
