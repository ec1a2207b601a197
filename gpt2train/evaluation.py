"""What the training loop evaluates, each at its interval: the val loss and bits per byte (eval_interval; of a
mixture each source's too), HellaSwag as llm.c scores it (hellaswag_interval), the multiple-choice suite (eval_tasks
at eval_tasks_interval) and a sample preview (sample_interval). train.py builds one Evaluator in run() and calls it
at every step, as torchtitan's Validator; every rank calls it alike. HellaSwag and the suite are scored by the
evaluation path of hellaswag.py and evaluate.py (scoring.Suite), on the bare model (gathered, when sharded).
"""

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from gpt2train import assets, tasks
from gpt2train.bpe import token_bytes, tokenizer_from_record
from gpt2train.config import ConfigError
from gpt2train.console import log
from gpt2train.devices import autocast
from gpt2train.files import first_line
from gpt2train.generation import Sampling, generate
from gpt2train.parallel import any_rank, gathered
from gpt2train.scoring import Suite
from gpt2train.step import in_micro_batches, to_device


class Abandoned(Exception):
    """An evaluation cut short by SIGTERM/SIGINT: the loop saves a checkpoint and exits 0."""


class Evaluator:
    """The run's evaluations, built once in run(). run(model, raw_model, step, last, stop) does those due at `step`
    (an interval's multiples, and the last step), logs them and returns the val loss (None when not due).

    The run's tokenizer (`tokenizer`: its record, bpe.tokenizer_record) is loaded at the first call where HellaSwag,
    the suite or samples are on: a run with them stops before it trains when it cannot be loaded. val_bpb needs only
    its byte lengths (bpe.token_bytes), asked at the first validation: a tokenizer that cannot be had (GPT-2's,
    offline with an empty cache) leaves val_bpb out of the run, with one note. HellaSwag's and the suite's examples
    of this rank are read and tokenized at their first evaluation and kept."""

    def __init__(self, train_loader, val_loader, tracker, cfg, env, tokenizer):
        self.train_loader = train_loader  # its B is the live micro-batch (an out-of-memory halves it): validation's too
        self.val_loader = val_loader
        self.tracker = tracker
        self.cfg = cfg
        self.env = env
        self.tokenizer = tokenizer
        self.enc = None
        self.bytes = None  # val_bpb's token_bytes as a CPU tensor once asked for; False where it cannot be had
        tokenized = ("hellaswag_interval", "eval_tasks_interval", "sample_interval")
        self.tokenized_on = [key for key in tokenized if getattr(cfg, key) > 0]  # the evaluations that need `enc`
        self.suites = {}  # 'hellaswag', 'eval_tasks' -> Suite, made at their first evaluation

    def run(self, model, raw_model, step, last, stop):
        """The evaluations due at `step`, logged; returns the val loss or None. model: what the loop calls (the val
        loss goes through it); raw_model: the bare GPT. A signal (stop: the StopRequest) abandons them between
        batches: Abandoned."""
        cfg, env = self.cfg, self.env
        due = lambda interval: interval > 0 and (step % interval == 0 or last)  # noqa: E731
        if self.enc is None and self.tokenized_on:
            self.enc = self.load_tokenizer()
        val = None
        if due(cfg.eval_interval):
            record = self.validate(model, step, stop)
            val = record["val_loss"]
            self.tracker.log(record)
            log(f"step {step}: {val_line(record)}")
        if due(cfg.hellaswag_interval):
            hs = self.score("hellaswag", raw_model, stop)["tasks"][tasks.HELLASWAG_LLMC.name]
            self.tracker.log(
                {"step": step, "hellaswag_acc": hs["acc"], "hellaswag_acc_norm": hs["acc_norm"], "hellaswag_n": hs["n"]}
            )
            log(f"step {step}: hellaswag acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")
        if due(cfg.eval_tasks_interval):
            result = self.score("eval_tasks", raw_model, stop)
            self.tracker.log(tracker_record(step, result))
            log(f"step {step}: {summary_line(result)}")
        if step > 0 and due(cfg.sample_interval):
            log(f"step {step}: sample: {sample_preview(raw_model, cfg, env, self.enc)!r}")
        return val

    def validate(self, model, step, stop):
        """The val record of `step`: val_loss and val_bpb (bits per UTF-8 byte of the targets' text, val_loss's
        nats over the same targets / ln 2 / their bytes; left out without the tokenizer, or where the targets decode
        to 0 bytes). Of a mixture (mixture.Mixture) each source's split alone, val/<name>_loss and val/<name>_bpb, and
        val_loss and val_bpb those of the mixture: the sources' losses weighted by the mixture's weights, and the
        weighted nats per target over the weighted bytes per target. The sources share eval_steps (shared_steps), so
        a mixture validates what one source does. eval_steps 'all': each source's whole split (read_val_rows), its
        loss the mean over its targets. val_bytes: the UTF-8 bytes of all the targets scored (with the byte table)."""
        if self.bytes is None:
            try:
                enc = self.enc or tokenizer_from_record(self.tokenizer)
                self.bytes = torch.tensor(token_bytes(enc, self.cfg.vocab_size))
            except (RuntimeError, OSError, ImportError, ValueError) as e:
                self.bytes = False
                log(
                    f"val_bpb is left out of this run: the run's tokenizer cannot be loaded ({first_line(e)})",
                    note=True,
                )
            if any_rank(self.bytes is False, self.env):  # every rank counts bytes, or none does
                self.bytes = False
        table = None if self.bytes is False else self.bytes
        sources = self.val_loader.sources()
        weights = [weight for _, weight in sources.values()]
        micro = self.train_loader.B  # the live micro-batch
        stopped = lambda: any_rank(stop.signal, self.env)  # noqa: E731
        whole = self.cfg.eval_steps == "all"  # each source's whole split, its loss the mean over its targets
        steps = ["all"] * len(weights) if whole else shared_steps(self.cfg.eval_steps, weights)
        scored = {
            name: val_loss(model, read_val_rows(loader, n, table), micro, self.env, stopped, step)
            for (name, (loader, _)), n in zip(sources.items(), steps)
        }
        mixed = lambda per: sum(w * per(r) for w, r in zip(weights, scored.values()))  # noqa: E731
        loss = (lambda r: r.nats / r.targets) if whole else (lambda r: r.loss)  # noqa: E731
        record = {"step": step, "val_loss": mixed(loss)}
        # nats per target over bytes per target, each weighted by the mixture; none where the targets are no bytes
        # (a split of <|endoftext|> only)
        if table is not None and mixed(lambda r: r.bytes / r.targets) > 0:
            record["val_bpb"] = mixed(lambda r: r.nats / r.targets) / math.log(2) / mixed(lambda r: r.bytes / r.targets)
        if table is not None:  # the text scored, so that runs with other tokenizers can check they saw the same
            record["val_bytes"] = int(sum(r.bytes for r in scored.values()))
        for name, r in scored.items():
            if name is not None:
                record[f"val/{name}_loss"] = loss(r)
                if table is not None and r.bytes > 0:
                    record[f"val/{name}_bpb"] = r.nats / math.log(2) / r.bytes
        return record

    def load_tokenizer(self):
        """The run's tokenizer; one that cannot be had is a ConfigError that says how to provide it."""
        try:
            return tokenizer_from_record(self.tokenizer)
        except (RuntimeError, OSError, ImportError, ValueError) as e:
            raise ConfigError(
                f"{', '.join(self.tokenized_on)}: the run's tokenizer cannot be loaded: {e}; or train without it: "
                + " ".join(f"--{key}=0" for key in self.tokenized_on)
            ) from None

    def score(self, name, raw_model, stop):
        """The result of suite `name` ('hellaswag' or 'eval_tasks'), its examples sharded over ranks (every rank
        calls it); Abandoned when a rank gets a signal."""
        if name not in self.suites:
            self.suites[name] = self.make_suite(name, raw_model.config.vocab_size)
        with gathered(raw_model, self.env) as model:
            result = self.suites[name].score(
                model, self.env.device, dtype=self.env.dtype, stop=lambda: stop.signal is not None
            )
        if result is None:
            raise Abandoned
        return result

    def make_suite(self, name, vocab_size):
        """This rank's share of HellaSwag's examples (hellaswag_limit) or eval_tasks' (eval_tasks_limit), tokenized;
        data that cannot be had, or a model that cannot read the tokenizer's ids, is a ConfigError (one line,
        exit 2) at the first evaluation."""
        cfg, enc = self.cfg, self.enc
        try:
            if vocab_size < enc.n_vocab:
                raise ValueError(f"a model of vocab_size={vocab_size} cannot read the tokenizer's {enc.n_vocab} ids")
            if name == "hellaswag":
                docs = {tasks.HELLASWAG_LLMC.name: tasks.load_hellaswag(assets.fetch_hellaswag(), cfg.hellaswag_limit)}
            else:
                docs = {task: tasks.load_docs(task, cfg.eval_tasks_limit) for task in tasks.parse_tasks(cfg.eval_tasks)}
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{name}: {e}") from None
        return Suite(docs, enc, self.env.rank, self.env.world_size)


def shared_steps(eval_steps, weights):
    """eval_steps val micro-batches shared among a mixture's sources: one each (a source of weight 0 is still
    validated), the rest in proportion to the weights (the largest remainders rounded up). [20] for one source;
    [15, 5] for weights 0.75, 0.25; [9, 5, 3, 3] for 0.5, 0.25, 0.15, 0.1. The total is eval_steps, or one per
    source when there are more sources than that."""
    total = sum(weights)
    rest = max(0, eval_steps - len(weights))
    shares = [rest * w / total if total > 0 else rest / len(weights) for w in weights]
    steps = [1 + math.floor(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: math.floor(shares[i]) - shares[i])
    for i in by_remainder[: rest + len(weights) - sum(steps)]:
        steps[i] += 1
    return steps


class ValScore(NamedTuple):
    """val_loss()'s result, of all ranks."""

    loss: float  # the mean of the micro-batches' mean losses: the val_loss a run logs
    nats: float  # the summed loss of the targets (y != -1)
    targets: float  # how many
    bytes: float | None  # the UTF-8 bytes they decode to; None without a byte table


class ValRows(NamedTuple):
    """The val micro-batches every validation scores, read at once on the host (read_val_rows)."""

    x: torch.Tensor  # (rows, T) inputs
    y: torch.Tensor  # (rows, T) targets, -1 where there is none
    bytes: int | None  # the UTF-8 bytes the targets decode to; None without a byte table


def read_val_rows(loader, eval_steps, token_bytes=None) -> ValRows:
    """The loader's first eval_steps micro-batches (the same every time: it is reset first), and with token_bytes
    (each id's UTF-8 bytes, bpe.token_bytes) the bytes their targets decode to. eval_steps 'all': the whole split
    (a data.DataLoader's), this rank its share of the micro-steps that cover it once; the last one's rows past the
    split's end (the next epoch's) have no targets (the model's loss of such a micro-batch is 0), so that every rank
    runs as many rows through the model."""
    loader.reset()
    whole = eval_steps == "all"
    steps = -(-loader.num_samples // (loader.B * loader.world_size)) if whole else eval_steps
    x, y = (torch.cat(t) for t in zip(*(loader.next_batch() for _ in range(steps))))  # (rows, T) each
    if whole:
        i, B = torch.arange(len(y)), loader.B
        position = (i // B) * B * loader.world_size + loader.rank * B + i % B  # of row i in the stream
        y[position >= loader.num_samples] = -1
    size = None if token_bytes is None else int((token_bytes[y.clamp(min=0)] * (y != -1)).sum())
    return ValRows(x, y, size)


@torch.no_grad()
def val_loss(model, rows: ValRows, micro, env, stop=lambda: False, step=0):
    """The ValScore of the val rows, of all ranks: the mean loss, the summed loss of their targets and the UTF-8
    bytes those decode to. The rows go through the model `micro` at a time, the training micro-batch: an
    out-of-memory halves it as in a step (a Halt under torchrun or at 1). Abandoned as soon as stop() (agreed by all
    ranks)."""
    model.eval()
    x, y = rows.x, rows.y
    targets = (y != -1).sum(dim=1)  # (rows,) on the host: no sync
    sums = torch.zeros(2, device=env.device)  # the micro-batches' mean losses x their rows; the summed loss

    def score(a, b):
        if stop():
            raise Abandoned
        xb, yb = to_device((x[a:b], y[a:b]), env.device)
        with autocast(env.device, env.dtype):
            loss = model(xb, yb, return_logits=False)[1].float()
        sums.add_(torch.stack([loss * (b - a), loss * int(targets[a:b].sum())]))

    try:
        in_micro_batches(score, len(x), micro, env, f"step {step}")
    finally:
        model.train()
    size = float(rows.bytes or 0)
    counts = to_device((torch.tensor([float(targets.sum()), size]),), env.device)[0]  # pinned: no wait
    totals = torch.cat([sums, counts])
    if env.distributed:
        if env.tp_rank or env.stage:  # a tensor-parallel group's ranks and a pipeline's stages read the same rows
            totals.zero_()  # (a pipeline's forward gives each the same loss): the first counts them
        dist.all_reduce(totals)  # SUM: gloo has no AVG
    loss_sum, nats, count, size = totals.tolist()
    return ValScore(loss_sum / len(x) / env.dp_size, nats, count, None if rows.bytes is None else size)


def val_line(record):
    """'val loss 5.6400 (2.4101 bits/byte)', and each source's of a mixture: '; a 5.1 (2.2), b 6.3 (2.9)'."""
    bpb = lambda key: f" ({record[key]:.4f} bits/byte)" if key in record else ""  # noqa: E731
    line = f"val loss {record['val_loss']:.4f}{bpb('val_bpb')}"
    names = [key[4 : -len("_loss")] for key in record if key.startswith("val/") and key.endswith("_loss")]
    return line + "".join(f"; {n} {record[f'val/{n}_loss']:.4f}{bpb(f'val/{n}_bpb')}" for n in names)


def sample_preview(raw_model, cfg, env, enc):
    """A sample's text from rank 0, None on the others. Every rank calls it: a sharded model must be gathered."""
    with gathered(raw_model, env) as model:
        if not env.master:
            return None
        prompt = enc.encode(cfg.sample_prompt) or [enc.eot_token]
        generator = torch.Generator(device=env.device).manual_seed(cfg.seed)  # leaves the training RNG alone
        model.eval()
        with autocast(env.device, env.dtype):
            sampling = Sampling(top_k=200, n_vocab=enc.n_vocab)
            out = generate(model, torch.tensor([prompt], device=env.device), cfg.sample_tokens, sampling, generator)
        model.train()
    return enc.decode([t for t in out[0].tolist() if t < enc.n_vocab])


def summary_line(result):
    """One line: each task's acc and the summary."""
    parts = [f"{name} {r['acc']:.4f}" for name, r in result["tasks"].items()]
    return f"{' | '.join(parts)} | mc_centered {result['mc_centered']:.4f}"


def tracker_record(step, result):
    """The metrics.jsonl record of one evaluation: mc_centered, and mc/<task>_acc (and _acc_norm) per task (the
    prefix keeps them apart from hellaswag.py's own hellaswag_acc, and groups them in W&B and TensorBoard)."""
    per_task = {f"mc/{name}_{k}": r[k] for name, r in result["tasks"].items() for k in ("acc", "acc_norm") if k in r}
    return {"step": step, "mc_centered": result["mc_centered"], **per_task}
