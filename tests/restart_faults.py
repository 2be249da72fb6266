"""multi_gpu_torchrun.py, slowed down for the tests. Start it wherever you would start lesson 3
(torchrun, srun, the sbatch scripts), with lesson 3's flags plus:

  --step-delay S    sleep S seconds after every optimizer step, so that a kill, a signal or a
                    node that joins lands in the middle of a run

Its output, snapshots and exit codes are lesson 3's. The lesson itself has no test hooks: this
script imports it and wraps Trainer._run_batch.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import multi_gpu_torchrun  # noqa: E402


def slowed(run_batch, seconds):
    def run_batch_then_sleep(self, *batch):
        loss = run_batch(self, *batch)
        time.sleep(seconds)
        return loss

    return run_batch_then_sleep


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="S")
    hooks, rest = parser.parse_known_args()
    trainer = multi_gpu_torchrun.Trainer
    trainer._run_batch = slowed(trainer._run_batch, hooks.step_delay)
    # The lesson parses the rest of the command line itself.
    sys.argv = [os.path.join(ROOT, "multi_gpu_torchrun.py"), *rest]
    multi_gpu_torchrun.main()
