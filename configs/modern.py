# The modern recipe: recipe knobs and learning rates only (no model size, batch or step count), so it applies
# to any run; files apply in order and --key=value wins over both:
#   python train.py configs/modern.py --data_dir=data/shakespeare --n_layer=4 --n_embd=256 --max_steps=300
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m.py configs/modern.py
# Where each choice comes from:
# - Muon for the blocks' 2-D weight matrices, AdamW for embeddings, head, biases and norms: Keller Jordan,
#   "Muon: An optimizer for hidden layers in neural networks" (2024), https://kellerjordan.github.io/posts/muon/
#   (torch.optim.Muon, Nesterov momentum; 0.9 here, the write-up's 0.95 measured slower at this scale).
# - QK-norm, ReLU^2, rotary positions on every head dim, an untied output head, zero-initialised output
#   projections, no biases: the modded-nanogpt speedrun (Keller Jordan et al., "NanoGPT speedrun",
#   https://github.com/KellerJordan/modded-nanogpt) and Andrej Karpathy's nanochat
#   (https://github.com/karpathy/nanochat), whose gpt.py lists the same features. ReLU^2 is from So et al.,
#   "Primer: Searching for Efficient Transformers for Language Modeling" (2021, arXiv:2109.08668); rotary from
#   Su et al., "RoFormer" (2021, arXiv:2104.09864).
# - Value embeddings (a second token table added to the attention values; nanochat's, where each layer has its
#   own, here one table shared by all layers with a gate per head) and the smear (each token's embedding gets a
#   gated share of the previous token's; modded-nanogpt and nanochat).
# - No bigram table (modded-nanogpt's bigram hash embedding: bigram_embeds rows of hashed (previous, current) token
#   pairs added before every block). Measured with compare.py on the bench model, Tiny Shakespeare, 3 seeds: 100,000
#   rows were 0.062 lower in val loss at 45 steps (p 0.03) but 0.33 higher at 180 (p 0.001): a table of 25.6M
#   parameters (the blocks have 3.2M) learns a small corpus's pairs by heart (docs/experiments.md). Turn it on with
#   --bigram_embeds=100000 where the data is large enough for that not to happen, and compare.
# - Per-group AdamW rates, higher for the embeddings and lower for the untied head than for the rest, as both
#   anchors set them (nanochat: embedding_lr, unembedding_lr; modded-nanogpt: per-parameter-group Adam rates).
# - Warmup-stable-decay: constant rate, then a linear decay to zero over the last part of the run (nanochat:
#   no warmup, the last 20% decayed to 0; modded-nanogpt: a linear cooldown); no weight decay on the AdamW
#   tensors, as both; AdamW betas (0.7, 0.99) where both use (0.8, 0.95), measured here.
# - The rates and what is switched on: measured on Tiny Shakespeare, 4 layers x 256 wide, block 128, batch 16,
#   300 steps, 3 seeds (python -m bench.recipes; docs/modern-recipe.md has the ablations and what was measured
#   and left off). Rates are size dependent: re-sweep them for much larger models.
optimizer = "muon"
muon_lr = 0.01  # Muon: the blocks' attention and MLP matrices
muon_momentum = 0.9
muon_weight_decay = 0.0
learning_rate = 0.006  # AdamW: norms and the learned gates and weights
embedding_lr = 0.05  # AdamW: the token and value embeddings
head_lr = 0.003  # AdamW: the untied output head
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
