"""ddp_training.py whose GradScaler starts at --first-scale S instead of torch's 2^16: a model
whose first fp16 steps overflow, so that the scaler skips them. Start it as lesson 2 (torchrun),
with lesson 2's flags plus --first-scale; afterwards rank 0 exits 1 if last.pt in
--checkpoint-dir holds a weight that is not finite. tests/gpu_check.sh runs it on CUDA (fused
SGD's CUDA kernel); tests/test_training.py sets the same scale in its own processes, on CPUs.
The lesson itself has no test hooks: this script sets torch's default and calls its main().
"""

import argparse
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import ddp_training  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--first-scale", type=float, default=2.0**16)
    parser.add_argument("--checkpoint-dir", default="./checkpoints/lesson2")
    hooks, rest = parser.parse_known_args()
    scaler = torch.amp.GradScaler
    scaler.__init__ = functools.partialmethod(scaler.__init__, init_scale=hooks.first_scale)
    # The lesson parses the rest of the command line itself.
    sys.argv = [
        os.path.join(ROOT, "ddp_training.py"),
        *rest,
        "--checkpoint-dir",
        hooks.checkpoint_dir,
    ]
    ddp_training.main()
    if os.environ.get("RANK", "0") == "0":
        state = torch.load(os.path.join(hooks.checkpoint_dir, "last.pt"), weights_only=True)
        bad = [
            k for k, v in state["model"].items() if v.is_floating_point() and not v.isfinite().all()
        ]
        print(
            f"scale: first {hooks.first_scale:g}, now {state['scaler'].get('scale')} | "
            f"weights not finite: {bad or 'none'}"
        )
        sys.exit(1 if bad else 0)
