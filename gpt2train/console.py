"""The one way the library speaks, and the one answer to "which rank am I?".

log() is every progress line and note of a run or a script: rank 0 only (the other ranks see the same things),
through tqdm so a progress bar stays whole; progress_bar() is every bar, on a terminal only. is_rank0() and
launched_by_torchrun() read torchrun's environment, so they work before the process group exists; distributed()
says whether it does. A script's result (a sample's text, a --json line, a printed report) is the program's output,
not a note: it is printed in the script's main().

No torch import here: prepare_data's tokenizer workers import this through files.py.
"""

import os
import sys

from tqdm import tqdm


def is_rank0():
    """Rank 0 of torchrun's processes, or a plain `python train.py`; usable before the process group exists."""
    return os.environ.get("RANK", "0") == "0"


def launched_by_torchrun():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def distributed():
    """Whether this process is in an initialised torch.distributed process group (without importing torch: a
    process that never imported torch.distributed is in none)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def log(message, note=False, error=False):
    """Say something, from rank 0 only: a progress line on stdout, a note as 'note: ...' on stderr. An error
    (error=True: the line a script prints before it exits) goes to stderr from every node's first process, so
    every node's log says why it stopped."""
    if error:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            tqdm.write(message, file=sys.stderr)
            sys.stderr.flush()
    elif is_rank0():
        tqdm.write(f"note: {message}" if note else message, file=sys.stderr if note else sys.stdout)


def progress_bar(iterable=None, show=True, **kwargs):
    """A tqdm progress bar on stderr, shown only where it can redraw itself in place: `show` (rank 0, work long
    enough) and stderr a terminal. Written into a file (a job's log, `> log 2>&1`) its redraws would interleave
    with the step lines: there it steps aside (tqdm's disable=None), and the lines log() prints remain."""
    return tqdm(iterable, disable=None if show else True, dynamic_ncols=True, **kwargs)
