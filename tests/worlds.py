"""Several torchrun scenarios in one world: one `torchrun --nproc_per_node=N tests/worlds.py` whose ranks call
train.main once per scenario, in order, so that a test file pays a world's start (an agent and N processes of
~4.5 s of CPU each before their first step) once rather than once per run.

Each scenario is what `tiny.torchrun(*args, nproc=N)` would run (or `torchrun SCRIPT args`), with its own process
group: torchrun's agent store takes one rendezvous only, so every scenario's group is a fresh TCPStore on its rank 0
at its own free port. A scenario may take some of the ranks only (a world of its own size, beside the next scenarios
on the other ranks). Before a scenario its first rank makes its copies (a checkpoint an earlier scenario wrote, to
resume from) while its others wait; each rank writes the scenario's stdout, stderr and exit status to files of its
own, and a rank whose scenario fails (an exit status, an exception's traceback) goes on to its next one. A scenario
whose script patches modules goes last on its ranks.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tiny import ROOT, free_port, subprocess_env


@dataclass
class Scenario:
    """One train.py run of a world (or of SCRIPT, a test's script run as torchrun would run it): its arguments,
    what its first rank copies first ((source, target) pairs: a directory or a file), the world's ranks it runs on
    (None: all), and then what it gave: each of its ranks' exit status, all its ranks' stdout and stderr."""

    args: list
    copies: tuple = ()
    script: str = None
    ranks: tuple = None
    codes: list = None
    stdout: str = ""
    stderr: str = ""

    @property
    def out_dir(self):
        return Path(next(str(a) for a in self.args if str(a).startswith("--out_dir="))[len("--out_dir=") :])


def world(scenarios, log_dir, nproc=2, timeout=600):
    """Run the scenarios in order in one torchrun world of nproc ranks; fills in each one's codes, stdout and
    stderr, and returns them. A world that does not finish fails with its output. A scenario with ranks runs on
    those ranks alone (a world of its own: their RANK, WORLD_SIZE, ... are its), at the same time as the next
    scenarios on the other ranks; on its ranks, after the scenarios before it."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    plan = [
        {
            "args": [str(a) for a in s.args],
            "copies": [list(map(str, c)) for c in s.copies],
            "script": s.script and str(s.script),
            "ranks": list(s.ranks or range(nproc)),
        }
        for s in scenarios
    ]
    ports = [free_port() for _ in scenarios]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [__file__, str(log_dir), json.dumps(plan), json.dumps(ports)]
    result = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    for i, (s, ranks) in enumerate(zip(scenarios, (p["ranks"] for p in plan))):
        read = lambda suffix: [(log_dir / f"{i}.{r}.{suffix}") for r in ranks]  # noqa: E731
        assert all(p.is_file() for p in read("code")), (i, result.stderr[-3000:])
        s.codes = [json.loads(p.read_text()) for p in read("code")]
        s.stdout, s.stderr = ("".join(p.read_text() for p in read(kind)) for kind in ("out", "err"))
    return scenarios


def drive(log_dir, plan, ports):
    """A rank's part: each scenario's train.main with its output in the scenario's files."""
    import train
    from gpt2train.parallel import exit_process

    rank = int(os.environ["RANK"])
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # the agent's store has had its one rendezvous
    saved = os.dup(1), os.dup(2)
    for i, (scenario, port) in enumerate(zip(plan, ports)):
        ranks, ready = scenario["ranks"], log_dir / f"{i}.ready"
        if rank not in ranks:
            continue
        for key in ("RANK", "LOCAL_RANK", "ROLE_RANK"):
            os.environ[key] = str(ranks.index(rank))
        for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"):
            os.environ[key] = str(len(ranks))
        if rank == ranks[0]:
            for source, target in scenario["copies"]:
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if Path(source).is_dir() else shutil.copy)(source, target)
            ready.touch()
        while not ready.exists():
            time.sleep(0.02)
        os.environ["MASTER_PORT"] = str(port)
        main = partial(run_script, scenario["script"]) if scenario["script"] else train.main
        code = run_redirected(main, scenario["args"], log_dir / f"{i}.{rank}", saved)
        (log_dir / f"{i}.{rank}.code").write_text(json.dumps(code))
        forget_meshes()
    exit_process(lambda: 0)


def forget_meshes():
    """Clear DTensor's caches of sharding decisions: they are keyed by a mesh's ranks and shape, not by its process
    groups, so the next scenario's mesh of the same shape would reuse specs naming the last one's destroyed groups
    ("Could not resolve the process group registered under the name 4")."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


def run_script(script, argv):
    """SCRIPT run as `python SCRIPT ARGV` runs it (0, or the status it exits with); its process group, if it
    started one, is destroyed after it."""
    import runpy

    import torch.distributed as dist

    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_redirected(main, argv, prefix, saved):
    """main(argv)'s exit status, its stdout and stderr in PREFIX.out and PREFIX.err."""
    sys.stdout.flush(), sys.stderr.flush()
    with open(f"{prefix}.out", "w") as out, open(f"{prefix}.err", "w") as err:
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except Exception:  # as the interpreter ends a script that raises: the traceback, status 1
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    return code


if __name__ == "__main__":
    drive(Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]))
