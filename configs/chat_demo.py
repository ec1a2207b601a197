# The chat demo (docs/sft.md#the-chat-demo): fine-tune the `make demo` model (out/shakespeare) on a
# generated instruction task it can learn in a few minutes on 2 CPU cores, sorting 4 letters
# ("sort: k c f a" -> " a c f k"), with the loss on the answers only (prepare_data.py --format sft).
#   python -m bench.chat_demo              # writes the task, prepares it, runs this config, scores held-out prompts
#   python sample.py --ckpt out/chat_demo --chat
# The architecture, block_size 128 included, comes from the checkpoint: each row of 128 tokens packs
# 8 conversations of 15 tokens, so a step of 8 rows trains on 64 answers.
init_from = "out/shakespeare"
data_dir = "data/sort_chat"
out_dir = "out/chat_demo"

dropout = 0.0
batch_size = 8
total_batch_size = 1024  # 8 rows x 128 tokens
max_steps = 600  # 200 steps reached 23.5% held-out exact match, 600 steps 100% (docs/sft.md)
learning_rate = 2e-3  # the demo's pretraining peak: the task is new to the model, not a nudge of what it knows
min_lr = 2e-4
warmup_steps = 20
weight_decay = 0.0
compile = False  # a run this short spends longer compiling than it saves

eval_interval = 50
eval_steps = 4
log_interval = 20
save_interval = 600
keep_last = 1
sample_interval = 0  # the preview prompt is plain text, not a conversation: sample.py --chat
hellaswag_interval = 0
