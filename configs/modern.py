# The modern recipe: recipe knobs and learning rates only (no model size, batch or step count), so it applies
# to any run; files apply in order and --key=value wins over both:
#   python train.py configs/modern.py --data_dir=data/shakespeare --n_layer=4 --n_embd=256 --max_steps=300
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py configs/modern.py
# Where each choice comes from:
# - Muon for the blocks' 2-D weight matrices, AdamW for embeddings, head, biases and norms: Keller Jordan,
#   "Muon: An optimizer for hidden layers in neural networks" (2024), https://kellerjordan.github.io/posts/muon/
#   (torch.optim.Muon; Nesterov momentum 0.95 and lr 0.02 are its defaults there and nanochat's matrix_lr).
# - QK-norm, ReLU^2, rotary positions on every head dim, an untied output head, zero-initialised output
#   projections, no biases: the modded-nanogpt speedrun (Keller Jordan et al., "NanoGPT speedrun",
#   https://github.com/KellerJordan/modded-nanogpt) and Andrej Karpathy's nanochat
#   (https://github.com/karpathy/nanochat), whose gpt.py lists the same features. ReLU^2 is from So et al.,
#   "Primer: Searching for Efficient Transformers for Language Modeling" (2021, arXiv:2109.08668); rotary from
#   Su et al., "RoFormer" (2021, arXiv:2104.09864).
# - Warmup-stable-decay: constant rate, then a linear decay to zero over the last part of the run (nanochat:
#   no warmup, the last 20% decayed to 0; modded-nanogpt: a linear cooldown); AdamW betas (0.8, 0.95) and no
#   weight decay on the AdamW tensors, as both.
# - The rates: the best of a 3-point sweep (x0.5, x1, x2 of both) on Tiny Shakespeare, 4 layers x 256 wide,
#   block 128, batch 16, 300 steps (python -m bench.recipes; the README's "Modern recipe" section). Rates are
#   size dependent: re-sweep muon_lr and learning_rate for much larger models.
optimizer = "muon"
muon_lr = 0.02  # Muon: the blocks' attention and MLP matrices
muon_momentum = 0.95
muon_weight_decay = 0.0
learning_rate = 0.006  # AdamW: embeddings, output head, norms
min_lr = 0.0
beta1 = 0.8
beta2 = 0.95
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
