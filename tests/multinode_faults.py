"""multinode.py with fault injection and a report, for the tests. Start it wherever you would start
multinode.py (torchrun, launch_ddp.sh, srun, the sbatch scripts), with multinode.py's flags plus:

  --crash-rank R          global rank R kills itself with SIGKILL, like a segfault or an OOM kill,
                          after printing `error: rank R crashed on purpose (--crash-rank)`
  --crash-at start|STEP   when: at start-up, before joining the process group (the others then
                          wait for it until the timeout unless the launcher kills them), or after
                          optimizer step STEP (default 1) of a run that did not resume, so that a
                          restarted run that resumes goes on
  --report PATH           rank 0 writes a JSON file at the end: the rank table, every rank's
                          parameter checksum, the position (epoch, batch) the run started from and
                          the one it saved last

The lesson itself has no test hooks: this script imports multinode and wraps its functions.
"""

import argparse
import functools
import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import multinode  # noqa: E402
from ddp_common import fail  # noqa: E402


def parse_hooks():
    """The hook flags; everything else is left for multinode.py's own parser."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--crash-rank", type=int, default=None, metavar="R")
    parser.add_argument("--crash-at", default="1", metavar="start|STEP")
    parser.add_argument("--report", default=None, metavar="PATH")
    hooks, rest = parser.parse_known_args()
    if "-h" in rest or "--help" in rest:
        # The hooks here, then multinode.py's own --help.
        print(__doc__)
    if hooks.crash_rank is not None and hooks.crash_rank < 0:
        fail("--crash-rank must be a rank >= 0")
    if hooks.crash_at != "start" and not (hooks.crash_at.isdigit() and int(hooks.crash_at) > 0):
        fail("--crash-at must be start or a step number >= 1")
    world_size = os.environ.get("WORLD_SIZE")
    if hooks.crash_rank is not None and world_size and hooks.crash_rank >= int(world_size):
        fail(f"--crash-rank {hooks.crash_rank} is not a rank: the world size is {world_size}")
    return hooks, rest


def crash(rank):
    """Die with no cleanup at all, like a segfault or an OOM kill."""
    print(f"error: rank {rank} crashed on purpose (--crash-rank)", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class Hooks:
    """Each method wraps the multinode function of its name: it calls the original, then records
    what the report needs, or crashes."""

    def __init__(self, crash_rank, crash_at, report):
        self.crash_rank = crash_rank
        self.crash_at = crash_at
        self.report = report
        self.ddp = None
        self.table = None
        self.start = None
        self.saved = None
        self.val_acc = None
        self.steps = 0

    def install(self):
        wrapped = ["rank_table", "load_snapshot", "train_step", "save_snapshot", "evaluate"]
        for name in wrapped + ["replica_checksums"]:
            original = getattr(multinode, name)
            setattr(multinode, name, functools.partial(getattr(self, name), original))

    def rank_table(self, original, ddp):
        self.ddp = ddp
        self.table = original(ddp)
        return self.table

    def load_snapshot(self, original, *args):
        self.start = original(*args)
        return self.start

    def train_step(self, original, *args):
        loss = original(*args)
        self.steps += 1
        resumed = self.start != (0, 0)
        if self.ddp.rank == self.crash_rank and self.crash_at == str(self.steps) and not resumed:
            crash(self.ddp.rank)
        return loss

    def save_snapshot(self, original, args, ddp, model, optimizer, epoch, batch):
        original(args, ddp, model, optimizer, epoch, batch)
        self.saved = (epoch, batch)

    def evaluate(self, original, *args):
        val_loss, self.val_acc = original(*args)
        return val_loss, self.val_acc

    def replica_checksums(self, original, model, ddp):
        checksums = original(model, ddp)
        if self.report and ddp.is_main:
            self.write_report(checksums)
        return checksums

    def write_report(self, checksums):
        end = self.saved or self.start
        report = {
            "world_size": self.ddp.world_size,
            "nodes": len({row["node"] for row in self.table}),
            "launcher": self.ddp.launcher,
            "backend": self.ddp.backend,
            "ranks": self.table,
            "params_sha256": checksums,
            "start_epoch": self.start[0],
            "start_batch": self.start[1],
            "epoch": end[0],
            "batch": end[1],
            "steps": self.steps,
            "val_acc": self.val_acc,
        }
        tmp = f"{self.report}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, self.report)


def main():
    hooks, rest = parse_hooks()
    # The rank as the launcher set it: this rank dies before it joins the group.
    if hooks.crash_at == "start" and str(hooks.crash_rank) == os.environ.get("RANK"):
        crash(hooks.crash_rank)
    Hooks(hooks.crash_rank, hooks.crash_at, hooks.report).install()
    sys.argv = [sys.argv[0], *rest]
    multinode.main()


if __name__ == "__main__":
    main()
