"""multinode.py with a crash, for the tests. Start it wherever you would start multinode.py
(torchrun, launch_ddp.sh, srun, the sbatch scripts), with multinode.py's flags plus:

  --crash-rank R          global rank R kills itself with SIGKILL, like a segfault or an OOM kill,
                          after printing `error: rank R crashed on purpose (--crash-rank)`
  --crash-at start|STEP   when: at start-up, before joining the process group (the others then
                          wait for it until the timeout unless the launcher kills them), or after
                          optimizer step STEP (default 1) of a run that started from step 0, so
                          that a restarted run that resumed goes on

The lesson itself has no test hooks: this script imports multinode and wraps two of its Trainer's
methods.
"""

import argparse
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import multinode  # noqa: E402


def crash(rank):
    """Die with no cleanup at all, like a segfault or an OOM kill."""
    print(f"error: rank {rank} crashed on purpose (--crash-rank)", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--crash-rank", type=int, metavar="R")
    parser.add_argument("--crash-at", default="1", metavar="start|STEP")
    hooks, rest = parser.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    # The rank as the launcher set it: this rank dies before it joins the group.
    if hooks.crash_at == "start" and str(hooks.crash_rank) == os.environ.get("RANK"):
        crash(hooks.crash_rank)
    resume, run_batch = multinode.Trainer._resume, multinode.Trainer._run_batch

    def _resume(trainer, model):
        trainer.first_step = resume(trainer, model)
        return trainer.first_step

    def _run_batch(trainer, x, y):
        loss = run_batch(trainer, x, y)
        # trainer.step counts the steps before this one.
        step = trainer.step + 1
        if trainer.ddp.rank == hooks.crash_rank and trainer.first_step == 0:
            if hooks.crash_at == str(step):
                crash(trainer.ddp.rank)
        return loss

    multinode.Trainer._resume, multinode.Trainer._run_batch = _resume, _run_batch
    multinode.main()


if __name__ == "__main__":
    main()
