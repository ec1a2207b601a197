"""tracking.py: metrics.jsonl, the W&B and TensorBoard sinks (read back from what they wrote), resume
without duplicate steps, failing sinks, cost and the summary.

The records are shaped like train.py's loop writes them: a val line at step 0 and every 4 steps, a
HellaSwag line at step 4, a train line per step, one of them skipped (NaN loss) with its reason.
"""

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2train import tracking
from gpt2train.tracking import MetricsLog, Tracker, TrackingError, check_tracking_available

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"n_layer": 2, "learning_rate": 3e-3, "out_dir": "out/x", "lr_decay_steps": None}  # a run's config
CONFIG |= {"wandb_log": False, "wandb_project": "gpt2-train", "wandb_run_name": None}  # the tracking keys: defaults
CONFIG |= {"tensorboard_dir": None, "cost_per_hour": None}


def config(**keys):
    """CONFIG with these keys set (the tracking keys: what the Tracker tracks)."""
    return {**CONFIG, **keys}


TOKENS = 1024  # tokens per step


def train_record(step, offset=0.0):
    record = {
        "step": step,
        "train_loss": 4.2 - step / 20 + offset,
        "lr": 1e-3 * step,
        "grad_norm": 1 + step / 7,
        "tokens_per_s": 16000.0 + step,
        "mfu": 0.3 + step / 100,
        "step_ms": 64.0,
        "peak_mem_mb": 300.0 + step,
    }
    if step == 6:  # a skipped step, as train.py logs it
        record.update(train_loss=math.nan, grad_norm=math.nan, skipped="non-finite loss (loss nan, grad norm nan)")
    return record


def loop_records(start, stop, offset=0.0):
    """The metrics lines train.py's loop writes going from step `start` (0, or a checkpoint's) to `stop`."""
    out = []
    for step in range(start, stop + 1):
        if step > start or start == 0:  # a resumed run's first step was evaluated before it stopped
            if step % 4 == 0 or step == stop:
                out.append({"step": step, "val_loss": 4.0 - step / 10 + (step == 8) + offset})
            if step == 4:
                out.append({"step": 4, "hellaswag_acc": 0.25, "hellaswag_acc_norm": 0.26, "hellaswag_n": 10})
        if step < stop:
            out.append(train_record(step + 1, offset))
    return out


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))


# ----------------------------------------------------------------------------- reading back what the sinks wrote


def wandb_segments(out_dir):
    """[(run_id, config, {step: {key: value}})] of each offline run under out_dir/wandb, oldest first.
    A .wandb file is LevelDB's log format (32 KiB blocks of checksum/length/type-framed chunks) after a
    7-byte ':W&B' header, each record a wandb_internal_pb2.Record."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # run.finish() can return before wandb's service process has written the file out

    segments = []
    for path in sorted(Path(out_dir, "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, chunk, records = path.read_bytes(), 7, b"", []
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # no room for a chunk header: the block's tail is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST: a whole record
                records.append(wandb_internal_pb2.Record.FromString(chunk))
                chunk = b""
        run_id, config, history = None, {}, {}
        for r in records:
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
                config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in r.config.update})
            elif kind == "history":
                values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                row = history.setdefault(r.history.step.num, {})
                for key, value in values.items():
                    if not key.startswith("_"):
                        assert key not in row, f"step {r.history.step.num}: {key} logged twice"
                        row[key] = value
        config.pop("_wandb", None)
        segments.append((run_id, config, history))
    return segments


def tensorboard_events(log_dir):
    """({tag: [(step, value)]} of the scalars, {tag: [(step, text)]} of the texts) as the TensorBoard server
    reads them (its reader applies the purge markers of resumed runs)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    scalars, texts = {}, {}
    for tag in acc.Tags()["tensors"]:
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
        values = [(e.step, make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
        if plugin == "scalars":
            scalars[tag] = values
        else:
            assert plugin == "text", (tag, plugin)
            texts[tag.removesuffix("/text_summary")] = [(step, text.decode()) for step, text in values]
    return scalars, texts


def same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def expected_values(records):
    """{(step, key): value} of everything the sinks should hold (None means 'no value')."""
    return {(r["step"], k): v for r in records for k, v in r.items() if k != "step" and v is not None}


def assert_wandb_holds(history, records):
    want = expected_values(records)
    got = {(step, k): v for step, row in history.items() for k, v in row.items()}
    assert got.keys() == want.keys()
    assert all(same(float(got[k]) if isinstance(want[k], float) else got[k], want[k]) for k in want), [
        (k, got[k], want[k]) for k in want if not same(got[k], want[k])
    ]


def assert_tensorboard_holds(scalars, texts, records):
    want = expected_values(records)
    got = {(step, tag): value for tag, events in scalars.items() for step, value in events}
    got.update({(step, tag): text for tag, events in texts.items() if tag != "config" for step, text in events})
    assert got.keys() == want.keys()
    for key, value in want.items():  # TensorBoard stores scalars as float32
        assert same(got[key], value if isinstance(value, str) else float(np.float32(value))), (key, got[key], value)
    for tag, events in [*scalars.items(), *texts.items()]:
        if tag != "config":  # each process records the config it ran with
            assert len({step for step, _ in events}) == len(events), f"{tag}: a step logged twice"


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def json_form(records):
    return [{k: tracking.json_safe(v) for k, v in r.items()} for r in records]


# ----------------------------------------------------------------------------- the sinks


@pytest.mark.slow
def test_wandb_offline_and_tensorboard_receive_every_metric(tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    records = loop_records(0, 8)
    run_config = config(wandb_log=True, wandb_project="test", tensorboard_dir=str(tb))
    tracker = Tracker(out, run_config, TOKENS)
    for record in records:
        tracker.log(record)
    tracker.close()

    assert read_jsonl(out / "metrics.jsonl") == json_form(records)  # the source of truth, unchanged
    [(run_id, logged, history)] = wandb_segments(out)
    assert run_id == (out / "wandb_id.txt").read_text().strip() and logged == run_config
    assert history[6]["skipped"].startswith("non-finite loss") and math.isnan(history[6]["train_loss"])
    assert_wandb_holds(history, records)
    scalars, texts = tensorboard_events(tb)
    assert json.loads(texts["config"][0][1]) == run_config
    assert_tensorboard_holds(scalars, texts, records)
    assert [step for step, _ in scalars["train_loss"]] == list(range(1, 9))
    assert [step for step, _ in scalars["val_loss"]] == [0, 4, 8]


def test_resume_continues_the_same_runs_with_only_the_new_steps(tmp_path):
    """Stopped at the step-4 checkpoint, then resumed to step 8: one W&B id in two offline segments that
    hold steps 0-4 and 5-8; one TensorBoard directory with each step once."""
    out, tb = tmp_path / "run", tmp_path / "tb"
    tracking = dict(wandb_log=True, wandb_project="test", tensorboard_dir=str(tb))
    first = Tracker(out, config(**tracking), TOKENS)
    for record in loop_records(0, 4):
        first.log(record)
    state = first.state_dict()  # what the step-4 checkpoint holds
    first.close()
    resumed_config = config(**tracking, max_steps=8)
    second = Tracker(out, resumed_config, TOKENS, resume_step=4, state=state)
    for record in loop_records(4, 8):
        second.log(record)
    second.close()

    (id_a, _, hist_a), (id_b, config_b, hist_b) = wandb_segments(out)
    assert id_a == id_b == state["wandb_id"] == (out / "wandb_id.txt").read_text().strip()
    assert max(hist_a) == 4 and min(hist_b) == 5 and config_b == resumed_config
    assert_wandb_holds({**hist_a, **hist_b}, loop_records(0, 8))  # every value once (no step in both)
    assert_tensorboard_holds(*tensorboard_events(tb), loop_records(0, 8))
    assert read_jsonl(out / "metrics.jsonl") == json_form(loop_records(0, 8))
    assert json.loads((out / "summary.json").read_text())["tokens"] == 8 * TOKENS


def test_resume_after_a_kill_replaces_the_steps_after_the_checkpoint(tmp_path):
    """A run killed at step 7 had logged steps 5-7 past its step-4 checkpoint; the resumed run redoes them
    (here with other values): metrics.jsonl and TensorBoard show only the redone ones."""
    out, tb = tmp_path / "run", tmp_path / "tb"
    first = Tracker(out, config(tensorboard_dir=str(tb)), TOKENS)
    for record in loop_records(0, 4):
        first.log(record)
    state = first.state_dict()
    for record in loop_records(4, 7)[:-1]:  # steps 5-7, killed before the last val line
        first.log(record)
    first.state_dict()  # flush, as a later checkpoint attempt would; the process then dies
    second = Tracker(out, config(tensorboard_dir=str(tb)), TOKENS, resume_step=4, state=state)
    redone = loop_records(4, 8, offset=1.0)
    for record in redone:
        second.log(record)
    second.close()
    first.sinks[0].close(0)
    first.metrics.file.close()
    expected = loop_records(0, 4) + redone
    assert read_jsonl(out / "metrics.jsonl") == json_form(expected)
    assert_tensorboard_holds(*tensorboard_events(tb), expected)


def test_a_missing_package_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    for kwargs, expected in (
        (dict(wandb_log=True), "wandb_log=True needs the wandb package, an optional extra: pip install wandb"),
        (
            dict(tensorboard_dir="tb"),
            "tensorboard_dir='tb' needs the tensorboard package, an optional extra: pip install tensorboard",
        ),
    ):
        with pytest.raises(TrackingError) as err:
            Tracker(tmp_path / "run", config(**kwargs), TOKENS)
        assert str(err.value).startswith(expected) and "\n" not in str(err.value)
        with pytest.raises(TrackingError, match="pip install"):
            check_tracking_available(kwargs.get("wandb_log", False), kwargs.get("tensorboard_dir"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before touching the run
    check_tracking_available(False, None)
    tracker = Tracker(tmp_path / "run", CONFIG, TOKENS)  # without the sinks nothing needs them
    tracker.log(train_record(1))
    tracker.close()
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == [train_record(1)]


def test_wandb_dir_is_honoured_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    out = tmp_path / "run"
    tracker = Tracker(out, config(wandb_log=True, wandb_project="test"), TOKENS)
    tracker.log(train_record(1))
    tracker.close()
    assert not (out / "wandb").exists()
    [(run_id, _, history)] = wandb_segments(tmp_path / "elsewhere")
    assert (
        run_id == (out / "wandb_id.txt").read_text().strip()
        and history[1]["train_loss"] == train_record(1)["train_loss"]
    )


def test_wandb_refusing_to_start_is_a_one_line_error(tmp_path, monkeypatch):
    import wandb

    def init(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])\nmore")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(TrackingError) as err:
        Tracker(tmp_path / "run", config(wandb_log=True), TOKENS)
    assert str(err.value) == (
        "wandb.init failed (UsageError: api_key not configured (no-tty). call wandb.login("
        "key=[your_api_key])); log in (`wandb login`), record offline with WANDB_MODE=offline, "
        "or set wandb_log=False"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_sink_that_raises_mid_run_is_reported_once_and_disabled(tmp_path, monkeypatch, capsys):
    from torch.utils.tensorboard.writer import FileWriter

    real_add_summary, calls = FileWriter.add_summary, [0]

    def add_summary(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] >= 5:  # the config, val step 0, train steps 1 and 2, then the disk is full
            raise OSError(28, "No space left on device")
        return real_add_summary(self, *args, **kwargs)

    monkeypatch.setattr(FileWriter, "add_summary", add_summary)
    out, tb = tmp_path / "run", tmp_path / "tb"
    records = loop_records(0, 8)
    tracker = Tracker(out, config(wandb_log=True, wandb_project="test", tensorboard_dir=str(tb)), TOKENS)
    for record in records:
        tracker.log(record)
    tracker.state_dict()
    text = tracker.close()
    err = capsys.readouterr().err
    assert err.count("tracking: tensorboard failed (OSError: [Errno 28] No space left on device); disabled") == 1
    assert calls[0] == 5  # never called again once it failed
    assert read_jsonl(out / "metrics.jsonl") == json_form(records)  # the source of truth is complete
    assert_wandb_holds(wandb_segments(out)[0][2], records)  # and the healthy sink got everything
    assert "8 steps" in text


# ----------------------------------------------------------------------------- cost and summary


def fake_clock(monkeypatch, seconds_per_call):
    now = [1000.0]

    def perf_counter():
        now[0] += seconds_per_call
        return now[0]

    monkeypatch.setattr(tracking.time, "perf_counter", perf_counter)


def test_cost_is_cumulative_across_a_resume(tmp_path, monkeypatch):
    """$36/h = $0.01/s; the fake clock moves 2 s per reading: one at start, one per train line."""
    fake_clock(monkeypatch, 2.0)
    out = tmp_path / "run"
    first = Tracker(out, config(cost_per_hour=36.0), TOKENS)
    for record in loop_records(0, 4):
        first.log(record)
    state = first.state_dict()  # 4 train lines: 8 s, then this reading: 10 s
    first.close()
    second = Tracker(out, config(cost_per_hour=36.0), TOKENS, resume_step=4, state=state)
    for record in loop_records(4, 8):
        second.log(record)
    second.close()
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "train_loss" in r]
    costs = [r["cost_usd"] for r in train]
    assert costs == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.12, 0.14, 0.16, 0.18])  # +2 s: the checkpoint's read
    assert [r["tokens_per_dollar"] for r in train] == pytest.approx(
        [TOKENS * r["step"] / c for r, c in zip(train, costs)]
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cost_per_hour"] == 36.0 and summary["tokens"] == 8 * TOKENS
    assert summary["wall_s"] == pytest.approx(20.0) and summary["cost_usd"] == pytest.approx(0.20)
    assert summary["tokens_per_dollar"] == pytest.approx(8 * TOKENS / 0.20)


def test_summary_json_and_console_summary(tmp_path):
    out = tmp_path / "run"
    tracker = Tracker(out, CONFIG, TOKENS)
    records = loop_records(0, 8)
    records[1]["step_ms"] = 5000.0  # step 1 includes torch.compile: left out of the means
    records[3]["mfu"], records[3]["step_ms"] = 0.6, 192.0  # step 3: a slower step, weighted by its time
    for record in records:
        tracker.log(record)
    text = tracker.close()
    summary = json.loads((out / "summary.json").read_text())
    timed = [train_record(s) for s in range(2, 9)]
    step_s = [0.192 if r["step"] == 3 else 0.064 for r in timed]
    mfu = [0.6 if r["step"] == 3 else r["mfu"] for r in timed]
    assert summary["mean_tokens_per_s"] == pytest.approx(7 * TOKENS / sum(step_s))
    assert summary["mean_mfu"] == pytest.approx(sum(m * s for m, s in zip(mfu, step_s)) / sum(step_s))
    assert summary["wall_s"] > 0
    del summary["mean_tokens_per_s"], summary["mean_mfu"], summary["wall_s"], summary["result"]
    assert summary == {
        "steps": 8,
        "tokens": 8 * TOKENS,
        "final_train_loss": 4.2 - 8 / 20,
        "final_val_loss": 4.0 - 0.8 + 1,
        "final_val_bpb": None,  # the records have none
        "best_val_loss": 4.0 - 0.4,
        "best_val_step": 4,
        "skipped_steps": 1,
        "peak_mem_mb": 308.0,
        "hellaswag_step": 4,
        "hellaswag_acc": 0.25,
        "hellaswag_acc_norm": 0.26,
        "hellaswag_n": 10,
    }
    assert "8 steps, 8,192 tokens" in text and "best 3.6000 at step 4" in text and "acc_norm 0.2600" in text
    assert "1 skipped steps" in text and "cost" not in text


def test_the_result_is_the_summarys_last_line_and_in_summary_json(tmp_path):
    """One JSON line for sweeps: the last val record's numbers (whatever it holds: val_bpb too), the last HellaSwag
    acc_norm and suite scores, and the run's totals."""
    out = tmp_path / "run"
    tracker = Tracker(out, CONFIG, TOKENS)
    records = loop_records(0, 8)
    records[-1]["val_bpb"] = 1.25  # the final val record (step 8) with a metric this file does not name
    for record in [*records, {"step": 8, "mc_centered": 0.1, "mc/piqa_acc": 0.55}]:
        tracker.log(record)
    text = tracker.close()
    result = json.loads((out / "summary.json").read_text())["result"]
    assert text.splitlines()[-1] == f"result: {json.dumps(result)}"
    wall_s, tokens_per_s, mfu = result.pop("wall_s"), result.pop("tokens_per_s"), result.pop("mfu")
    assert wall_s > 0 and tokens_per_s == pytest.approx(TOKENS / 0.064) and 0.3 < mfu < 0.4
    assert result.pop("train_s") == pytest.approx(8 * 0.064)  # every step's own seconds, the first one's too
    assert result == {
        "status": "ok",
        "val_loss": 4.0 - 0.8 + 1,  # the final one, not the best
        "val_bpb": 1.25,
        "train_loss": 4.2 - 8 / 20,
        "steps": 8,
        "skipped_steps": 1,
        "tokens": 8 * TOKENS,
        "peak_mem_mb": 308.0,
        "hellaswag_acc_norm": 0.26,
        "mc_centered": 0.1,
        "mc/piqa_acc": 0.55,
    }


@pytest.mark.parametrize("status", ["diverged", "oom", "interrupted"])
def test_a_run_that_did_not_finish_says_how_it_ended_and_a_diverged_one_has_no_final_losses(tmp_path, status):
    """A halt (diverged, out of memory) reports its final losses as None, never the last finite ones (step 0's val
    loss, step 1's train loss); an interrupted run keeps what it measured (it resumes); `extra` joins the result."""
    tracker = Tracker(tmp_path, CONFIG, TOKENS)
    for record in [*loop_records(0, 4), {**train_record(5), "train_loss": None, "skipped": "non-finite loss"}]:
        tracker.log(record)
    text = tracker.close(status, {"params": 1000, "params_lookup": 600})
    result = json.loads((tmp_path / "summary.json").read_text())["result"]
    assert result["status"] == status and result["skipped_steps"] == 1 and result["steps"] == 5
    assert result["params"] == 1000 and result["params_lookup"] == 600
    assert result["train_loss"] is None  # the last step's, never step 4's finite one
    assert (result["val_loss"] is None) == (status != "interrupted")
    assert text.startswith(f"summary ({tmp_path / 'summary.json'}), {status}: 5 steps")


def test_the_ledger_gets_one_whole_line_per_run_even_from_concurrent_writers(tmp_path):
    """8 processes append 25 long lines each at once: 200 lines, each whole JSON; a line a killed writer left
    half-written is ended first, so it spoils only itself."""
    ledger = tmp_path / "sub" / "ledger.jsonl"
    ledger.parent.mkdir()
    ledger.write_text('{"half": ')  # a torn line
    code = (
        "import sys; from gpt2train.tracking import append_ledger\n"
        "for i in range(25):\n"
        "    append_ledger(sys.argv[1], {'status': 'ok', 'pad': 'x' * 20000, 'i': i}, [sys.argv[2]], 'o')"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(ledger), str(w)], cwd=ROOT) for w in range(8)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    lines = ledger.read_text().splitlines()
    assert lines[0] == '{"half": ' and len(lines) == 201
    records = [json.loads(line) for line in lines[1:]]
    assert sorted((r["argv"][0], r["i"]) for r in records) == sorted((str(w), i) for w in range(8) for i in range(25))
    commit, dirty = tracking.project_commit()
    assert {r["commit"] for r in records} == {commit} and {r["dirty"] for r in records} == {dirty}
    assert all(r["out_dir"] == "o" and r["ended_at"].endswith("+00:00") for r in records)


def test_the_commit_is_none_outside_a_checkout(tmp_path):
    assert tracking.project_commit(tmp_path) == (None, None)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert tracking.project_commit()[0] == (head.stdout.strip() if head.returncode == 0 else None)


def test_summary_of_a_cpu_run_has_no_mfu(tmp_path):
    tracker = Tracker(tmp_path, CONFIG, TOKENS)
    for step in (1, 2, 3):
        tracker.log({**train_record(step), "mfu": None})
    tracker.close()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mean_mfu"] is None and summary["mean_tokens_per_s"] == pytest.approx(TOKENS / 0.064)
    assert summary["final_val_loss"] is None and "hellaswag_acc" not in summary and "cost_usd" not in summary
    assert summary["result"]["val_loss"] is None and summary["result"]["mfu"] is None  # every run has these keys


def test_metrics_log_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 0, "val_loss": 4.0}\n{"step": 1, "train_loss": 3.9}\n{"step": 2, "train_loss": 3.8}\n'
        '{"step": 3, "trai'
    )  # killed mid-line
    log = MetricsLog(path, resume_step=1)
    log.write({"step": 2, "train_loss": math.nan})
    log.file.close()
    assert read_jsonl(path) == [
        {"step": 0, "val_loss": 4.0},
        {"step": 1, "train_loss": 3.9},
        {"step": 2, "train_loss": None},
    ]
    MetricsLog(path).file.close()  # a fresh run starts empty
    assert path.read_text() == ""


def mixture_records():
    """loop_records of a run on a 0.75/0.25 mixture of sources a and b: val_bpb and each source's val loss and
    bits per byte beside val_loss, and the tokens each source supplied so far in every step's line."""
    out = []
    for r in loop_records(0, 8):
        if "val_loss" in r:
            r = {**r, "val_bpb": r["val_loss"] / 2, "val/a_loss": r["val_loss"] - 0.1, "val/a_bpb": r["val_loss"] / 2.1}
            r.update({"val/b_loss": r["val_loss"] + 0.3, "val/b_bpb": r["val_loss"] / 1.8})
        if "train_loss" in r:
            r = {**r, "tokens/a": 768 * r["step"], "tokens/b": 256 * r["step"]}
        out.append(r)
    return out


def test_a_mixtures_per_source_metrics_reach_every_sink_and_the_summary(tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    records = mixture_records()
    tracker = Tracker(out, config(wandb_log=True, wandb_project="test", tensorboard_dir=str(tb)), TOKENS)
    for record in records:
        tracker.log(record)
    text = tracker.close()
    assert read_jsonl(out / "metrics.jsonl") == json_form(records)
    [(_, _, history)] = wandb_segments(out)
    assert_wandb_holds(history, records)
    assert_tensorboard_holds(*tensorboard_events(tb), records)
    summary = json.loads((out / "summary.json").read_text())
    last = [r for r in records if "val_loss" in r][-1]
    assert summary["final_val_bpb"] == last["val_bpb"] and summary["tokens/a"] == 768 * 8
    assert {k: summary[k] for k in summary if k.startswith("val/")} == {k: last[k] for k in last if "/" in k}
    assert f"val {last['val_bpb']:.4f} bits/byte" in text
    assert (
        f"  a: 6,144 tokens, val loss {last['val/a_loss']:.4f} ({last['val/a_bpb']:.4f} bits/byte) | b: 2,048" in text
    )
