"""Plant each plausible bug in a copy of the course and run the tests that must catch it.

    python tests/plant_bugs.py              # every bug below (takes a while: one pytest run each)
    python tests/plant_bugs.py set_epoch    # only the bugs whose name contains "set_epoch"

A test that passes whatever the code does proves nothing. For each central claim of the course,
BUGS names a one-line change a real author could make (drop `set_epoch`, forget to divide by the
accumulation steps, skip the optimizer state on resume ...) and the tests that must fail with it.
Each bug is planted in a fresh copy of the repository (what git tracks or would track; the venv
is shared), and its tests run there. Prints CAUGHT or MISSED per bug; exits 1 if any was missed,
or if a planted line is no longer in its file (the bug list must follow the code).
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, file, the line as it is, the line with the bug, the tests that must fail)
BUGS = [
    (
        "lesson 1 without set_epoch",
        "ddp_mnist.py",
        "self.sampler.set_epoch(epoch)",
        "pass",
        [
            "tests/test_mnist.py::test_two_ranks_train_the_model_one_process_trains_on_the_global_batch"
        ],
    ),
    (
        "lesson 1 evaluation not summed over the ranks",
        "ddp_mnist.py",
        "dist.all_reduce(totals)",
        "pass",
        ["tests/test_mnist.py::test_every_test_sample_is_counted_once_and_the_output_is_rank_0s"],
    ),
    (
        "lesson 1 evaluation: every rank scores the whole test set",
        "ddp_mnist.py",
        "range(self.ddp.rank, len(self.test_set), self.ddp.world_size)",
        "range(len(self.test_set))",
        ["tests/test_mnist.py::test_every_test_sample_is_counted_once_and_the_output_is_rank_0s"],
    ),
    (
        "the restart store without a namespace per attempt",
        "ddp_common.py",
        "store = dist.PrefixStore(f\"attempt{env['TORCHELASTIC_RESTART_COUNT']}\", agent)",
        "store = agent",
        ["tests/test_common.py::test_torchrun_shared_store_gets_one_namespace_per_attempt"],
    ),
]


def repo_copy(dest):
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / ".venv").symlink_to(ROOT / ".venv")


def plant(name, file, original, planted, tests):
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        copy = Path(tmp)
        repo_copy(copy)
        source = (copy / file).read_text()
        if source.count(original) != 1:
            return f"STALE  {name}: {original!r} is in {file} {source.count(original)} times"
        (copy / file).write_text(source.replace(original, planted))
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-n",
                "0",
                "-p",
                "no:cacheprovider",
                *tests,
            ],
            cwd=copy,
            capture_output=True,
            text=True,
        )
        if result.returncode == 1:
            return f"CAUGHT {name}"
        verdict = "MISSED" if result.returncode == 0 else f"ERROR (pytest exit {result.returncode})"
        return f"{verdict} {name}: {' '.join(tests)}\n{result.stdout[-1500:]}"


def main():
    wanted = sys.argv[1:]
    bugs = [bug for bug in BUGS if not wanted or any(w in bug[0] for w in wanted)]
    lines = []
    for bug in bugs:
        line = plant(*bug)
        print(line, flush=True)
        lines.append(line)
    caught = sum(line.startswith("CAUGHT") for line in lines)
    print(f"plant_bugs: {caught} of {len(lines)} caught")
    sys.exit(0 if caught == len(lines) else 1)


if __name__ == "__main__":
    main()
