"""What the training loop evaluates, each at its interval: the val loss (eval_interval), HellaSwag as llm.c scores
it (hellaswag_interval), the multiple-choice suite (eval_tasks at eval_tasks_interval) and a sample preview
(sample_interval). train.py builds one Evaluator in run() and calls it at every step, as torchtitan's Validator;
every rank calls it alike. HellaSwag and the suite are scored by the evaluation path of hellaswag.py and evaluate.py
(scoring.Suite), on the bare model (gathered, when sharded).
"""

import torch
import torch.distributed as dist

from gpt2train import assets, tasks
from gpt2train.bpe import tokenizer_from_record
from gpt2train.config import ConfigError
from gpt2train.console import log
from gpt2train.devices import autocast
from gpt2train.parallel import any_rank, gathered
from gpt2train.scoring import Suite
from gpt2train.step import in_micro_batches, to_device


class Abandoned(Exception):
    """An evaluation cut short by SIGTERM/SIGINT: the loop saves a checkpoint and exits 0."""


class Evaluator:
    """The run's evaluations, built once in run(). run(model, raw_model, step, last, stop) does those due at `step`
    (an interval's multiples, and the last step), logs them and returns the val loss (None when not due).

    The run's tokenizer (`tokenizer`: its record, bpe.tokenizer_record) is loaded at the first call, and only when
    HellaSwag, the suite or samples are on: a run without them trains without it (offline, GPT-2's may not be had),
    and one with them stops before it trains when it cannot be loaded. HellaSwag's and the suite's examples of this
    rank are read and tokenized at their first evaluation and kept."""

    def __init__(self, train_loader, val_loader, tracker, cfg, env, tokenizer):
        self.train_loader = train_loader  # its B is the live micro-batch (an out-of-memory halves it): validation's too
        self.val_loader = val_loader
        self.tracker = tracker
        self.cfg = cfg
        self.env = env
        self.tokenizer = tokenizer
        self.enc = None
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
            micro = self.train_loader.B
            val = val_loss(model, self.val_loader, cfg.eval_steps, micro, env, lambda: any_rank(stop.signal, env), step)
            self.tracker.log({"step": step, "val_loss": val})
            log(f"step {step}: val loss {val:.4f}")
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
        with gathered(raw_model) as model:
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


@torch.no_grad()
def val_loss(model, loader, eval_steps, micro, env, stop=lambda: False, step=0):
    """Mean loss over the same eval_steps val micro-batches every time, averaged over ranks. Their rows (read at
    once, on the CPU) go through the model `micro` at a time, the training micro-batch: an out-of-memory halves
    it as in a step (a Halt under torchrun or at 1). Abandoned as soon as stop() (agreed by all ranks)."""
    model.eval()
    loader.reset()
    x, y = (torch.cat(t) for t in zip(*(loader.next_batch() for _ in range(eval_steps))))  # (rows, T) each
    total = torch.zeros((), device=env.device)

    def rows(a, b):
        if stop():
            raise Abandoned
        xb, yb = to_device((x[a:b], y[a:b]), env.device)
        with autocast(env.device, env.dtype):
            total.add_(model(xb, yb, return_logits=False)[1].float() * (b - a))

    try:
        in_micro_batches(rows, len(x), micro, env, f"step {step}")
    finally:
        model.train()
    if env.distributed:
        dist.all_reduce(total)  # SUM: gloo has no AVG
    return total.item() / len(x) / env.world_size


def sample_preview(raw_model, cfg, env, enc):
    """A sample's text from rank 0, None on the others. Every rank calls it: a sharded model must be gathered."""
    with gathered(raw_model) as model:
        if not env.master:
            return None
        prompt = enc.encode(cfg.sample_prompt) or [enc.eot_token]
        generator = torch.Generator(device=env.device).manual_seed(cfg.seed)  # leaves the training RNG alone
        model.eval()
        with autocast(env.device, env.dtype):
            out = model.generate(
                torch.tensor([prompt], device=env.device),
                cfg.sample_tokens,
                top_k=200,
                generator=generator,
                n_vocab=enc.n_vocab,
            )
        model.train()
    return enc.decode([t for t in out[0].tolist() if t < enc.n_vocab])


def summary_line(result):
    """One line: each task's acc and the summary."""
    parts = [f"{name} {r['acc']:.4f}" for name, r in result["tasks"].items()]
    return f"{' | '.join(parts)} | mc_centered {result['mc_centered']:.4f}"


def tracker_record(step, result):
    """The metrics.jsonl record of one evaluation: mc_centered, and mc/<task>_acc (and _acc_norm) per task (the
    prefix keeps them apart from hellaswag.py's own hellaswag_acc, and groups them in W&B and TensorBoard)."""
    record = {"step": step, "mc_centered": result["mc_centered"]}
    for name, r in result["tasks"].items():
        record[f"mc/{name}_acc"] = r["acc"]
        if "acc_norm" in r:
            record[f"mc/{name}_acc_norm"] = r["acc_norm"]
    return record
