"""console.py: the one progress bar, shown on a terminal and out of the way when the output goes to a file."""

import io
import sys

import prepare_data
from gpt2train.console import progress_bar
from test_data import make_docs, write_jsonl


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_progress_bar_shows_on_a_terminal_and_steps_aside_in_a_file(monkeypatch):
    for stderr, show, drawn in [(Terminal(), True, True), (io.StringIO(), True, False), (Terminal(), False, False)]:
        monkeypatch.setattr(sys, "stderr", stderr)
        for _ in progress_bar(range(3), show=show, desc="work"):
            pass
        assert ("work" in stderr.getvalue()) == drawn, (type(stderr).__name__, show)


def test_a_prep_logged_to_a_file_has_no_bar_redraws_between_its_lines(tmp_path, capsys):
    """`python prepare_data.py ... > log 2>&1`: stderr is a file, so the lines are all there is (no '\\r' redraws)."""
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(60, seed=7))
    prepare_data.main(
        [
            "--input",
            str(src),
            "--out_dir",
            str(tmp_path / "out"),
            "--shard_tokens",
            "300",
            "--val_tokens",
            "200",
            "--num_proc",
            "1",
        ]
    )
    out, err = capsys.readouterr()
    assert out and "\r" not in out + err and "tokenizing" not in err
