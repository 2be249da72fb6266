#!/usr/bin/env bash
# Check requirements.txt's torch floor: run a named subset of the suite on an older torch.
#
#   bash tests/run_on_old_torch.sh TORCH TORCHVISION [TEST_FILE...]
#   bash tests/run_on_old_torch.sh 2.7.1 0.22.1
#
# Makes a virtual environment OUTSIDE the repo ($VENV, default /tmp/venv-torch<TORCH>) with uv,
# installs that torch/torchvision pair from PyPI with the rest of requirements.txt, then runs each
# test file on its own (-n 1: one worker; the files start several processes each). The tests
# start their processes with sys.executable, so they all run on the old torch. An existing venv
# that already has that torch is reused. PyPI's Linux wheels are CUDA builds (3-5 GB with their
# nvidia-* wheels); they run on the CPU too. Exit status: the number of files that failed.
set -u
if [ $# -lt 2 ]; then
    echo "usage: bash tests/run_on_old_torch.sh TORCH TORCHVISION [TEST_FILE...]" >&2
    exit 2
fi
torch_version=$1
vision_version=$2
shift 2
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
    files=(tests/test_common.py tests/test_minimal.py tests/test_mnist.py
        tests/test_torchrun_restart.py)
fi
cd "$(dirname "$0")/.."
venv=${VENV:-/tmp/venv-torch$torch_version}
python=$venv/bin/python

# uv: on PATH, or installed once into a tools venv of its own.
uv=$(command -v uv || true)
if [ -z "$uv" ]; then
    uv=/tmp/uvtools/bin/uv
    if [ ! -x "$uv" ]; then
        python3 -m venv /tmp/uvtools && /tmp/uvtools/bin/pip install -q uv || exit 1
    fi
fi

have=$("$python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null)
if [ "$have" != "$torch_version" ]; then
    "$uv" venv -q --python "${PYTHON:-python3.11}" "$venv" || exit 1
    # torch 2.4 came out with numpy 2.0: the check ran with numpy 2.0.2 there, 2.4 on torch 2.7.
    pins=()
    case $torch_version in
    2.4.*) pins=("numpy<2.1") ;;
    esac
    # The rest of requirements.txt, without its torch floor (the pair asked for may be below it).
    rest=$(mktemp)
    grep -v -E '^torch(vision)?[<>=]' requirements.txt >"$rest"
    "$uv" pip install -q --python "$python" "torch==$torch_version" \
        "torchvision==$vision_version" -r "$rest" ${pins[@]+"${pins[@]}"}
    installed=$?
    rm -f "$rest"
    if [ $installed -ne 0 ]; then
        exit 1
    fi
fi
"$python" -c "import torch, torchvision; print('torch', torch.__version__, '| torchvision', \
torchvision.__version__, '| python', __import__('sys').version.split()[0])"

failed=0
for file in "${files[@]}"; do
    echo "== $file"
    if ! "$python" -m pytest -q -n 1 "$file"; then
        failed=$((failed + 1))
        echo "FAILED: $file (re-run it alone before believing it: the tests use real processes)"
    fi
done
echo "done: ${#files[@]} files, $failed failed, torch $torch_version + torchvision $vision_version"
exit "$failed"
