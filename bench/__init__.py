"""Benchmarks and acceptance runs (not tests): each module is a command run from the repository root.

    python -m bench.gpu               # the one-command GPU acceptance run (--device=cpu --tiny: its CPU checks)

They import only library modules and their public names, never train.py (they run it as a subprocess).
"""
