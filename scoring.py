"""The one batched log-likelihood scorer behind hellaswag.py and evaluate.py.

A request is (context tokens, continuation tokens); its score is the summed log-probability of the
continuation's tokens given everything before them, as the lm-evaluation-harness computes it: a row longer
than the model's context keeps its last block_size + 1 tokens and the model reads all but the last.

Batched: the rows of many requests share one forward pass, right-padded to the batch's longest row (causal
attention: padding never reaches a real position, so each score is the one of the row alone). Requests whose
model input is the same (MMLU's four one-letter answers after one prompt) share one row. Only the scored
positions go through lm_head, and the softmax runs over the tokenizer's n_vocab ids (a padded vocabulary's
unused rows, which an export drops, take no probability). The model is the bare GPT, run eagerly (train.py
passes its gathered one): the eval shapes change every batch and would recompile a compiled one.
"""

import torch
import torch.nn.functional as F

from console import progress_bar
from devices import autocast

PAD_MULTIPLE = 8  # rows are padded to a multiple of this length (aligned shapes for matmul kernels)


def _crop(row, row_mask, block_size):
    """The harness's window: the last block_size + 1 tokens, the model reading all but the last."""
    return row[-(block_size + 1) :], row_mask[-(block_size + 1) :]


@torch.no_grad()
def score_rows(model, rows, masks, device, block_size, dtype=None, n_vocab=None):
    """Summed and mean cross-entropy over the masked (continuation) tokens of each row, in one forward.

    model: a bare GPT. rows, masks: lists of R token lists / 0-1 lists (1 on the scored tokens). Rows whose
    inputs (all tokens but the last) are equal share one row of the forward. Returns two float32 CPU tensors (R,).
    """
    rows, masks = zip(*(_crop(r, m, block_size) for r, m in zip(rows, masks)))
    unique = {}  # model input -> its row in the forward
    for row in rows:
        unique.setdefault(tuple(row[:-1]), len(unique))
    U = len(unique)
    T = max(len(inp) for inp in unique)
    T = min(-(-T // PAD_MULTIPLE) * PAD_MULTIPLE, block_size)
    idx = torch.zeros((U, T), dtype=torch.long)  # right padding with token 0; causal attention ignores it
    for inp, u in unique.items():
        idx[u, : len(inp)] = torch.tensor(inp, dtype=torch.long)
    where, targets, owner = [], [], []  # per scored token: (forward row, position), the token, the request
    for r, (row, m) in enumerate(zip(rows, masks)):
        u = unique[tuple(row[:-1])]
        first = m.index(1, 1) if 1 in m[1:] else len(m)  # the usual mask: 0s, then 1s to the end
        if sum(m[first:]) == len(m) - first:
            scored = range(first, len(m))
        else:
            scored = [t for t in range(1, len(m)) if m[t]]
        where.extend(u * T + t - 1 for t in scored)  # position t - 1 predicts token t
        targets.extend(row[t] for t in scored)
        owner.extend([r] * len(scored))
    where, targets, owner = (torch.tensor(x, dtype=torch.long) for x in (where, targets, owner))
    with autocast(device, dtype):
        h = model.hidden_states(idx.to(device))  # (U, T, C)
        logits = model.lm_head(h.flatten(0, 1)[where.to(device)])  # (N, V): only the scored positions
    if n_vocab is not None:
        logits = logits[:, :n_vocab]
    token_loss = F.cross_entropy(logits.float(), targets.to(logits.device), reduction="none").cpu()  # (N,) fp32
    sum_loss = torch.zeros(len(rows)).index_add_(0, owner, token_loss)
    count = torch.zeros(len(rows)).index_add_(0, owner, torch.ones_like(token_loss))
    return sum_loss, sum_loss / count.clamp(min=1)


def encode_pair(enc, context, continuation):
    """(context ids, continuation ids) as the harness's causal models split them: trailing whitespace of the
    context moves to the continuation, context + continuation is encoded whole, and the continuation is what
    follows the context's own encoding. An empty context is <|endoftext|>. Special-token text becomes its id, as
    a Hugging Face tokenizer encodes it."""
    if context == "":
        cont = enc.encode(continuation, allowed_special="all")
        return [enc.eot_token], cont
    stripped = context.rstrip()
    continuation, context = context[len(stripped) :] + continuation, stripped
    whole = enc.encode(context + continuation, allowed_special="all")
    ctx = enc.encode(context, allowed_special="all")
    return ctx, whole[len(ctx) :]


def score_requests(
    model, requests, device, rows_per_forward=64, dtype=None, n_vocab=None, stop=None, progress=False, desc="scoring"
):
    """(summed log-likelihood, number of scored tokens) of each (context ids, continuation ids) request, as two
    float32 CPU tensors (R,); None once stop() (asked between batches) returns True.

    Requests are grouped by model input (equal inputs share a row) and batched rows_per_forward rows at a time,
    longest first: little padding, and an out-of-memory shows at once. The model is put in eval mode and its
    train/eval mode restored afterwards.
    """
    block_size = model.config.block_size
    rows = [ctx + cont for ctx, cont in requests]
    masks = [[0] * len(ctx) + [1] * len(cont) for ctx, cont in requests]
    groups = {}
    for r, row in enumerate(rows):
        groups.setdefault(tuple(row[-(block_size + 1) : -1]), []).append(r)
    order = sorted(groups.values(), key=lambda g: -len(rows[g[0]]))
    batches = [[r for g in order[i : i + rows_per_forward] for r in g] for i in range(0, len(order), rows_per_forward)]
    sum_loss = torch.zeros(len(rows))
    count = torch.tensor([float(sum(m[-block_size:])) for m in masks])  # scored tokens inside the window
    was_training = model.training
    model.eval()
    try:
        for batch in progress_bar(batches, show=progress, desc=desc, unit="batch"):
            if stop is not None and stop():
                return None
            s, _ = score_rows(
                model, [rows[r] for r in batch], [masks[r] for r in batch], device, block_size, dtype, n_vocab
            )
            sum_loss[batch] = s
    finally:
        model.train(was_training)
    return -sum_loss, count
