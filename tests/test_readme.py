"""The README and every page under docs/ are executable, and what they show cannot drift.

1. Commands. Every ```bash block runs as printed, with the flags of its `# cpu: FLAGS` lines
   appended to the line above (the small CPU run the page promises); ```sh blocks are templates
   and are not run. Slurm blocks run under the real test Slurm (`slurm` in conftest); the set-up
   block (`python3 -m venv .venv ...`) runs in the repository itself, against its own venv.
   Each block runs ONCE per test session (pages that print the same command share one run); the
   output check below reuses that run, and so do the lessons' own tests that assert on it
   (`conftest.readme_run`, `REUSED_RUNS`). No process a command started may be left running
   when it returns.

2. Outputs. A ```text block is the output of the nearest ```bash block above it in the same
   page when no ```sh or other ```text block lies between them (prose and ```python excerpts
   may), or when it is fenced ```text output (then: of the nearest ```bash block above it). A
   ```text block with any other word after `text` (```text h100, ```text measured) was measured
   elsewhere and is not compared. An output
   block must match what its command printed in this session (stdout and stderr), FIELD BY
   FIELD. Each shown line is one of:
   - a field line: it contains ` | `, or starts with a `word:` keyword (`start:`, `done:`,
     `error:`, ...). Its shape is the keyword plus the KEY of every ` | `-separated field, in
     order: the first word of the field that starts with a lower-case letter and is not a
     number (`loss 0.21` -> loss, `5120 samples/s` -> samples/s, `val_acc 90.29% (9029/10000)`
     -> val_acc; `AMD EPYC (2 cores)` has the empty key). Values are not compared, so numbers,
     names, paths and timings may differ; a renamed, added, removed or reordered field changes
     the shape.
   - a table header: three or more columns separated by 2+ spaces, each column words only
     (`world  variant  bucket MB  p50 ms`). It must appear exactly (whitespace folded).
   - a command echo, starting `+ ` (e.g. a --dry-run): must appear exactly.
   In all three, numbers (digits, decimals, exponents, `%`, `h:mm:ss`) are masked before
   comparing. Every such shown line must have a line of the same shape somewhere in the actual
   output; how many of each there are may differ (a CPU run logs more or fewer steps). Table
   rows (lines that start with a number), free text (a generated sample), elisions (`...`),
   `warning:` lines (they depend on the machine: noise, oversubscription) and torch's own
   `W1122 12:08:24 ...` log lines are not compared. A block must contain at least one compared
   line. A ```text values block (a run whose numbers hold on other CPUs: lessons 0 and 1) is
   compared value by value too, to 1% (lesson 1's convolutions round differently on CPUs with
   other vector instructions: 0.3% apart), all but the timings. A stack frame in
   one of the course's files (`ddp_debug.py", line 188`, py-spy's `(ddp_debug.py:225)`) tells the
   reader which line to read: it must be printed now, number and all; and in every block, run or
   measured, the line it names is code inside the function it names.

3. Code. Every ```python block names its file (```python FILE) and each of its code lines appears
   in that file (comments aside, whitespace folded, `...` = omitted code); so do the added and
   context lines of a ```diff FILE block (its removed lines are the one-GPU code before). A
   ```diff OLD NEW block is `diff -U1 OLD NEW` itself, line for line.

Also: the README's test command is what .ci/run runs; the worked example of gradient averaging
is computed for real; every relative link resolves; the README stays a spine (no maintainer notes;
its lesson sections are <= 120 lines each, tests/test_style.py)."""

import ast
import re
import subprocess

import pytest
import torch
import torch.distributed as dist
from conftest import BASH, BLOCKS, FENCE, PAGES, ROOT, init_spawned, script_of, spawn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_common

TEST_COMMAND = ". .venv/bin/activate && python -m pytest -q"
README = (ROOT / "README.md").read_text()


def output_pairs():
    """(command block, output block) pairs, by the rule in the module docstring."""
    pairs = []
    for page in PAGES:
        blocks = [b for b in BLOCKS if b.page == str(page.relative_to(ROOT))]
        for i, b in enumerate(blocks):
            if b.lang != "text" or i == 0:
                continue
            above = [c for c in blocks[:i] if c.lang in ("bash", "sh", "text")]
            if b.info in (["text"], ["text", "values"]) and above and above[-1].lang == "bash":
                pairs.append((above[-1], b))
            elif b.info == ["text", "output"]:
                bash = [c for c in above if c.lang == "bash"]
                assert bash, f"{b.key}: ```text output with no ```bash block above it"
                pairs.append((bash[-1], b))
    return pairs


OUTPUTS = output_pairs()
# Pages that print the same command share one run: the first block with that script stands for it
# (its key names the test and its xdist unit, conftest.pytest_xdist_make_scheduler).
FIRST = {}
for _b in BASH:
    FIRST.setdefault(script_of(_b), _b)


def short_id(block):
    script = script_of(block)
    first = next(
        (line for line in script.splitlines() if line.strip() and not line.startswith("#")), ""
    )
    return f"{block.key} {first[:50]}"


def test_readme_has_commands_and_the_test_command_is_what_ci_runs():
    readme_scripts = [script_of(b) for b in BASH if b.page == "README.md"]
    assert len(readme_scripts) >= 8
    assert TEST_COMMAND in readme_scripts
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", [b for b in FIRST.values() if script_of(b) != TEST_COMMAND], ids=short_id
)
def test_command_runs_as_printed(block, readme_run):
    result = readme_run(block)
    assert result.returncode == 0, (
        f"{block.key}: command failed (exit {result.returncode}):\n{script_of(block)}\n"
        f"--- stdout\n{result.stdout[-2500:]}\n--- stderr\n{result.stderr[-2500:]}"
    )
    # Nothing it started outlives it (a worker of a failed job, a background launch).
    assert not result.left, f"{block.key}: processes left running: {result.left}"


# ---------------------------------------------------------------- outputs cannot drift
NUMBER = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
KEY_WORD = re.compile(
    r"[a-z_][\w/.+#-]*"
)  # keys are lower case; names (AMD EPYC, SIGKILL) are values
TORCH_LOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d")
HEADER_COLUMN = re.compile(r"[A-Za-z_][\w/ ]*")


def mask(line):
    return re.sub(r"\s+", " ", NUMBER.sub("N", line.strip()))


def field_key(field):
    for word in field.split():
        word = word.rstrip(",;:")
        if KEY_WORD.fullmatch(word) and word != "N":
            return word
    return ""


def shape(line):
    """The shape of one output line (see the module docstring), or None if it is not compared."""
    raw = line.strip()
    if not raw or raw.startswith(("...", "warning:")) or TORCH_LOG.match(raw) or NUMBER.match(raw):
        return None  # blank, elision, a warning (depends on the machine), torch's log, table row
    masked = mask(raw)
    keyword = re.match(r"(\S+:)(?:\s|$)", masked)
    if " | " in masked or keyword:
        rest = masked[keyword.end() :] if keyword else masked
        fields = rest.split(" | ")
        return ("fields", keyword.group(1) if keyword else "", tuple(field_key(f) for f in fields))
    if raw.startswith("+ "):
        return ("command", masked)
    columns = re.split(r"\s{2,}", NUMBER.sub("N", raw))
    if len(columns) >= 3 and all(HEADER_COLUMN.fullmatch(c) for c in columns):
        return ("header", masked)
    return None  # free text


def describe(s):
    kind, *rest = s
    if kind == "fields":
        return f"{rest[0] or '(no keyword)'} with keys {list(rest[1])}"
    return f"{kind} {rest[0]!r}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "command,output",
    OUTPUTS,
    ids=[f"{o.key} of {short_id(FIRST[script_of(c)])}" for c, o in OUTPUTS],
)
def test_shown_output_matches_what_the_command_prints(command, output, readme_run):
    result = readme_run(command)
    if result.returncode != 0:
        pytest.fail(
            f"{command.key} failed (exit {result.returncode}), so its output at "
            f"{output.key} cannot be checked; see test_command_runs_as_printed"
        )
    actual = (result.stdout + "\n" + result.stderr).splitlines()
    actual_shapes = {s for s in map(shape, actual) if s}
    shown = [(line, shape(line)) for line in output.body.splitlines()]
    checked = [(line, s) for line, s in shown if s]
    assert checked, (
        f"{output.key}: no line of this output block is compared (no `key value | "
        "...` line, keyword line or table header); if it was not printed by the "
        "command above it, fence it as ```text <where it was measured>"
    )
    missing = [(line, s) for line, s in checked if s not in actual_shapes]
    if not missing and "values" in output.info:
        missing = [
            (line, s) for line, s in checked if not any(same_values(line, a) for a in actual)
        ]
    if missing:
        report = []
        for line, s in missing:
            near = [a for a in actual if shape(a) and shape(a)[:2] == s[:2]]
            report.append(
                f"  shown:  {line.strip()[:160]}\n    shape: {describe(s)}\n"
                + (
                    f"    printed now: {near[0].strip()[:160]}\n"
                    f"    shape: {describe(shape(near[0]))}"
                    if near
                    else "    printed now: no line with that keyword/kind"
                )
            )
        pytest.fail(
            f"{output.key}: the output shown no longer matches what `{short_id(command)}` "
            f"prints (field by field, numbers masked):\n"
            + "\n".join(report)
            + "\n--- printed now (stdout+stderr, tail)\n"
            + "\n".join(actual[-40:])
        )

    frames = own_frames(output.body) - own_frames("\n".join(actual))
    assert not frames, (
        f"{output.key}: these lines of the course's files are shown in a stack, but the command "
        f"prints other line numbers now (the file changed): {sorted(frames)}\n"
        + "\n".join(a for a in actual if OWN_FRAME.search(a))
    )


# A frame of a stack: `File ".../ddp_debug.py", line 188 in log` (Python; a traceback has
# `, in`) or `train (ddp_debug.py:225)` (py-spy).
OWN_FRAME = re.compile(r"([\w.]+\.py)(?:\", line |:)(\d+)")
FRAME_WITH_FUNCTION = re.compile(
    r"([\w.]+\.py)\", line (\d+),? in ([\w<>]+)|([\w.<>]+) \(([\w.]+\.py):(\d+)\)"
)


def own_frames(text):
    """(file, line) of every frame in one of the course's own files (not torch's)."""
    return {(f, int(n)) for f, n in OWN_FRAME.findall(text) if (ROOT / f).is_file()}


def test_every_frame_shown_names_code_in_its_function():
    """Output shown with a stack, run or measured: each frame in a course file names a line of
    code (not a comment, not a blank) inside the function the frame names; and the prose that
    says what such a line is says it of the line it names."""
    wrong = []
    for b in BLOCKS:
        for m in FRAME_WITH_FUNCTION.finditer(b.body):
            file, line, function = m[1] or m[5], int(m[2] or m[6]), (m[3] or m[4]).split(".")[-1]
            if not (ROOT / file).is_file() or function == "<module>":
                continue
            source = (ROOT / file).read_text()
            code = source.splitlines()[line - 1].strip() if line <= source.count("\n") else ""
            spans = [
                (node.lineno, node.end_lineno)
                for node in ast.walk(ast.parse(source))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name == function
            ]
            if not code or code.startswith("#") or not any(a <= line <= e for a, e in spans):
                wrong.append(f"{b.key}: {m[0]} -> line {line} is {code!r}")
    # Prose that reads such a frame: "Line 225 is `loss.backward()`", of the last frame's file.
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"\b[Ll]ine (\d+) (?:is|the [\w-]+) `([^`]+)`", text):
            frames = [f for f, _ in OWN_FRAME.findall(text[: m.start()]) if (ROOT / f).is_file()]
            line = (ROOT / frames[-1]).read_text().splitlines()[int(m[1]) - 1] if frames else ""
            if m[2] not in line:
                wrong.append(f"{page.name}: {m[0]!r}, but that line is {line.strip()!r}")
    assert not wrong, "\n".join(wrong)


# Fields whose values depend on the machine's speed, never compared.
TIMINGS = {"time", "samples/s", "tokens/s", "eta"}


def same_values(shown, printed, rel=1e-2, abs_=2e-4):
    """```text values: the shown line and a printed one have the same shape and the same numbers
    (to 1%: ATEN_CPU_CAPABILITY=default printed lesson 1's loss 0.5794 and 8618 right where AVX2
    printed 0.5810 and 8601) in every field but the timings."""
    if shape(shown) != shape(printed):
        return False
    for a, b in zip(shown.split(" | "), printed.split(" | "), strict=True):
        if field_key(mask(a.split(": ", 1)[-1])) in TIMINGS:
            continue
        x, y = NUMBER.findall(a), NUMBER.findall(b)
        if len(x) != len(y):
            return False
        for u, v in zip(x, y, strict=True):
            u, v = float(u.replace(",", "")), float(v.replace(",", ""))
            if abs(u - v) > abs_ + rel * abs(v):
                return False
    return True


def test_value_rule_compares_numbers_but_not_timings():
    shown = "epoch 1/2 | step 20/60 | loss 2.2373 | 2677 samples/s"
    assert same_values(shown, "epoch 1/2 | step 20/60 | loss 2.2374 | 1 samples/s")
    assert same_values(shown, "epoch 1/2 | step 20/60 | loss 2.2473 | 2677 samples/s")
    assert not same_values(shown, "epoch 1/2 | step 20/60 | loss 2.2873 | 2677 samples/s")
    assert not same_values(shown, "epoch 1/2 | step 40/60 | loss 2.2373 | 2677 samples/s")
    done = "done: world 2 | loss 0.0940 (first epoch 0.2679) | time 0.5s"
    assert same_values(done, done.replace("0.5s", "9.9s"))
    assert not same_values(done, done.replace("0.2679", "0.2779"))


def test_shape_rule_catches_a_renamed_field_and_tolerates_numbers():
    """The drift rule itself: numbers, timings and paths may change; keys and headers may not."""
    a = "epoch 1/3 | step 200/469 | loss 0.2113 | acc 93.40% | 5120 samples/s | eta 0:01:12"
    assert shape(a) == shape(
        "epoch 2/3 | step 9/9 | loss 1e-05 | acc 100.00% | 17 samples/s | eta 1:00:00"
    )
    assert shape(a) != shape(a.replace("loss", "train_loss"))  # renamed field
    assert shape(a) != shape(a.replace(" | acc 93.40%", ""))  # missing field
    assert shape(a) != shape(a.replace("samples/s", "tokens/s"))  # other unit
    assert shape("done: data synthetic | world 2 | time 2.1s")[2] == ("data", "world", "time")
    assert shape("done: data mnist | world 4 | time 20s") == shape(
        "done: data synthetic | world 2 | time 2.1s"
    )
    assert shape("start: x 1") != shape("done: x 1")
    assert shape("scaling | AMD EPYC (2 cores) | torch 2.15") == shape(
        "scaling | Intel(R) Xeon(R) (4 cores) | torch 2.16"
    )
    h = "world  threads/rank  batch/rank  global batch  samples/s  p50 ms"
    assert (
        shape(h)
        == shape("world     threads/rank  batch/rank  global batch   samples/s  p90 ms")
        == ("header", mask(h))
    )  # widths and numbers may change
    assert shape(h) != shape(h.replace("p50 ms", "median ms"))
    assert shape("    2   16 KiB   22389.0   0.749") is None  # a table row
    assert shape("I had always thought the spring") is None  # free text
    assert shape("W1122 12:08:24.677000 25691 torch/distributed/elastic: Sending") is None
    assert shape("warning: noisy step times (p90 up to 1.31x p50)") is None


# ---------------------------------------------------------------- code excerpts
def code_part(line):
    """A line without its trailing comment and surrounding blanks ('#' inside strings is rare in
    the excerpts; a line that is only a comment becomes empty)."""
    return re.sub(r"\s+#.*$|^#.*$", "", line.strip()).strip()


PYTHON = [b for b in BLOCKS if b.lang == "python"]
DIFFS = [b for b in BLOCKS if b.lang == "diff" and len(b.info) == 2]
# ```diff OLD NEW: the output of `diff -U1 OLD NEW` itself, without its two header lines.
FILE_DIFFS = [b for b in BLOCKS if b.lang == "diff" and len(b.info) == 3]
EXCERPTS = [b for b in PYTHON if len(b.info) >= 2] + DIFFS


def excerpt_lines(block):
    """The lines an excerpt claims are in its file: all of a ```python block; of a ```diff FILE
    block the added (+) and context lines (the removed ones are the code before the change)."""
    if block.lang != "diff":
        return block.body.splitlines()
    return [
        line[1:]
        for line in block.body.splitlines()
        if line[:1] in ("+", " ") and not line.startswith(("+++", "@@"))
    ]


def test_every_code_excerpt_names_its_file():
    untagged = [b for b in PYTHON if len(b.info) < 2]
    assert not untagged, (
        f"{untagged[0].key}: a ```python block must name its file "
        f"(```python FILE):\n{untagged[0].body[:200]}"
    )
    assert len([b for b in EXCERPTS if b.page == "README.md"]) >= 6


@pytest.mark.parametrize("block", EXCERPTS, ids=lambda b: f"{b.key} {b.info[1]}")
def test_code_excerpts_stay_in_step_with_the_files(block):
    """Each code line of an excerpt (comments aside; `...` stands for omitted code) appears in the
    file it names, so the pages cannot drift from the lessons. Whitespace and line breaks are
    folded, so an excerpt may join a statement the file wraps."""
    name = block.info[1]
    assert (ROOT / name).is_file(), f"{block.key}: excerpt of a file that does not exist: {name}"
    source = " ".join(
        c for c in (code_part(line) for line in (ROOT / name).read_text().splitlines()) if c
    )
    source = re.sub(r"\s+", " ", source)
    for line in excerpt_lines(block):
        code = re.sub(r"\s+", " ", code_part(line))
        if not code or code == "...":
            continue
        pattern = r".{0,300}?".join(re.escape(part.strip()) for part in code.split("..."))
        assert re.search(pattern, source), (
            f"{block.key}: excerpt line not found in {name}: {line.strip()}"
        )


@pytest.mark.parametrize("block", FILE_DIFFS, ids=lambda b: f"{b.key} {' '.join(b.info[1:])}")
def test_a_shown_diff_is_the_diff_of_its_files(block):
    """The README's "From one GPU to DDP" is `diff -U1 mnist_single.py ddp_mnist.py`: edit either
    file and this fails until the page shows the diff again."""
    old, new = block.info[1:]
    result = subprocess.run(["diff", "-U1", old, new], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    printed = result.stdout.splitlines()[2:]
    assert block.body.splitlines() == printed, (
        f"{block.key}: the diff shown is not `diff -U1 {old} {new}`; paste it again:\n"
        + "\n".join(printed)
    )


# ---------------------------------------------------------------- links and size
def anchors(path):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces -> '-'."""
    text = FENCE.sub("", path.read_text())
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.*)$", text, re.M)
    }


def test_every_relative_link_resolves_and_every_docs_page_is_reachable():
    linked = set()
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page.resolve()
            assert path.exists(), f"{page.relative_to(ROOT)}: broken link {target}"
            if anchor and path.suffix == ".md":
                assert anchor in anchors(path), f"{page.relative_to(ROOT)}: no heading for {target}"
            linked.add(path)
    for page in PAGES[1:]:
        assert page.resolve() in linked, f"{page.relative_to(ROOT)} is not linked from any page"


def test_readme_is_a_spine():
    """The README's length follows what it teaches; maintainer notes go to docs/design-notes.md."""
    for marker in ("issue ", "for this draft", "TODO"):
        assert marker not in README, f"maintainer note in the README: {marker!r}"


# ---------------------------------------------------------------- the worked example
def _worked_example(rank, world_size, port, out):
    init_spawned(rank, world_size, port)
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, t = [(1.0, 3.0), (2.0, 0.0)][rank]
    loss = 0.5 * (model(torch.tensor([[x]])) - t).pow(2).sum()
    loss.backward()
    grad = model.module.weight.grad.item()
    opt.step()
    result = [None] * world_size
    dist.all_gather_object(result, (grad, model.module.weight.item()))
    if rank == 0:
        torch.save(result, out)
    del model
    ddp_common.cleanup()


def test_worked_example_of_gradient_averaging(tmp_path):
    spawn(_worked_example, 2, str(tmp_path / "r.pt"))
    (g0, w0), (g1, w1) = torch.load(tmp_path / "r.pt")
    assert g0 == g1 == pytest.approx(1.0)  # (-2 + 4) / 2
    assert w0 == w1 == pytest.approx(0.9)
    # one process with both samples and the mean loss: the same gradient and step
    w = torch.ones(1, 1, requires_grad=True)
    x, t = torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [0.0]])
    (0.5 * (x @ w - t).pow(2)).mean().backward()
    assert w.grad.item() == pytest.approx(1.0) and 1 - 0.1 * w.grad.item() == pytest.approx(0.9)
    assert "w = 1 − 0.1 · 1 = 0.9" in README and "(−2 + 4) / 2 = 1" in README
