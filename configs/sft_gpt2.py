# Supervised fine-tuning of a pretrained GPT-2 (124M) on chat / instruction data (docs/sft.md):
#   python prepare_data.py --input sft.jsonl --format sft --out_dir data/sft   # tokens + loss masks, any block_size
#   python train.py configs/sft_gpt2.py
#   python sample.py --ckpt out/sft --chat
# Only the assistant tokens are trained (the mask shards); the logged train_loss is the mean over them and
# trained_tokens counts them. The architecture (block_size included) comes from the pretrained weights; the
# loader builds rows of whole conversations for it (1024). init_from='gpt2' downloads openai-community/gpt2
# (548 MB) from the Hugging Face hub on first use; offline, init_from may be a local Hugging Face directory instead.
init_from = "gpt2"
data_dir = "data/sft"
out_dir = "out/sft"

dropout = 0.0
batch_size = 8
total_batch_size = 64 * 1024  # 64 rows of whole conversations per step (8 GPUs x 8, or accumulation)
max_steps = 1000  # a few epochs of a ~10k-conversation set; watch val_loss for overfitting
learning_rate = 3e-5  # fine-tuning: ~20x below pretraining's peak
min_lr = 0.0
warmup_steps = 50
weight_decay = 0.0

eval_interval = 100
eval_steps = 20
save_interval = 200
keep_last = 2
sample_interval = 0  # the preview prompt is plain text, not a conversation: use sample.py --chat
hellaswag_interval = 0
