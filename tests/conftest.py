"""Launch helpers shared by the tests: real processes on gloo/CPU, free ports, short timeouts,
and the whole process tree killed when a run fails or hangs; the test Slurm; and the commands the
README and docs print, each run once per session (readme_run: test_readme.py checks every one,
and a lesson's tests may assert on the run of its own command instead of launching it again)."""

import contextlib
import fcntl
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so tests (and mp.spawn children) can import the lessons
# The tests oversubscribe the cores (4 workers, each running several processes). An OpenMP
# thread that finished its part of an op spins, waiting for the next, on a core another test
# needs: PASSIVE makes it sleep (a two-node test alone: 22-37 s of CPU -> 14 s). Set before any
# process loads torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torchrun keeps a log folder per launch (/tmp/torchelastic_*) after it exits: the processes the
# tests start (cpu_env) make their temporary files in a folder that goes with the session. Made in
# pytest_configure, so that a process that only imports this file (a spawned worker) makes none.
CHILD_TMP = None


def pytest_configure(config):
    global CHILD_TMP
    CHILD_TMP = tempfile.mkdtemp(prefix="ddp-course-tmp-")


def pytest_unconfigure(config):
    if CHILD_TMP:
        shutil.rmtree(CHILD_TMP, ignore_errors=True)


PORT_BOOK = (
    Path(tempfile.gettempdir()) / "ddp-course-ports"
)  # port -> when handed out, for every session


def free_port(n=1):
    """The first of n consecutive TCP ports, free now and handed to no other test in the last 10
    minutes (this session's workers or another session's: the book is shared, under a lock). Not
    bind(("", 0)): the kernel can give one just-closed port to two workers before either launcher
    binds it (seen: two torchrun jobs on one c10d store, one failing when the other ended). From
    10000-19999: below the kernel's own picks (32768+) and the sbatch scripts' ports (20000+)."""
    pick = random.SystemRandom()  # tests seed `random`: a seeded pick would repeat across workers
    with open(PORT_BOOK, "a+") as book:
        fcntl.flock(book, fcntl.LOCK_EX)
        book.seek(0)
        now = time.time()
        given = {int(p): float(t) for p, t in map(str.split, book) if now - float(t) < 600}
        for _ in range(1000):
            first = pick.randrange(10000, 20000 - n)
            ports = range(first, first + n)
            if not given.keys() & set(ports) and all(map(_bindable, ports)):
                break
        else:
            raise RuntimeError(f"no {n} free ports in 10000-19999")
        given.update(dict.fromkeys(ports, now))
        book.seek(0), book.truncate()
        book.writelines(f"{p} {t}\n" for p, t in given.items())
    return first


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pytest_xdist_make_scheduler(config, log):
    """pytest.ini's `--dist loadscope` gives each test module to one worker, so a module's fixtures
    run once. test_readme's commands (over a third of the suite's time) would then run one after
    another on one worker, the suite's longest chain: each command, with the check of the output it
    shows (they share one run), is a unit of its own instead, or joins the module whose tests
    reuse its run (REUSED_RUNS)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndReadmeCommands(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            # Tests that mostly wait (for a timeout, a rendezvous, a lost node) and share no
            # module fixture: each its own unit, so their waits overlap on other workers.
            if re.search(r"test_elastic\.py::test_(elastic_job|a_node_cut)", nodeid):
                return nodeid
            # A README command that submits to Slurm runs beside test_slurm.py, on its worker:
            # one test cluster per suite, its jobs one at a time (seen: a second cluster on
            # another worker, its README job killed at the test's time limit).
            if "test_readme.py::" in nodeid and "sbatch" in nodeid:
                return "tests/test_slurm.py"
            m = re.search(
                r"test_readme\.py::test_(command_runs|shown_output)\w*\[(\S+ of )?(\S+:\d+)", nodeid
            )
            if m:
                return README_UNITS.get(m.group(3), m.group(3))
            return super()._split_scope(nodeid)

        def _assign_work_unit(self, node):
            # Longest units first: a long one handed out last is the suite's tail, its worker
            # still busy while the others are done (seen: the two elastic waits, one after the
            # other, 90 s after the rest). Ties keep xdist's order.
            first = min(self.workqueue, key=unit_rank)
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return ModulesAndReadmeCommands(config, log)


# The units that take longest on 2 cores (measured with --durations), longest first; every other
# unit (the README's commands, the quick modules) comes after them.
LONGEST_UNITS = [
    "tests/test_torchrun_restart.py",
    "tests/test_training.py",
    "tests/test_debug.py",
    "tests/test_gpt2.py",
    "tests/test_slurm.py",
    "tests/test_mnist.py",
    "tests/test_multinode.py",
    "tests/test_benchmark.py",
    "test_elastic.py::test_elastic_job",
    "test_elastic.py::test_a_node_cut",
    "tests/test_elastic.py",
]


def unit_rank(scope):
    for rank, unit in enumerate(LONGEST_UNITS):
        if unit in scope:
            return rank
    return len(LONGEST_UNITS)


def cpu_env(**extra):
    """Environment for a CPU/gloo run: no GPU, one thread per process, short collective timeout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "LOCAL_", "WORLD_", "MASTER_", "TORCHELASTIC", "SLURM_"))
    }
    env.update(
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        DDP_TIMEOUT="60",
        PYTHONPATH=str(ROOT),
    )
    if CHILD_TMP:
        env["TMPDIR"] = CHILD_TMP
    env.update({k: str(v) for k, v in extra.items()})
    return env


def descendants(pid):
    """Every process below pid. torchrun starts its workers in sessions of their own, so killing
    the agent's process group alone would leave them running. `ps` works on Linux and macOS."""
    table = subprocess.run(
        ["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True, text=True
    )
    children = {}
    for line in table.stdout.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found, todo = found + kids, todo + kids
    return found


def kill_tree(*pids):
    """SIGKILL each pid's process group and every process below it (stragglers of a failed run)."""
    for pid in [q for p in pids for q in descendants(p)] + list(pids):
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run(cmd, timeout=180, env=None, cwd=None):
    """Run cmd in its own session; on timeout kill the whole group and fail the test.
    Any stragglers (workers of a crashed launcher) are killed too."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd or ROOT,
        env=env or cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The whole tree first: a worker in a session of its own still holds the output pipes.
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "", "(the output is held by a process outside the run's tree)"
        pytest.fail(
            f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n"
            f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
        )
    finally:
        kill_tree(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun_cmd(script, *args, nproc=2, extra=()):
    """torchrun (as `python -m torch.distributed.run`, the same program) on a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        *extra,
        ROOT / script,
        *args,
    ]


def run_torchrun(script, *args, nproc=2, timeout=180, env=None, extra=()):
    return run(
        torchrun_cmd(script, *args, nproc=nproc, extra=extra), timeout=timeout, env=env or cpu_env()
    )


def run_nodes(cmds, tmp_path=None, timeout=240, env=None):
    """Start the node commands at once (like on two machines) and wait for all. Output goes to
    files (a full pipe would block one node while we wait on the other); on timeout every process
    (agents and their workers) is killed and the test fails showing each node's output."""
    import tempfile

    procs, logs = [], []
    for cmd in cmds:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        logs.append((out, err))
        procs.append(
            subprocess.Popen(
                [str(c) for c in cmd],
                cwd=ROOT,
                env=env or cpu_env(),
                text=True,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        )
    deadline, timed_out = time.monotonic() + timeout, False
    try:
        for p in procs:
            try:
                p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        kill_tree(*(p.pid for p in procs))
    results = []
    for p, cmd, (out, err) in zip(procs, cmds, logs, strict=True):
        p.wait()
        out.seek(0), err.seek(0)
        results.append(subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read()))
        out.close(), err.close()
    if timed_out:
        pytest.fail(
            f"timed out after {timeout}s\n"
            + "\n".join(
                f"--- node {i} (exit {r.returncode}) stdout\n{r.stdout[-2000:]}\n--- stderr\n"
                f"{r.stderr[-3000:]}"
                for i, r in enumerate(results)
            )
        )
    return results


def run_python(script, *args, timeout=180, env=None):
    return run([sys.executable, ROOT / script, *args], timeout=timeout, env=env or cpu_env())


def assert_ok(result):
    """Exit 0, or fail showing the ends of both streams."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-3000:]}"
    )


def error_lines(result):
    """The `error:` lines a failed run printed (the interface for user mistakes); argparse's
    `prog: error: ...` lines count too."""
    return [
        line
        for line in (result.stderr + result.stdout).splitlines()
        if re.match(r"(\S+: )?error: ", line)
    ]


def flat_tensors(state, prefix=""):
    """Flatten a nested state (dicts, lists, tensors: a checkpoint, an optimizer state_dict) into
    {"a.b.0": tensor}, so two states compare key by key."""
    import torch

    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = (
        state.items()
        if isinstance(state, dict)
        else enumerate(state)
        if isinstance(state, (list, tuple))
        else []
    )
    flat = {}
    for k, v in items:
        flat.update(flat_tensors(v, f"{prefix}.{k}"))
    return flat


def _run_then_exit(rank, fn, *args):
    """fn(rank, *args), then leave without interpreter teardown. Seen here (~1 run in 3 of the
    suite): a worker that finished, saved its results and left the group still aborted at teardown
    ("terminate called without an active exception", SIGABRT) from a gloo thread. An exception in
    fn still propagates to mp.spawn as usual."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, nprocs, *args, port=None):
    """mp.spawn fn(rank, world_size, port, *args) in fresh processes on gloo (fn must live in an
    importable module). Sets a free MASTER_PORT; the processes die with the test on failure.
    The processes fork from a forkserver that imported torch once for the session (what
    start_method="spawn" would re-import in every process: ~2-3 s of CPU each, the largest part
    of a short spawned test). The forkserver is a clean process that has run no torch op, so each
    process starts as a fresh one would; it takes the environment of the first spawn, which is
    why the workers set theirs (init_spawned, torchrun_env) themselves."""
    import multiprocessing

    import torch.multiprocessing as mp

    # torch._dynamo: DDP's constructor imports it (another second per process otherwise)
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    port = port or free_port()
    mp.start_processes(
        _run_then_exit,
        args=(fn, nprocs, port, *args),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )


def init_spawned(rank, world_size, port):
    """In a spawned test worker: join the group through the helper under test (gloo, CPU)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="", DDP_TIMEOUT="60"
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(k, None)
    import ddp_common

    return ddp_common.setup(backend="gloo", rank=rank, world_size=world_size)


def torchrun_env(rank, world_size, port, local_world_size=None):
    """In a spawned test worker: the variables torchrun would give this rank, so a lesson's main()
    runs as under torchrun (a new port per run). local_world_size < world_size makes the ranks
    look like several "nodes" (GROUP_RANK = node, LOCAL_RANK = rank on it)."""
    local = local_world_size or world_size
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(k, None)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % local),
        LOCAL_WORLD_SIZE=str(local),
        GROUP_RANK=str(rank // local),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CUDA_VISIBLE_DEVICES="",
        DDP_TIMEOUT="60",
        OMP_NUM_THREADS="1",
    )


def _main_as_worker(rank, world_size, port, out, script, argv_by_node, env):
    """In a spawned process: the lesson's main() with the variables torchrun would set (and env)
    and the arguments of this rank's node; its exit code and output saved for the test."""
    import torch

    torchrun_env(rank, world_size, port, local_world_size=world_size // len(argv_by_node))
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    argv = argv_by_node[rank * len(argv_by_node) // world_size]
    torch.save(main_output(script, argv), os.path.join(out, f"rank{rank}.pt"))


def main_output(script, argv):
    """In a rank: the lesson's main() with argv, as its command line would run it; (exit code,
    stdout, stderr). A run that stopped with an error left its group up: it is left here."""
    import importlib
    import io

    import ddp_common

    sys.argv = [script, *map(str, argv)]
    lesson = importlib.import_module(Path(script).stem)
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            lesson.main()
        except SystemExit as e:
            code = e.code
    ddp_common.cleanup()
    return code, stdout.getvalue(), stderr.getvalue()


def run_spawned(script, *args, nproc=2, nodes=None, env=None):
    """What run_torchrun(script, *args, nproc=nproc) runs, without the agent: the lesson's main()
    in nproc processes forked from the session's forkserver (spawn), each with the variables
    torchrun would give it. For a test where torchrun itself is not what is tested: it saves the
    agent's start-up and an import of torch in every process. nodes: one argument list per
    "node" instead of args (a node's ranks get LOCAL_RANK from 0, GROUP_RANK the node's number).
    env: variables to add. One CompletedProcess per rank (code 0, or what main() exited with)."""
    import torch

    with tempfile.TemporaryDirectory() as out:
        spawn(_main_as_worker, nproc, out, script, nodes or [args], env)
        results = [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in range(nproc)]
    return [subprocess.CompletedProcess(script, *result) for result in results]


def assert_clean_failure(result, code=None):
    """A user mistake or failure: non-zero exit, an `error:` line, and no Python traceback from
    the course's own files. (torchrun then adds its own ChildFailedError report about the failed
    worker; that is the launcher's output, and the `error:` line above it is the cause.)"""
    assert result.returncode != 0 if code is None else result.returncode == code, (
        result.returncode,
        result.stderr[-2000:],
    )
    errs = error_lines(result)
    assert errs, f"no error line:\n{result.stderr[-2000:]}"
    ours = [
        line
        for line in result.stderr.splitlines()
        if re.search(rf'File "{re.escape(str(ROOT))}/(?!\.venv)', line)
    ]
    assert not ours, "traceback from the course's code:\n" + "\n".join(ours)
    return errs


# ---- a real two-node Slurm on this machine (lesson 4: test_slurm.py and test_readme.py) ----
CLUSTER = ROOT / "tests" / "slurm_cluster.sh"
SLURM_ASKED = os.environ.get("DDP_COURSE_SLURM") == "1" or os.environ.get("CI") == "true"
SLURM_OFF = (
    "Slurm tests off: DDP_COURSE_SLURM=1 runs them (as root: tests/slurm_cluster.sh installs "
    "munge+Slurm with apt-get, adds node1/node2 to /etc/hosts); CI=true does"
)


def cannot_start_reason():
    if os.geteuid() != 0:
        return "starting the test Slurm needs root"
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        return "Slurm is not installed and there is no apt-get to install it"
    return None


@pytest.fixture(scope="session")
def slurm():
    """Environment for sbatch/srun against the test cluster (started here, stopped at the end).
    Only when asked: starting it installs munge and Slurm with apt-get and adds node1/node2 to
    /etc/hosts, nothing a test should do to a workstation unprompted. Asked and impossible fails."""
    if not SLURM_ASKED:
        pytest.skip(SLURM_OFF)
    reason = cannot_start_reason()
    if reason:
        pytest.fail(f"the Slurm tests were asked for (DDP_COURSE_SLURM=1 or CI=true), but {reason}")
    # Its own state dir and ports: two test sessions at once get two clusters, not one torn down
    # under the other.
    state_dir = tempfile.mkdtemp(prefix="ddp-course-slurm-", dir="/tmp")
    port = free_port(3)  # slurmctld, then one per slurmd
    # The sbatch scripts' rendezvous port is 20000 + job id % 9000 (20000-28999): always above
    # the tests' ports (10000-19999, this cluster's included). Job ids from this cluster's own
    # port keep two sessions' jobs apart (their ports differ).
    env = dict(
        os.environ,
        SLURM_TEST_DIR=state_dir,
        SLURM_TEST_PORT=str(port),
        SLURM_TEST_FIRST_JOB_ID=str(port),
    )
    start = subprocess.run(
        ["bash", CLUSTER, "start"], env=env, capture_output=True, text=True, timeout=900
    )
    if start.returncode != 0:
        subprocess.run(["bash", CLUSTER, "stop"], env=env, capture_output=True, timeout=120)
        pytest.fail(
            f"tests/slurm_cluster.sh start failed:\n{start.stdout[-2000:]}{start.stderr[-3000:]}"
        )
    try:
        # The jobs inherit this environment (sbatch --export=ALL): without a .venv in the repo
        # the sbatch scripts run the python/torchrun found first on PATH, i.e. this one.
        yield {
            "SLURM_CONF": f"{state_dir}/slurm.conf",
            "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
            "TMPDIR": CHILD_TMP,
        }
    finally:
        subprocess.run(["bash", CLUSTER, "stop"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)


# ---- the commands the README and docs print (test_readme.py; lessons' tests reuse some) ----
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


@dataclass
class Block:
    page: str  # path relative to the repository
    line: int  # line of the opening fence
    info: list  # words after ``` (language first)
    body: str

    @property
    def lang(self):
        return self.info[0] if self.info else ""

    @property
    def key(self):
        return f"{self.page}:{self.line}"


FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def fenced_blocks(path):
    text = path.read_text()
    return [
        Block(
            str(path.relative_to(ROOT)),
            text.count("\n", 0, m.start()) + 1,
            m.group(1).split(),
            m.group(2),
        )
        for m in FENCE.finditer(text)
    ]


BLOCKS = [b for page in PAGES for b in fenced_blocks(page)]


def script_of(block):
    """The block as a script; a `# cpu: FLAGS` line appends FLAGS to the line above."""
    lines = []
    for line in block.body.splitlines():
        m = re.match(r"\s*# cpu:(.*)", line)
        if m and lines:
            lines[-1] = lines[-1].rstrip() + " " + m.group(1).strip()
        else:
            lines.append(line)
    return "\n".join(lines).strip()


BASH = [b for b in BLOCKS if b.lang == "bash"]

# README commands whose run a lesson's own tests also assert on (the fixture readme_run), by a
# fragment of the command, and the test module that does. Each command runs once per session:
# the scheduler (pytest_xdist_make_scheduler) gives it to the worker that runs that module.
REUSED_RUNS = {
    "python ddp_minimal.py": "tests/test_minimal.py",
    "python gpt2_ddp.py --init-from gpt2": "tests/test_gpt2.py",
    "ddp_knobs.py --zero": "tests/test_knobs.py",
    "ddp_debug.py": "tests/test_debug.py",
    "python ddp_benchmark.py": "tests/test_benchmark.py",
    "ddp_from_scratch.py --sync torch": "tests/test_from_scratch.py",
    "--rdzv-endpoint 127.0.0.1:29400": "tests/test_multinode.py",
    "sbatch --wait slurm/train_srun.sbatch": "tests/test_slurm.py",
}
README_UNITS = {
    b.key: module
    for b in BASH
    if b.page == "README.md"
    for fragment, module in REUSED_RUNS.items()
    if fragment in script_of(b)
}


def needs_slurm(script):
    return re.search(r"\b(sbatch|srun|salloc)\b", script) is not None


def repo_copy(dest):
    """A copy of the repository (what git tracks or would track), sharing this venv, so commands
    that write ./data, ./checkpoints or snapshots do not touch the working tree."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    for f in files or [p.name for p in ROOT.glob("*.py")]:
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    if (ROOT / ".venv").is_dir():
        os.symlink(ROOT / ".venv", dest / ".venv")
    return dest


def processes_with(token, wait=5):
    """Processes whose environment carries token (what is left of one run), after giving them
    `wait` seconds to end: a launcher that has stopped its workers may exit before the kernel has
    reaped them. Linux only (/proc): elsewhere none are found."""
    if not os.path.isdir("/proc"):
        return []
    deadline = time.monotonic() + wait
    while True:
        left = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if token.encode() in f.read():
                        left.append(int(entry))
            except OSError:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


_RUNS = {}  # script -> CompletedProcess: each block (and each identical script) runs once


def readme_block(fragment):
    """The one ```bash block of the README whose command contains fragment."""
    found = [b for b in BASH if b.page == "README.md" and fragment in script_of(b)]
    assert len(found) == 1, f"{len(found)} README commands contain {fragment!r}"
    return found[0]


@pytest.fixture
def readme_run(request, tmp_path_factory):
    """readme_run(block), or readme_run(fragment) for the one README command that contains it:
    the command's run, once per session (test_readme's checks and a lesson's tests share it).
    A CompletedProcess (stdout, stderr, returncode) plus: cwd, the folder it ran in; seconds,
    how long it took; left, the pids of its processes still running after it returned (they
    are killed then)."""

    def get(block):
        if isinstance(block, str):
            block = readme_block(block)
            module = request.node.nodeid.split("::")[0]
            assert README_UNITS.get(block.key) == module, (
                f"{module} reuses {block.key}: add the command to REUSED_RUNS so that it runs "
                "once, on the worker that runs this module"
            )
        script = script_of(block)
        if script not in _RUNS:
            _RUNS[script] = run_block(block, request, tmp_path_factory)
        return _RUNS[script]

    return get


def run_block(block, request, tmp_path_factory):
    script = script_of(block)
    slurm_env = request.getfixturevalue("slurm") if needs_slurm(script) else {}  # real Slurm
    if "python3 -m venv .venv" in script:
        # The set-up command (re)creates ./.venv: run it in the repository itself, against the
        # venv the tests run from (venv will not build into a symlink); pip then finds
        # everything installed. Its ./data and ./checkpoints are git-ignored.
        if (
            not (ROOT / ".venv").is_dir()
            or Path(sys.prefix).resolve() != (ROOT / ".venv").resolve()
        ):
            pytest.skip(
                "the tests do not run from ./.venv, so the set-up command would build a new one"
            )
        cwd = ROOT
    else:
        cwd = repo_copy(tmp_path_factory.mktemp("repo"))
    bin_dir = os.path.dirname(sys.executable)
    # Every process the command starts carries run_id, so the test can tell whether any of them
    # is left when it returns.
    run_id = uuid.uuid4().hex
    env = cpu_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHONPATH="",
        https_proxy="http://127.0.0.1:9",
        http_proxy="http://127.0.0.1:9",
        HF_HUB_OFFLINE="1",
        DDP_COURSE_RUN=run_id,
    )
    env.update(slurm_env)
    fixed = sorted(set(re.findall(r"127\.0\.0\.1:(\d+)", script)))  # a port printed in the command
    start = time.monotonic()
    with contextlib.ExitStack() as held:
        for port in fixed:  # another test session (two suites at once) waits for it, not collides
            lock = held.enter_context(open(f"/tmp/ddp-course-port-{port}.lock", "w"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        result = run(["bash", "-euo", "pipefail", "-c", script], timeout=300, env=env, cwd=cwd)
    result.seconds = time.monotonic() - start
    result.cwd = cwd
    result.left = processes_with(f"DDP_COURSE_RUN={run_id}")
    kill_tree(*result.left)
    return result
