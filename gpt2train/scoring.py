"""The one evaluation path of hellaswag.py, evaluate.py and train.py: a batched log-likelihood scorer
(score_requests), the Suite that renders the tasks' examples of a rank once and scores them with it, and bits per
byte of whole documents (bits_per_byte: evaluate.py --bpb).

A request is (context tokens, continuation tokens); its score is the summed log-probability of the
continuation's tokens given everything before them, as the lm-evaluation-harness computes it: a row longer
than the model's context keeps its last block_size + 1 tokens and the model reads all but the last.

Batched: the rows of many requests share one forward pass, right-padded to the batch's longest row (causal
attention: padding never reaches a real position, so each score is the one of the row alone). Requests whose
model input is the same (MMLU's four one-letter answers after one prompt) share one row. Only the scored
positions go through lm_head, and the softmax runs over the tokenizer's n_vocab ids (a padded vocabulary's
unused rows, which an export drops, take no probability). The model is the bare GPT, run eagerly (train.py
passes its gathered one): the eval shapes change every batch and would recompile a compiled one.

A Suite scores every choice of an example by its summed log-likelihood (`acc`: the highest) and by that divided by
the choice's length (`acc_norm`): in characters as the harness, in scored tokens as llm.c (tasks.py). Under
torch.distributed each rank holds its share of the examples and the counts are all-reduced, so the results equal
one process's; a stop request between batches abandons the evaluation on every rank (train.py's SIGTERM).
"""

import math
import re
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gpt2train import tasks
from gpt2train.console import progress_bar
from gpt2train.devices import autocast

PAD_MULTIPLE = 8  # rows are padded to a multiple of this length (aligned shapes for matmul kernels)
# the scored positions go through lm_head and the softmax about this many logits at a time: a batch of 64 rows of
# 128 positions is 1.6 GB of fp32 logits over GPT-2's vocabulary, and as much again for the softmax
LOGITS_AT_ONCE = 1 << 25


class Forwards(NamedTuple):
    """How the scorer runs the model: on `device`, rows_per_forward rows per forward, under autocast to dtype (None:
    devices.autocast's default for the device)."""

    device: object
    rows_per_forward: int = 64
    dtype: object = None


@torch.no_grad()
def score_rows(model, rows, masks, forwards: Forwards, n_vocab=None):
    """Summed and mean cross-entropy over the masked (continuation) tokens of each row, in one forward.

    model: a bare GPT. rows, masks: lists of R token lists / 0-1 lists (1 on the scored tokens). Rows whose
    inputs (all tokens but the last) are equal share one row of the forward (forwards.rows_per_forward is the
    caller's). The softmax runs over the first n_vocab ids (None: all). Returns two float32 CPU tensors (R,).
    """
    device, dtype = forwards.device, forwards.dtype
    block_size = model.config.block_size
    # the harness's window: the last block_size + 1 tokens, the model reading all but the last
    rows, masks = zip(*((r[-(block_size + 1) :], m[-(block_size + 1) :]) for r, m in zip(rows, masks)))
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
        h = model.hidden_states(idx.to(device)).flatten(0, 1)[where.to(device)]  # (N, C): only the scored positions
    step = max(256, LOGITS_AT_ONCE // model.config.vocab_size)
    token_loss = []
    for i in range(0, len(where), step):
        with autocast(device, dtype):
            logits = model.lm_head(h[i : i + step])  # (n, V)
        if n_vocab is not None:
            logits = logits[:, :n_vocab]
        token_loss.append(F.cross_entropy(logits.float(), targets[i : i + step].to(logits.device), reduction="none"))
    token_loss = torch.cat(token_loss).cpu()  # (N,) fp32
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


def score_requests(model, requests, forwards: Forwards, n_vocab=None, stop=None, progress=None):
    """(summed log-likelihood, number of scored tokens) of each (context ids, continuation ids) request, as two
    float32 CPU tensors (R,); None once stop() (asked between batches) returns True. progress: a progress bar's
    label (None: no bar).

    Requests are grouped by model input (equal inputs share a row) and batched forwards.rows_per_forward rows at a
    time, longest first: little padding, and an out-of-memory shows at once. The model is put in eval mode and its
    train/eval mode restored afterwards.
    """
    block_size = model.config.block_size
    rows_per_forward = forwards.rows_per_forward
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
        for batch in progress_bar(batches, show=progress is not None, desc=progress, unit="batch"):
            if stop is not None and stop():
                return None
            sum_loss[batch] = score_rows(model, [rows[r] for r in batch], [masks[r] for r in batch], forwards, n_vocab)[
                0
            ]
    finally:
        model.train(was_training)
    return -sum_loss, count


# a document is encoded a piece of about this many characters at a time (encode_in_pieces): the tokenizers' own
# buffers grow with the text they are given (a 200 MB document asked the Rust one for 4 GB at once)
PIECE_CHARS = 1 << 20
_LINE_BREAK = re.compile(r"(?<=\S)\n(?=\S)")  # a line break between two non-space characters
_CUT_PROBES = [("Hello world.\n", "It's 2024"), ("naïve  café:\n", "日本語 42"), ("x = f(1);\n", "'tis\n\n  end")]


def encode_in_pieces(enc, text, piece=None):
    """enc.encode_ordinary(text) as a uint32 array, encoded about `piece` characters at a time. Each piece ends
    at a line break between two non-space characters, which GPT-2's and tokenizer.py's pre-tokenizers never join
    to a neighbour, so the ids are the whole text's; a tokenizer that encodes _CUT_PROBES otherwise (a prefix
    space, say), or a text with no such break, is encoded whole."""
    piece = piece or PIECE_CHARS
    cuts = []
    if len(text) > piece and all(
        enc.encode_ordinary(a + b) == enc.encode_ordinary(a) + enc.encode_ordinary(b) for a, b in _CUT_PROBES
    ):
        start = 0
        while (m := _LINE_BREAK.search(text, start + piece)) is not None:
            cuts.append(m.end())
            start = m.end()
    bounds = [0, *cuts, len(text)]
    parts = [np.asarray(enc.encode_ordinary(text[a:b]), dtype=np.uint32) for a, b in zip(bounds, bounds[1:])]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint32)


def bits_per_byte(model, enc, documents, forwards: Forwards, progress=False):
    """{"bpb", "nats", "tokens", "bytes", "documents"} of `model` on texts (evaluate.py --bpb): each document
    scored alone as <|endoftext|> followed by its tokens (encode_ordinary: special-token text is text), cut into
    consecutive non-overlapping windows of at most block_size predicted tokens, each window conditioned only on its
    own tokens (the first reads the <|endoftext|>, a later one the token before its first prediction), the
    softmax over the tokenizer's n_vocab ids (score_rows); bpb = the summed negative log-likelihood (nats) /
    ln 2 / the documents' UTF-8 bytes. Every byte of the text is predicted once, whatever the tokenizer, so models
    with different tokenizers compare on the same text.

    In memory of the order of the text: a document's ids are one array (encode_in_pieces), and its full windows
    are scored forwards.rows_per_forward at a time as they come; its last, shorter window waits for the end, where the
    short ones go longest first (score_requests' batches, so the same numbers)."""
    if enc.eot_token is None:
        raise ValueError("the model's tokenizer has no <|endoftext|> to start each document with")
    if model.config.vocab_size < enc.n_vocab:
        raise ValueError(
            f"the model's vocabulary ({model.config.vocab_size} ids) cannot read its tokenizer's {enc.n_vocab}"
        )
    sizes = [len(doc.encode("utf-8")) for doc in documents]
    size = sum(sizes)
    if not size:
        raise ValueError(f"no text to score: {len(documents)} document(s), 0 bytes")
    T = model.config.block_size
    rows_per_forward = forwards.rows_per_forward
    losses, full, short, tokens = [], [], [], 0  # losses: each window's summed loss, in the windows' order

    def score(windows):  # [(window number, ids)]
        rows = [w.tolist() for _, w in windows]
        s, _ = score_rows(model, rows, [[0] + [1] * (len(r) - 1) for r in rows], forwards, enc.n_vocab)
        for (n, _), loss in zip(windows, s.tolist()):
            losses[n] = loss

    was_training = model.training
    model.eval()
    try:
        with progress_bar(total=size, show=progress, desc="bits per byte", unit="B", unit_scale=True) as bar:
            for doc, doc_bytes in zip(documents, sizes):
                ids = np.concatenate([np.array([enc.eot_token], np.uint32), encode_in_pieces(enc, doc)])
                for i in range(0, len(ids) - 1, T):
                    window = ids[i : i + T + 1]
                    if len(window) == T + 1:
                        full.append((len(losses), window))
                    else:
                        short.append((len(losses), window.copy()))
                    losses.append(0.0)
                    tokens += len(window) - 1
                    if len(full) == rows_per_forward:
                        score(full)
                        full = []
                bar.update(doc_bytes)
            rest = full + sorted(short, key=lambda w: -len(w[1]))
            for i in range(0, len(rest), rows_per_forward):
                score(rest[i : i + rows_per_forward])
    finally:
        model.train(was_training)
    nats = float(torch.tensor(losses, dtype=torch.float32).double().sum())
    return {
        "bpb": nats / math.log(2) / size,
        "nats": nats,
        "tokens": tokens,
        "bytes": size,
        "documents": len(documents),
    }


class Suite:
    """The tasks' examples of this rank (examples[rank::world_size] of each), tokenized once and kept: train.py's
    Evaluator builds one and scores it at every evaluation. docs: {task name: [doc, ...]} (tasks.load_docs; for
    hellaswag_llmc tasks.load_hellaswag). A suite split over ranks (world_size > 1) is scored under their process
    group, by every rank alike."""

    def __init__(self, docs, enc, rank=0, world_size=1):
        self.names, self.n_vocab, self.world_size = list(docs), enc.n_vocab, world_size
        self.examples = {}  # task -> [(index, request token pairs, label, acc_norm's divisors, subject)]
        for name, task_docs in docs.items():
            task, mine = tasks.task(name), []
            for index in range(rank, len(task_docs), world_size):
                doc = task_docs[index]
                request = task.render(doc)
                if task.llmc:  # acc_norm divides by the scored tokens, which the scorer counts
                    pairs = [(enc.encode_ordinary(c), enc.encode_ordinary(x)) for c, x in request.pairs]
                    lengths = None
                else:
                    pairs = [encode_pair(enc, c, x) for c, x in request.pairs]
                    lengths = [len(c) for c in request.choices]
                mine.append((index, pairs, request.label, lengths, doc.get("subject")))
            self.examples[name] = mine

    def score(self, model, device, rows_per_forward=64, dtype=None, stop=None, progress=False):
        """Accuracies of `model` on this suite (split over ranks: the counts all-reduced, so results equal one
        process's). Returns {"tasks": {task: {n, acc, acc_norm (where the task reports it),
        chance, centered}}, "mmlu_subjects": {subject: {n, acc}} (when mmlu was scored), "mc_centered", "preds":
        this rank's [{task, index, pred, pred_norm, label, acc, log_likelihoods}]}; None when stop() (asked between
        batches) turned True on any rank."""
        vocab = model.config.vocab_size
        if vocab < self.n_vocab:
            raise ValueError(f"the model's vocabulary ({vocab} ids) cannot read its tokenizer's {self.n_vocab} ids")
        flat = [(name, ex) for name in self.names for ex in self.examples[name]]
        requests = [pair for _, ex in flat for pair in ex[1]]
        bar = self.names[0] if len(self.names) == 1 else "tasks"  # the progress bar's label
        forwards = Forwards(device, rows_per_forward, dtype)
        scored = score_requests(model, requests, forwards, self.n_vocab, stop, bar if progress else None)
        abandoned = scored is None  # counted like a result, so that every rank takes part in the all-reduce
        log_likelihood, count = (torch.zeros(len(requests)), torch.ones(len(requests))) if abandoned else scored
        per_token = (log_likelihood / count.clamp(min=1)).tolist()  # llm.c's acc_norm, in float32 as llm.c's
        log_likelihood = log_likelihood.tolist()
        subjects = tasks.MMLU_SUBJECTS if "mmlu" in self.names else []
        # per task: n, correct, correct_norm, sum of 60/choices (an integer for 2-5 choices, so sums are exact in any
        # order, on any number of ranks); per MMLU subject: n, correct; then the stop flag
        counts = torch.zeros(4 * len(self.names) + 2 * len(subjects) + 1, dtype=torch.float64)
        preds, first = [], 0
        for name, (index, pairs, label, lengths, subject) in flat:
            end = first + len(pairs)
            ll = log_likelihood[first:end]
            normed = per_token[first:end] if lengths is None else [v / n for v, n in zip(ll, lengths)]
            first = end
            pred, pred_norm = _argmax(ll), _argmax(normed)
            t = 4 * self.names.index(name)
            counts[t : t + 4] += torch.tensor(
                [1, pred == label, pred_norm == label, 60 / len(pairs)], dtype=torch.float64
            )
            if name == "mmlu":
                s = 4 * len(self.names) + 2 * subjects.index(subject)
                counts[s : s + 2] += torch.tensor([1, pred == label], dtype=torch.float64)
            preds.append(
                {
                    "task": name,
                    "index": index,
                    "pred": pred,
                    "pred_norm": pred_norm,
                    "label": label,
                    "acc": int(pred == label),
                    "log_likelihoods": ll,
                }
            )
        counts[-1] = float(abandoned)
        if self.world_size > 1:  # the one collective, on every rank
            on = device if dist.get_backend() == "nccl" else "cpu"
            counts = counts.to(on)
            dist.all_reduce(counts)
            counts = counts.cpu()
        if counts[-1] > 0:
            return None
        return self._results(counts, subjects, preds)

    def _results(self, counts, subjects, preds):
        """score's result from the counts of every rank and this rank's preds."""
        results = {}
        for i, name in enumerate(self.names):
            n, correct, correct_norm, sixtieths = counts[4 * i : 4 * i + 4].tolist()
            if n == 0:
                raise ValueError(f"{name}: no examples to evaluate")
            chance = sixtieths / 60 / n
            results[name] = {
                "n": int(n),
                "acc": correct / n,
                "chance": chance,
                "centered": (correct / n - chance) / (1 - chance),
            }
            if tasks.task(name).acc_norm:
                results[name]["acc_norm"] = correct_norm / n
        out = {
            "tasks": results,
            "mc_centered": sum(r["centered"] for r in results.values()) / len(results),
            "preds": preds,
        }
        if subjects:  # the harness's mmlu group: each subject, and all of them weighted by size (= all questions)
            base = 4 * len(self.names)
            out["mmlu_subjects"] = {
                s: {"n": int(n), "acc": c / n}
                for j, s in enumerate(subjects)
                for n, c in [counts[base + 2 * j : base + 2 * j + 2].tolist()]
                if n > 0
            }
        return out


def _argmax(values):
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equal maxima, as numpy's
