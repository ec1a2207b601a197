"""Run train.py commands as supervised child processes and collect their results: the runner under compare.py (and
the commands that run many train.py runs: a ladder, a sweep).

    jobs = [Job("baseline/seed1337", ["configs/shakespeare_cpu.py", "--max_steps=50"], 1337, out / "b" / "seed1337")]
    with lock(out, "compare.py"):
        records = run_jobs(jobs, out, jobs=2, metric="val_loss", done=earlier, on_run=save)

A Job is one train.py run: its key (unique: what a later call resumes it by), its train.py arguments, its seed, its
out_dir and optionally a torchrun process count. run_jobs(todo, out_dir) runs the Jobs that `done` (the records an
earlier call returned) does not hold finished, `jobs` at once, in waves: up to `jobs` runs start together (give
them in seed order, and the runs of one seed start together, so a drifting machine slows them alike); the next
wave starts when the last run of this one ended. Every run gets --seed, --out_dir and
--ledger=<out_dir>/ledger.jsonl appended (they win over its config files), its console output goes to
`<its out_dir>.log`, and after each run on_run(key, record, made) lets the caller rewrite its JSON. A record: key,
seed, status (train.py's: ok, diverged, oom, interrupted - also a run killed by SIGTERM/SIGINT before it could
save -, error), value (the result's `metric`), result (the whole `result:` dict), tokens_per_s, params,
params_lookup, started_at, seconds, exit_code, out_dir, threads / devices (what the run was given).

Finished (ok, diverged, oom: a deterministic run would end the same) runs are kept; an interrupted or failed run
(error) is made again, its old directory moved aside to `<out_dir>.unfinished`. Every path is made absolute once, and
the runs start in the caller's working directory (a relative --data_dir means what it means to train.py there).

Side by side (`jobs` > 1): on a CUDA node each run gets its own device(s) through CUDA_VISIBLE_DEVICES (a torchrun
job as many as its process count; `jobs` times that must fit the node); on a CPU each run gets
torch.get_num_threads() // jobs threads (OMP_NUM_THREADS), so the runs never oversubscribe the cores. A run's
numbers on a CPU depend on its thread count (the order of a matmul's sums), not on what runs beside it: `--jobs 2`
on 2 cores equals `--jobs 1` under OMP_NUM_THREADS=1 bit for bit, but not `--jobs 1` with 2 threads.

Supervision: each run is in its own process group (a terminal's Ctrl-C reaches the runner, which forwards it once)
and, on Linux, dies with the runner (PR_SET_PDEATHSIG: SIGTERM, so it saves first). SIGTERM or SIGINT to the runner
is forwarded to the running runs (train.py saves and exits 5); the runner waits for them, reports them through
on_run and raises Interrupted (exit code 128 + the signal). A run that exits 2 (bad input: nothing trained) stops the
whole call: BadRun, with train.py's one line. lock(out_dir, program) holds the out_dir as train.py holds its own.
"""

import contextlib
import ctypes
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpt2train.files import directory_lock
from gpt2train.tracking import EXIT_CODES

ROOT = Path(__file__).resolve().parent.parent
TRAIN_PY = ROOT / "train.py"
HEAD_DIM = 64  # a size's heads: n_embd // HEAD_DIM (GPT-2's 64 at every size from 124M to 1.5B)
FINISHED = ("ok", "diverged", "oom")  # kept by a later call; interrupted and error runs are made again
SET_BY_RUNNER = ("seed", "out_dir", "ledger")
PR_SET_PDEATHSIG = 1


class RunnerError(ValueError):
    """Bad input (a size, a metric, more jobs than devices): the message is one line."""


class BadRun(RunnerError):
    """A run exited 2: its arguments are bad input (train.py's one line in the message); nothing else was started."""


class Interrupted(Exception):
    """SIGTERM/SIGINT reached the runner: its runs were stopped (saved, status interrupted) and reported."""

    def __init__(self, signum):
        super().__init__(
            f"interrupted by {signal.Signals(signum).name}: the runs stopped and saved; run the same "
            "command again to go on"
        )
        self.signum = signum
        self.exit_code = 128 + signum


def parse_size(text):
    """(n_layer, n_embd) of a size written 'LxW' (e.g. '4x256'); RunnerError unless W is a multiple of HEAD_DIM."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise RunnerError(f"size {text!r}: expected n_layer x n_embd, e.g. 4x256")
    n_layer, n_embd = int(match[1]), int(match[2])
    if n_embd % HEAD_DIM:
        raise RunnerError(f"size {text!r}: the width {n_embd} must be a multiple of the head dimension {HEAD_DIM}")
    return n_layer, n_embd


def size_args(n_layer, n_embd):
    """train.py's arguments for a size: its depth, width and n_embd // HEAD_DIM heads (the model has no separate
    key/value head count, so this is all either recipe needs)."""
    return [f"--n_layer={n_layer}", f"--n_embd={n_embd}", f"--n_head={n_embd // HEAD_DIM}"]


@dataclass
class Job:
    """One train.py run: key (unique, what a later call resumes it by), args (train.py's arguments, without
    --seed/--out_dir/--ledger), seed, out_dir (made absolute), nproc (None, or torchrun's --nproc_per_node)."""

    key: str
    args: list
    seed: int
    out_dir: Path
    nproc: int | None = None

    def __post_init__(self):
        self.out_dir = Path(self.out_dir).absolute()

    @property
    def log_path(self):
        return self.out_dir.with_name(self.out_dir.name + ".log")


def train_command(job, ledger):
    """The command line of a Job's run: this interpreter's train.py, or its torch.distributed.run (torchrun)."""
    launcher = [sys.executable]
    if job.nproc is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={job.nproc}"]
    own = [f"--seed={job.seed}", f"--out_dir={job.out_dir}", f"--ledger={ledger}"]
    return [*launcher, str(TRAIN_PY), *job.args, *own]


def lock(out_dir, program):
    """Hold out_dir for a with block as train.py holds its own (files.directory_lock): a second process on it
    gets a LockError naming the holder."""
    return directory_lock(Path(out_dir).absolute(), program)


def slot_envs(jobs, nproc=None):
    """The environment each of `jobs` side-by-side slots adds to its runs: on a CUDA node its own devices
    (CUDA_VISIBLE_DEVICES; nothing with jobs=1), on a CPU its share of the threads (OMP_NUM_THREADS)."""
    import torch

    if jobs < 1:
        raise RunnerError(f"--jobs must be >= 1, got {jobs}")
    count = torch.cuda.device_count()
    if count > 0:
        per = nproc or 1
        if jobs * per > count:
            raise RunnerError(f"--jobs {jobs} needs {jobs * per} GPUs ({per} per run); this node has {count}")
        if jobs == 1:
            return [{}]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(count)))).split(",")[:count]
        return [{"CUDA_VISIBLE_DEVICES": ",".join(visible[i * per : (i + 1) * per])} for i in range(jobs)]
    threads = torch.get_num_threads()
    if jobs > threads:
        raise RunnerError(f"--jobs {jobs} is more runs than this machine's {threads} threads")
    return [{"OMP_NUM_THREADS": str(threads // jobs)} for _ in range(jobs)]


def die_with_parent(parent):
    """A child's preexec_fn: its own process group (a terminal's Ctrl-C goes to the runner, which forwards it once)
    and, on Linux, SIGTERM when the runner dies (kill -9 included)."""

    def setup():
        os.setpgrp()
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the runner died before prctl
                os._exit(1)

    return setup


def error_line(log_path):
    """The one line a run that exited 2 printed (its last '...: error: ...' line, else its last line)."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    return (errors or lines or ["(no output)"])[-1].strip()


def read_result(log_path):
    """The last `result: {...}` line of a run's log as a dict ({} without one)."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    lines = [line for line in text.splitlines() if line.startswith("result: ")]
    try:
        return json.loads(lines[-1][len("result: ") :]) if lines else {}
    except ValueError:
        return {}


def check_metric(metric, result, log_path):
    """RunnerError unless `metric` is a number (or null) in an ok run's result: checked at the first result."""
    if metric not in result:
        fields = ", ".join(k for k in result if not k.startswith("mc/"))
        raise RunnerError(f"--metric {metric!r} is not in the result of {log_path}; its fields: {fields}")
    value = result[metric]
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise RunnerError(
            f"--metric {metric!r} is not a number in the result of {log_path} ({value!r}): choose a numeric field"
        )


def record(job, code, started, seconds, metric, env):
    """A finished run's record (the module docstring lists its fields)."""
    result = read_result(job.log_path)
    codes = {c: s for s, c in EXIT_CODES.items()} | {-signal.SIGTERM: "interrupted", -signal.SIGINT: "interrupted"}
    status = result.get("status") or codes.get(code, "error")
    if status == "ok" and metric is not None:
        check_metric(metric, result, job.log_path)
    return {
        "key": job.key,
        "seed": job.seed,
        "status": status,
        "value": result.get(metric) if metric is not None else None,
        "result": result,
        **{k: result.get(k) for k in ("tokens_per_s", "params", "params_lookup")},
        "started_at": started,
        "seconds": seconds,
        "exit_code": code,
        "out_dir": str(job.out_dir),
        "threads": int(env["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in env else None,
        "devices": env.get("CUDA_VISIBLE_DEVICES"),
    }


class Supervisor:
    """SIGTERM/SIGINT while runs train: forwarded to each running run (train.py saves and exits 5), remembered so no
    new run starts. Installed only in the main thread (signals are delivered there); the old handlers come back."""

    def __init__(self):
        self.signal, self.running, self.old = None, {}, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self.forward) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)

    def forward(self, signum, frame=None):
        self.signal = signum
        for process in list(self.running.values()):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)


def start(job, ledger, env, supervisor):
    """Start a Job's run (its old unfinished directory moved aside); returns its Popen."""
    if job.out_dir.exists():  # started before and not finished: made again
        unfinished = job.out_dir.with_name(job.out_dir.name + ".unfinished")
        shutil.rmtree(unfinished, ignore_errors=True)
        job.out_dir.rename(unfinished)
    job.out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(job.log_path, "w") as log_file:
        process = subprocess.Popen(
            train_command(job, ledger),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            preexec_fn=die_with_parent(os.getpid()),
        )
    supervisor.running[job.key] = process
    if supervisor.signal is not None:  # a signal that came while it started
        supervisor.forward(supervisor.signal)
    return process


def reusable(job, done):
    """The earlier record of a Job when that run finished (FINISHED), its out_dir updated to where it is now."""
    earlier = (done or {}).get(job.key)
    if earlier is None or earlier.get("status") not in FINISHED:
        return None
    return {**earlier, "out_dir": str(job.out_dir)}


def run_jobs(todo, out_dir, *, jobs=1, metric=None, done=None, on_run=None):
    """Run the Jobs (module docstring) into out_dir; {key: record} of all of them, the kept ones included.

    metric: the result field a record's `value` holds (checked at the first ok result: RunnerError). done: {key:
    record} from an earlier call. on_run(key, record, made): after each run, made=False for a kept one. Raises
    Interrupted (after the stopped runs were reported), BadRun (a run exited 2: the others stopped first)."""
    out_dir, records = Path(out_dir).absolute(), {}
    ledger = out_dir / "ledger.jsonl"
    if len({job.key for job in todo}) < len(todo):
        raise RunnerError("two jobs share a key")
    pending = []
    for job in todo:
        kept = reusable(job, done)
        if kept is None:
            pending.append(job)
        else:
            records[job.key] = kept
            on_run and on_run(job.key, kept, False)
    if not pending:
        return records
    envs = slot_envs(jobs, max((job.nproc or 1) for job in pending))
    with Supervisor() as supervisor:
        while pending and supervisor.signal is None:
            wave, pending = pending[:jobs], pending[jobs:]
            run_wave(wave, ledger, envs, supervisor, metric, lambda job, rec: keep(records, on_run, job, rec))
        if supervisor.signal is not None:
            raise Interrupted(supervisor.signal)
    return records


def keep(records, on_run, job, rec):
    records[job.key] = rec
    if on_run:
        on_run(job.key, rec, True)


def run_wave(wave, ledger, envs, supervisor, metric, done):
    """Start the wave's runs together, each in its slot's environment; done(job, record) as each one ends. A run
    that exits 2 or fails the metric check stops the others (SIGTERM: they save) and raises once all have ended."""
    started = {}
    for job, env in zip(wave, envs):
        started[job.key] = (
            job,
            env,
            datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            time.perf_counter(),
            start(job, ledger, env, supervisor),
        )
    failure = None
    while supervisor.running:
        time.sleep(0.05)
        for key, process in list(supervisor.running.items()):
            code = process.poll()
            if code is None:
                continue
            del supervisor.running[key]
            job, env, at, t0, _ = started[key]
            try:
                if code == 2:
                    raise BadRun(f"run {job.key}: {error_line(job.log_path)} (its log: {job.log_path})")
                done(job, record(job, code, at, time.perf_counter() - t0, metric, env))
            except RunnerError as e:
                failure = failure or e
                for other in supervisor.running.values():
                    with contextlib.suppress(ProcessLookupError):
                        other.send_signal(signal.SIGTERM)
    if failure is not None:
        raise failure


TEST_WORD = re.compile(r"(^|[_.-])test($|[_.-])")  # a test shard's name (prepare_data.py --test_input)


def check_test_shards(name, args):
    """--confirm (compare.py, sweep.py): RunnerError before anything trains when the data_dir that train.py arguments
    `args` name (each directory of a mixture) holds no test shards (named like the val ones with `test` for `val`)."""
    from gpt2train.config import ConfigError, TrainConfig, parse_args

    try:
        data_dir = parse_args(args).get("data_dir", TrainConfig.data_dir)
    except ConfigError:
        return  # the run says what is wrong (exit 2)
    for part in str(data_dir).split(","):
        path, _, weight = part.rpartition(":")
        directory = Path(path if path and re.fullmatch(r"[\d.eE+-]+", weight) else part)
        shards = directory.glob("*") if directory.is_dir() else []
        if not any(p.suffix in (".bin", ".npy") and TEST_WORD.search(p.stem) for p in shards):
            raise RunnerError(
                f"--confirm: {directory} holds no test shards ({name}); prepare them with "
                "prepare_data.py --test_input FILES"
            )


def evaluate_test(record):
    """{test_loss, test_bpb} of a run's final checkpoint (its record's out_dir): evaluate.py --split test --json's last
    line (RunnerError with evaluate.py's one line where it fails)."""
    out_dir = record["out_dir"]
    command = [sys.executable, str(ROOT / "evaluate.py"), "--ckpt", str(out_dir), "--split", "test", "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise RunnerError(f"--confirm: evaluate.py --split test on {out_dir}: {why}")
    result = json.loads(lines[-1])
    return {k: result.get(k) for k in ("test_loss", "test_bpb")}
