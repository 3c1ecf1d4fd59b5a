#!/usr/bin/env bash
# Create (or reuse) the two pinned environments and link them as .venv/control and .venv/model.
#
# Each venv lives in a cache keyed by the hash of its lock file, requirements/contract.txt and its
# interpreter, so a fresh clone (CI) on a machine that already built them links in seconds, and
# changing a lock builds anew without touching the old one. Override the cache with PIPELINE_VENV_ROOT.
#
# requirements/contract.txt (verl and its import closure, no GPU dependencies) goes into both venvs
# with --no-deps after the lock: the control venv reads verl's Hydra YAML, the model venv runs verl's
# model merger and checkpoint manager on CPU (contract tests, pipeline/rl/checkpoint.py).
set -euo pipefail
cd "$(dirname "$0")/.."

ROOT="${PIPELINE_VENV_ROOT:-$HOME/.cache/pubmedqa-society/venvs}"
PY312="${PIPELINE_PY312:-$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.12.1/bin/python}"
PY311="${PIPELINE_PY311:-$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.11.7/bin/python}"
mkdir -p "$ROOT" .venv

CONTRACT=requirements/contract.txt

# name==version pins of a requirements file, names normalised (PEP 503), comments dropped
pins() { sed -e 's/#.*//' -e 's/;.*//' -e 's/[[:space:]]//g' "$1" | awk -F'==' 'NF == 2 { n = tolower($1); gsub(/[-_.]+/, "-", n); print n "==" $2 }'; }

# the pins of file $2 that lock $1 pins otherwise, each "name (lock X, <$3> Y)"; with "all" as $4, also those the lock
# does not pin at all, "name (<$3> Y, not in lock)"
unlike() {  # lock file label [all]
  awk -F'==' -v label="$3" -v all="${4:-}" 'NR == FNR { lock[$1] = $2; next }
    ($1 in lock) && lock[$1] != $2 { printf "%s (lock %s, %s %s) ", $1, lock[$1], label, $2 }
    !($1 in lock) && all != "" { printf "%s (%s %s, not in lock) ", $1, label, $2 }' <(pins "$1") <(pins "$2")
}

# verl's wheel also installs top-level `tests` and `scripts` packages into site-packages; run from
# outside the checkout, `import tests` would find verl's instead of this repository's.
drop_stray_packages() {
  "$1" - <<'EOF'
import importlib.metadata, pathlib, shutil
dist = importlib.metadata.distribution("verl")
for top in ("tests", "scripts"):
    if any(f.parts[0] == top for f in dist.files or []):
        shutil.rmtree(pathlib.Path(str(dist.locate_file(top))), ignore_errors=True)
EOF
}

build() {  # name python lockfile
  local name=$1 py=$2 lock=$3
  # --no-deps on top of the lock would silently replace a locked version: a shared package must share its pin
  local clash
  clash=$(unlike "$lock" "$CONTRACT" contract)
  [ -z "$clash" ] || { echo "setup: $CONTRACT pins differ from $lock: $clash" >&2; exit 1; }
  [ -x "$py" ] || { echo "setup: interpreter $py for '$name' not found (set PIPELINE_PY312/PIPELINE_PY311)" >&2; exit 1; }
  local key
  key=$( (cat "$lock" "$CONTRACT"; "$py" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
  local dir="$ROOT/$name-$key"
  if [ ! -f "$dir/.complete" ]; then
    echo "setup: building $name environment in $dir (first time only)"
    rm -rf "$dir"
    "$py" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    # The lock is a full resolution: --no-deps installs exactly it, with no resolver surprises.
    "$dir/bin/python" -m pip install -q --no-deps -r "$lock"
    "$dir/bin/python" -m pip install -q --no-deps -r "$CONTRACT"
    drop_stray_packages "$dir/bin/python"
    touch "$dir/.complete"
  fi
  ln -sfn "$dir" ".venv/$name"
  echo "setup: $name -> $dir"
}

# Packages unpacked into a folder of their own (pip --target, no deps), put first on the model venv's path by the
# contract tests that read them: the GPU image's vLLM, unsloth, trl and transformers, where the model venv has
# other releases (requirements/gpu-unpacked.txt). Cached like the venvs; each pin must be the GPU lock's.
unpack() {  # name pinfile lockfile python
  local name=$1 file=$2 lock=$3 py=$4
  local clash
  clash=$(unlike "$lock" "$file" "$file" all)
  [ -z "$clash" ] || { echo "setup: $file must pin exactly as $lock: $clash" >&2; exit 1; }
  local key
  key=$(cat "$file" | sha256sum | cut -c1-16)
  local dir="$ROOT/$name-$key"
  if [ ! -f "$dir/.complete" ]; then
    echo "setup: unpacking $name into $dir (first time only)"
    rm -rf "$dir"
    "$py" -m pip install -q --no-deps --no-compile --target "$dir" -r "$file"
    touch "$dir/.complete"
  fi
  ln -sfn "$dir" ".venv/$name"
  echo "setup: $name -> $dir"
}

build control "$PY312" requirements/control.lock.txt
build model "$PY311" requirements/model-cpu.lock.txt
unpack gpu-unpacked requirements/gpu-unpacked.txt requirements/gpu.lock.txt .venv/model/bin/python
