"""The library the root commands import (train.py, sample.py, prepare_data.py, hellaswag.py, evaluate.py,
tokenizer.py, dryrun.py, plot_metrics.py, checkpoint.py), one job per module. model.py, the GPT itself, stays at
the root beside them. The README's "Read first" gives the reading order."""
