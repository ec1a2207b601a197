"""plot_metrics.py: reading runs' metrics.jsonl, the overlay plot of several runs, --compare, its one-line errors."""

import json
import sys

import pytest

import plot_metrics
from test_tracking import json_form, loop_records


def write_metrics(run_dir, records):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in json_form(records)))
    return run_dir


def test_compare_identical_runs_is_zero(tmp_path, capsys):
    a = write_metrics(tmp_path / "a", loop_records(0, 8))
    b = write_metrics(tmp_path / "b", loop_records(0, 8))
    result = plot_metrics.compare(a, b)
    assert result["train_loss"] == {"steps": 7, "first": 1, "last": 8, "max_abs_diff": 0.0, "mean_abs_diff": 0.0}
    assert result["grad_norm"]["max_abs_diff"] == 0.0 and result["final_val_loss"] == [4.0 - 8 / 10 + 1] * 2
    assert plot_metrics.main(["--compare", str(a), str(b)]) == 0
    printed = capsys.readouterr().out
    assert "train_loss  over 7 common steps (1..8): max |a-b| 0.000e+00, mean |a-b| 0.000e+00" in printed
    assert "|a-b| 0.000e+00" in printed.splitlines()[-1]
    assert "hellaswag_acc_norm      a 0.2600 (step 4), b 0.2600 (step 4), max |a-b| at common steps 0.0000" in printed


def test_lines_that_are_json_but_not_records_are_skipped_like_half_written_ones(tmp_path, capsys):
    a = write_metrics(tmp_path / "a", loop_records(0, 8))
    b = write_metrics(tmp_path / "b", loop_records(0, 8))
    with open(b / "metrics.jsonl", "a") as f:
        f.write('5\nnull\n[1, 2]\n"text"\n{"step": 9, "train_lo')
    assert plot_metrics.read_metrics(b) == plot_metrics.read_metrics(a)
    assert plot_metrics.main(["--compare", str(a), str(b)]) == 0
    assert "max |a-b| 0.000e+00" in capsys.readouterr().out


def test_compare_different_runs_over_their_common_steps(tmp_path, capsys):
    a = write_metrics(tmp_path / "a", loop_records(0, 8))
    b_records = loop_records(0, 6, offset=0.5)  # shorter, and its losses 0.5 higher
    b_records[3]["train_loss"] += 0.25  # step 3: 0.75 higher
    b = write_metrics(tmp_path / "b", b_records)
    result = plot_metrics.compare(a, b)
    # steps 1-5 in both (6 is a skipped step with no loss; 7-8 only in a)
    assert result["train_loss"]["steps"] == 5 and result["train_loss"]["last"] == 5
    assert result["train_loss"]["max_abs_diff"] == pytest.approx(0.75)
    assert result["train_loss"]["mean_abs_diff"] == pytest.approx((4 * 0.5 + 0.75) / 5)
    assert result["grad_norm"]["max_abs_diff"] == 0.0  # gradient norms were not shifted
    assert result["final_val_loss"] == pytest.approx([4.2, 4.0 - 0.6 + 0.5])
    assert result["final_val_step"] == [8, 6]
    plot_metrics.main(["--compare", str(a), str(b)])
    assert "max |a-b| 7.500e-01" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        plot_metrics.main(["--compare", str(a)])
    assert exit_.value.code == 2 and "--compare takes exactly two runs, got 1" in capsys.readouterr().err


def test_overlay_plot_of_several_runs(tmp_path, capsys):
    a = write_metrics(tmp_path / "fp32", loop_records(0, 8))
    b = write_metrics(tmp_path / "bf16", loop_records(0, 8, offset=0.1))
    saved = {}
    import matplotlib.figure

    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, path, **kwargs):
        saved["titles"] = [ax.get_title() for ax in fig.axes]
        saved["labels"] = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes]
        real_savefig(fig, path, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "savefig", savefig)
        assert plot_metrics.main([str(a), str(b), "-o", str(tmp_path / "cmp.png")]) == 0
    assert (tmp_path / "cmp.png").stat().st_size > 0
    assert saved["titles"] == ["loss", "gradient norm", "learning rate", "tokens / s", "evaluations"]
    assert saved["labels"][0] == ["fp32 train", "fp32 val", "bf16 train", "bf16 val"]
    assert saved["labels"][1] == ["fp32", "bf16"]
    assert saved["labels"][4] == ["fp32 hellaswag_acc_norm", "bf16 hellaswag_acc_norm"]  # the runs log HellaSwag


def test_plot_without_matplotlib_is_one_line_naming_the_install(tmp_path, monkeypatch):
    run = write_metrics(tmp_path / "run", loop_records(0, 4))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: `import matplotlib` fails
    with pytest.raises(SystemExit) as stop:
        plot_metrics.main([str(run)])
    assert str(stop.value) == "plot_metrics.py needs matplotlib, an optional extra: pip install matplotlib"
    assert not (run / "metrics.png").exists()


def test_plot_metrics_reads_runs_and_explains_missing_matplotlib(tmp_path, monkeypatch, capsys):

    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "val_loss": 4.2}\n{"step": 1, "train_loss": 4.1, "lr": 0.1, "tokens_per_s": 9.0}\n'
        '{"step": 2, "train_loss": null, "lr": 0.2, "skipped": "non-finite loss"}\n'
        '{"step": 2, "hellaswag_acc": 0.25, "hellaswag_acc_norm": 0.26, "hellaswag_n": 10}\n{"step": 3, "trai'
    )
    steps, val, hellaswag = plot_metrics.read_metrics(tmp_path)
    assert [r["step"] for r in steps] == [1, 2] and val == [{"step": 0, "val_loss": 4.2}] and len(hellaswag) == 1
    assert plot_metrics.series(steps, "train_loss") == ([1], [4.1])  # the skipped step has no loss to plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit, match="needs matplotlib, an optional extra: pip install matplotlib"):
        plot_metrics.main([str(tmp_path)])
    assert plot_metrics.main([str(tmp_path / "nope")]) == 2
    assert "no such metrics file" in capsys.readouterr().err


def test_a_mixtures_val_bpb_and_sources_are_plotted_and_compared(tmp_path, capsys):
    from test_tracking import mixture_records

    a = write_metrics(tmp_path / "mix", mixture_records())
    b_records = [
        {**r, "val/b_bpb": r["val/b_bpb"] + 0.05} if "val/b_bpb" in r else r for r in mixture_records()
    ]  # source b 0.05 bits/byte worse
    b = write_metrics(tmp_path / "other", b_records)
    saved = {}
    import matplotlib.figure

    def savefig(fig, path, **kwargs):
        saved["titles"] = [ax.get_title() for ax in fig.axes]
        saved["labels"] = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "savefig", savefig)
        assert plot_metrics.main([str(a), str(b), "-o", str(tmp_path / "cmp.png")]) == 0
    assert saved["titles"] == ["loss", "gradient norm", "learning rate", "tokens / s", "val bits / byte", "evaluations"]
    assert saved["labels"][0][:4] == ["mix train", "mix val", "mix val a", "mix val b"]
    assert saved["labels"][4] == ["mix", "mix a", "mix b", "other", "other a", "other b"]

    result = plot_metrics.compare(a, b)
    assert result["val/b_bpb"]["max_abs_diff"] == pytest.approx(0.05) and result["val/a_bpb"]["max_abs_diff"] == 0
    assert result["val_bpb"]["last"] == [2.1, 2.1] and result["val/a_loss"]["steps"] == [8, 8]
    capsys.readouterr()
    plot_metrics.main(["--compare", str(a), str(b)])
    printed = capsys.readouterr().out
    assert "val/b_bpb               a 2.3333 (step 8), b 2.3833 (step 8), max |a-b| at common steps 0.0500" in printed
