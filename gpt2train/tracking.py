"""Run tracking: metrics.jsonl (the source of truth), optional Weights & Biases and TensorBoard sinks,
cost per token and the end-of-run summary. train.py makes one Tracker, on rank 0 only:

    tracker = Tracker(out_dir, run_config, tokens_per_step, resume_step, state)  # run_config: asdict(cfg)
    tracker.log({"step": 1, "train_loss": 4.2, ...})   # every metrics line, train and eval
    ckpt["tracker"] = tracker.state_dict()             # with each checkpoint
    print(tracker.close())                             # summary.json + the console summary

Both sinks are optional packages (`pip install wandb tensorboard`); the library runs without them.
"""

import contextlib
import datetime
import fcntl
import json
import math
import os
import secrets
import subprocess
import time
from pathlib import Path

from gpt2train.console import log
from gpt2train.files import atomic_write, first_line

# how a run ended (its result's 'status') and the exit code train.py returns for it. Bad input (a config error) is
# exit 2 and never becomes a run; 130: a second Ctrl-C that quit at once, without saving (status 'interrupted')
EXIT_CODES = {"ok": 0, "error": 1, "diverged": 3, "oom": 4, "interrupted": 5}


class TrackingError(ValueError):
    """A sink that cannot start (package missing, wandb.init refused); the message is one line."""


def json_safe(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value  # JSON has no NaN


class MetricsLog:
    """out_dir/metrics.jsonl, one JSON object per line. A fresh run starts an empty file; a resumed
    run first drops the lines of steps after its checkpoint (they are about to be redone)."""

    def __init__(self, path, resume_step=None):
        kept = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):  # a killed run's half-written last line
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line + "\n")
        atomic_write(path, "".join(kept))  # a crash here leaves the old file or the new one
        self.file = open(path, "a")

    def write(self, record):
        try:
            self.file.write(json.dumps({k: json_safe(v) for k, v in record.items()}) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: say which file
            raise OSError(e.errno, e.strerror, self.file.name) from None


def check_tracking_available(wandb_log, tensorboard_dir):
    """Raise TrackingError (one line) if an enabled sink's package does not import."""
    if wandb_log:
        try:
            import wandb  # noqa: F401
        except Exception as e:  # ImportError, or a broken install (a protobuf clash, say)
            raise TrackingError(
                f"wandb_log=True needs the wandb package, an optional extra: pip install wandb ({first_line(e)})"
            ) from None
    if tensorboard_dir is not None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (imports the tensorboard package)
        except Exception as e:
            raise TrackingError(
                f"tensorboard_dir={tensorboard_dir!r} needs the tensorboard package, an optional "
                f"extra: pip install tensorboard ({first_line(e)})"
            ) from None


class WandbSink:
    """A W&B run with step as its x-axis. Resuming passes the same id with resume='allow'; with
    WANDB_MODE=offline the run is written under out_dir/wandb/ (or $WANDB_DIR/wandb/ when WANDB_DIR is set,
    W&B's own convention) for a later `wandb sync`."""

    name = "wandb"

    def __init__(self, out_dir, run_config, run_id, project, run_name):
        import wandb

        try:
            self.run = wandb.init(
                project=project,
                name=run_name,
                id=run_id,
                resume="allow",
                dir=os.environ.get("WANDB_DIR") or str(out_dir),
            )
            self.run.config.update(run_config, allow_val_change=True)  # a resume may change e.g. max_steps
        except Exception as e:
            raise TrackingError(
                f"wandb.init failed ({first_line(e)}); log in (`wandb login`), record offline "
                "with WANDB_MODE=offline, or set wandb_log=False"
            ) from None

    def log(self, record):
        self.run.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def flush(self):
        pass  # wandb's own service process writes and uploads as it goes

    def close(self, exit_code):
        self.run.finish(exit_code=exit_code)


class TensorBoardSink:
    """Event files in log_dir: a record's numbers as scalars (one event per record), strings (a skipped
    step's reason) as text. A resume writes a purge marker at resume_step + 1, so TensorBoard hides what a
    killed run logged after its checkpoint; a fresh run purges from step 0 (a reused directory starts
    over, as metrics.jsonl does)."""

    name = "tensorboard"

    def __init__(self, log_dir, run_config, resume_step):
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        self.Summary = Summary
        self.writer = SummaryWriter(log_dir, purge_step=0 if resume_step is None else resume_step + 1)
        config = json.dumps(run_config, indent=2, default=str).replace("\n", "\n    ")
        self.writer.add_text("config", "    " + config, resume_step or 0)  # indented: a markdown code block

    def log(self, record):
        step, scalars = record["step"], []
        for key, value in record.items():
            if key == "step" or value is None:
                continue
            if isinstance(value, str):
                self.writer.add_text(key, value, step)
            else:
                scalars.append(self.Summary.Value(tag=key, simple_value=value))
        # what add_scalar writes, but all of a record in one event: a third of the cost of one per value
        # (tensorboard checksums every event in Python)
        self.writer._get_file_writer().add_summary(self.Summary(value=scalars), step)

    def flush(self):
        self.writer.flush()

    def close(self, exit_code):
        self.writer.close()


class Tracker:
    """All of a run's logging: metrics.jsonl plus the enabled sinks, cumulative cost, the summary.

    out_dir: the run's directory; run_config: the resolved config (a plain dict, the runs' config in the
    sinks), whose tracking keys (wandb_log, wandb_project, wandb_run_name, tensorboard_dir, cost_per_hour) say what
    is tracked; tokens_per_step: tokens of one optimizer step (all ranks); resume_step: the checkpoint's step
    when resuming, else None; state: the checkpoint's tracker.state_dict() (None: a fresh run, or a
    checkpoint from before tracking, then the W&B id comes from out_dir/wandb_id.txt).
    """

    def __init__(self, out_dir, run_config, tokens_per_step, resume_step=None, state=None):
        wandb_log, tensorboard_dir = run_config["wandb_log"], run_config["tensorboard_dir"]
        check_tracking_available(wandb_log, tensorboard_dir)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tokens_per_step, self.cost_per_hour = tokens_per_step, run_config["cost_per_hour"]
        state = {} if resume_step is None else state or {}  # a fresh run carries nothing over
        self.wall_before = state.get("wall_s", 0.0)  # seconds of the earlier processes of this run
        self.tokens = state.get("tokens", resume_step * tokens_per_step if resume_step else 0)
        # throughput means: every process's first step is left out (torch.compile, warm-up)
        self.timed_s, self.timed_tokens = state.get("timed_s", 0.0), state.get("timed_tokens", 0)
        self.mfu_s = state.get("mfu_s", 0.0)  # sum of mfu * step seconds; None once a step had no MFU
        self.first_step_seen = False
        self.t0 = time.perf_counter()

        self.sinks, self.wandb_id = [], None  # W&B first: the likeliest to refuse to start
        if wandb_log:
            id_file = self.out_dir / "wandb_id.txt"
            self.wandb_id = state.get("wandb_id")
            if self.wandb_id is None and resume_step is not None and id_file.is_file():
                self.wandb_id = id_file.read_text().strip() or None
            self.wandb_id = self.wandb_id or secrets.token_hex(4)  # W&B ids: [a-z0-9]+, 8 like its own
            id_file.write_text(self.wandb_id + "\n")
            self.sinks.append(
                WandbSink(
                    self.out_dir,
                    run_config,
                    self.wandb_id,
                    run_config["wandb_project"],
                    run_config["wandb_run_name"] or self.out_dir.resolve().name,
                )
            )
        if tensorboard_dir is not None:
            self.sinks.append(TensorBoardSink(tensorboard_dir, run_config, resume_step))
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", resume_step)

    def wall_s(self):
        return self.wall_before + time.perf_counter() - self.t0

    def log(self, record):
        """One metrics line ({'step': N, ...}) to metrics.jsonl and every sink; a train line (one with
        'train_loss') also counts its tokens and, with cost_per_hour, gains cost_usd and tokens_per_dollar."""
        record = dict(record)
        if "train_loss" in record:
            self.tokens += self.tokens_per_step
            step_s = (record.get("step_ms") or 0) / 1000
            if self.first_step_seen and step_s > 0:
                self.timed_s += step_s
                self.timed_tokens += self.tokens_per_step
                mfu = record.get("mfu")
                self.mfu_s = None if mfu is None or self.mfu_s is None else self.mfu_s + mfu * step_s
            self.first_step_seen = True
            if self.cost_per_hour is not None:
                cost = self.wall_s() / 3600 * self.cost_per_hour
                record["cost_usd"] = cost
                record["tokens_per_dollar"] = self.tokens / cost if cost > 0 else None
        self.metrics.write(record)
        self._each_sink("log", record)

    def _each_sink(self, method, *args):
        """Call method on every sink; one that raises is reported once and dropped (training goes on)."""
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:
                self.sinks.remove(sink)
                log(
                    f"tracking: {sink.name} failed ({first_line(e)}); disabled for the rest of the run "
                    f"(metrics.jsonl continues)",
                    note=True,
                )

    def state_dict(self):
        """What a resume needs (plain types, for the checkpoint). Also flushes the sinks, so all that the
        checkpoint covers is on disk."""
        self._each_sink("flush")
        return {
            "wandb_id": self.wandb_id,
            "wall_s": self.wall_s(),
            "tokens": self.tokens,
            "timed_s": self.timed_s,
            "timed_tokens": self.timed_tokens,
            "mfu_s": self.mfu_s,
        }

    def summary(self, status="ok", extra=None):
        """The run so far, from metrics.jsonl (the whole run, across resumes) and the tracker's counters; its result
        has `status` (EXIT_CODES) and `extra` (train.py's params, params_lookup, max_seconds)."""
        records = []
        for line in Path(self.metrics.file.name).read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
        train = [r for r in records if "train_loss" in r]
        val = [r for r in records if "val_loss" in r]  # the last one's loss is None where it was non-finite
        hellaswag = [r for r in records if "hellaswag_acc_norm" in r]
        mem = [r["peak_mem_mb"] for r in records if r.get("peak_mem_mb") is not None]
        best = min((r for r in val if r["val_loss"] is not None), key=lambda r: r["val_loss"], default=None)
        timed = self.timed_s > 0
        out = {
            "steps": max((r["step"] for r in records), default=0),
            "tokens": self.tokens,
            "wall_s": self.wall_s(),
            "mean_tokens_per_s": self.timed_tokens / self.timed_s if timed else None,
            "mean_mfu": self.mfu_s / self.timed_s if timed and self.mfu_s is not None else None,
            "final_train_loss": train[-1]["train_loss"] if train else None,  # the last step's: None if non-finite
            "final_val_loss": val[-1]["val_loss"] if val else None,
            "final_val_bpb": val[-1].get("val_bpb") if val else None,
            "best_val_loss": best["val_loss"] if best else None,
            "best_val_step": best["step"] if best else None,
            "skipped_steps": sum(1 for r in train if r.get("skipped")),
            "peak_mem_mb": max(mem) if mem else None,
        }
        if hellaswag:
            h = hellaswag[-1]
            out.update(
                hellaswag_step=h["step"], **{k: h[k] for k in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n")}
            )
        # a mixture's sources: the last validation's val/<name>_loss and _bpb, and the tokens each supplied
        out.update({k: v for k, v in (val[-1] if val else {}).items() if k.startswith("val/")})
        out.update({k: v for k, v in (train[-1] if train else {}).items() if k.startswith("tokens/")})
        suite = [r for r in records if "mc_centered" in r]
        if suite:  # evaluate.py's task suite: the last evaluation's summary
            out.update(mc_centered_step=suite[-1]["step"], mc_centered=suite[-1]["mc_centered"])
        if self.cost_per_hour is not None:
            cost = out["wall_s"] / 3600 * self.cost_per_hour
            out.update(
                cost_per_hour=self.cost_per_hour,
                cost_usd=cost,
                tokens_per_dollar=self.tokens / cost if cost > 0 else None,
            )
        out["result"] = run_result(out, records, status, extra or {})
        return out

    def close(self, status="ok", extra=None):
        """Write out_dir/summary.json, finish the sinks (a status other than 'ok' marks a failed W&B run), close
        metrics.jsonl; returns the console summary."""
        s = self.summary(status, extra)
        self.result = s["result"]
        path = self.out_dir / "summary.json"
        atomic_write(path, json.dumps({k: json_safe(v) for k, v in s.items()}, indent=2) + "\n")
        self._each_sink("close", EXIT_CODES[status])
        self.sinks = []
        self.metrics.file.close()
        return summary_text(s, path)


class NoTracker:
    """What the ranks other than 0 track: nothing (rank 0's Tracker has the same three calls)."""

    result = None  # the result close() made: rank 0's alone

    def log(self, record):
        pass

    def state_dict(self):
        return None

    def close(self, status="ok", extra=None):
        return None


def run_result(summary, records, status="ok", extra=()):
    """The run in one flat dict (the `result:` line, summary.json's 'result'), for sweeps to compare: how it ended
    (`status`, EXIT_CODES), the numbers of the last val record (val_loss, and val_bpb where it has one; val_loss None
    without one), the last step's train loss, steps, skipped steps, tokens, mean tokens/s and MFU, peak memory, wall
    seconds and the steps' own seconds (train_s: what a max_seconds budget counts), the last HellaSwag acc_norm and
    suite scores (mc_centered, mc/<task>_acc) where the run evaluated them, and `extra` (train.py: params,
    params_lookup, max_seconds). A diverged run (or one halted out of memory) has no final losses: they are None,
    never an earlier finite value."""
    last = lambda key: next((r for r in reversed(records) if key in r), {})  # noqa: E731
    result = {
        "status": status,
        "val_loss": None,
        **last("val_loss"),
        "train_loss": summary["final_train_loss"],
        **{k: summary[k] for k in ("steps", "skipped_steps", "tokens")},
        "tokens_per_s": summary["mean_tokens_per_s"],
        "mfu": summary["mean_mfu"],
        "peak_mem_mb": summary["peak_mem_mb"],
        "wall_s": summary["wall_s"],
        "train_s": sum(r.get("step_ms") or 0 for r in records if "train_loss" in r) / 1000,
        **dict(extra),
    }
    if "hellaswag_acc_norm" in summary:
        result["hellaswag_acc_norm"] = summary["hellaswag_acc_norm"]
    result.update(last("mc_centered"))
    result.pop("step", None)
    if status in ("diverged", "oom"):
        result.update({k: None for k in result if k == "train_loss" or k.startswith("val")})
    return {k: json_safe(v) for k, v in result.items()}


def project_commit(root=Path(__file__).resolve().parent.parent):
    """(git HEAD, whether tracked files differ from it) of the project's checkout; (None, None) when it is not one."""
    if not (root / ".git").exists():
        return None, None
    git = lambda *args: subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    try:
        head, changes = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git installed
        return None, None
    return (head.stdout.strip(), bool(changes.stdout.strip())) if head.returncode == 0 else (None, None)


def append_ledger(path, result, argv, out_dir):
    """Append one JSON line for a run that ended to the ledger at `path` (the `ledger` key): its result (status
    included), the project's commit and whether the checkout had changes (`dirty`), argv, out_dir and when it ended.
    One write under flock(2): lines of concurrent runs never interleave; a line a killed writer left half-written is
    ended first. A ledger that cannot be written is a note, not an error: the run itself is done."""
    commit, dirty = project_commit()
    ended = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {
        **result,
        "commit": commit,
        "dirty": dirty,
        "argv": list(argv),
        "out_dir": str(out_dir),
        "ended_at": ended,
    }
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            size = f.seek(0, os.SEEK_END)
            torn = size > 0 and f.seek(size - 1) >= 0 and f.read(1) != b"\n"  # "a" mode: writes go to the end
            f.write((("\n" if torn else "") + json.dumps(record) + "\n").encode())
    except OSError as e:
        log(f"ledger {path} not written: {first_line(e)}", note=True)


def summary_text(s, path):
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
    status = s["result"]["status"]
    lines = [
        f"summary ({path}){'' if status == 'ok' else f', {status}'}: {s['steps']} steps, {s['tokens']:,} tokens in "
        f"{s['wall_s']:.1f} s | "
        f"{fmt(s['mean_tokens_per_s'], ',.0f')} tokens/s, mfu {fmt(s['mean_mfu'], '.1%')} | "
        f"peak memory {fmt(s['peak_mem_mb'], ',.0f')} MiB"
    ]
    loss = f"  train loss {fmt(s['final_train_loss'], '.4f')}"
    if s["final_val_loss"] is not None:
        loss += f" | val loss {s['final_val_loss']:.4f} (best {s['best_val_loss']:.4f} at step {s['best_val_step']})"
    if s["final_val_bpb"] is not None:
        loss += f" | val {s['final_val_bpb']:.4f} bits/byte"
    if "hellaswag_acc_norm" in s:
        loss += f" | hellaswag acc_norm {s['hellaswag_acc_norm']:.4f} ({s['hellaswag_n']} examples)"
    if "mc_centered" in s:
        loss += f" | mc_centered {s['mc_centered']:.4f}"
    if s["skipped_steps"]:
        loss += f" | {s['skipped_steps']} skipped steps"
    lines.append(loss)
    names = [k[len("tokens/") :] for k in s if k.startswith("tokens/")]
    if names:  # a mixture
        per = [
            f"{n}: {s[f'tokens/{n}']:,} tokens"
            + (f", val loss {s[f'val/{n}_loss']:.4f}" if f"val/{n}_loss" in s else "")
            + (f" ({s[f'val/{n}_bpb']:.4f} bits/byte)" if f"val/{n}_bpb" in s else "")
            for n in names
        ]
        lines.append("  " + " | ".join(per))
    if "cost_usd" in s:
        lines.append(
            f"  cost ${s['cost_usd']:,.4f} at ${s['cost_per_hour']:,.2f}/h: "
            f"{fmt(s['tokens_per_dollar'], ',.0f')} tokens per dollar"
        )
    lines.append(f"result: {json.dumps(s['result'])}")  # the last line: one JSON object to grep for
    return "\n".join(lines)
