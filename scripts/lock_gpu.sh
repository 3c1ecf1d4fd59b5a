#!/usr/bin/env bash
# The GPU worker image's lock: requirements/gpu.in (+ requirements/gpu.overrides.txt) -> requirements/gpu.lock.txt,
# resolved with uv for the image's interpreter and platform (vllm/vllm-openai:v0.20.2: CPython 3.12 on
# Ubuntu 22.04, glibc 2.35 -- vLLM 0.20.2's own wheel is manylinux_2_35), against the package index as it
# was at a fixed instant (--exclude-newer), so a later re-resolution gives the same answer.
#
#   scripts/lock_gpu.sh               write requirements/gpu.lock.txt (`make lock-gpu`)
#   scripts/lock_gpu.sh --check       re-resolve into a copy of the committed lock (its pins preferred, as
#                                     `make lock-gpu` prefers them) and diff: exit 0 current, 1 stale (diff
#                                     printed: gpu.in or the overrides changed what the lock must hold), 2 uv
#                                     failed (e.g. no index)
#   scripts/lock_gpu.sh --pip-check   in the image, after installing the lock: `pip check`, failing on any
#                                     broken requirement other than those gpu.overrides.txt breaks on purpose
#                                     (its `pip-check-allows:` tags)
#
# uv: $UV, else the control venv's (requirements/control.in pins uv==0.13.9), else `uv` on PATH, else
# `python3 -m uv`. The index is uv's default (PyPI) unless UV_DEFAULT_INDEX / UV_INDEX_URL say otherwise;
# uv.toml files are ignored (--no-config) so a developer's config cannot change the lock.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IN=requirements/gpu.in
OVERRIDES=requirements/gpu.overrides.txt
LOCK=requirements/gpu.lock.txt
UV_VERSION=0.13.9
EXCLUDE_NEWER=2026-11-17T00:00:00Z   # a week behind the day it was set: a package index (or mirror) that publishes late cannot change the answer; move forward deliberately (and re-lock)

pip_check() {
    local allowed out unexpected
    allowed="$(sed -n '/^[^#]/s/.*pip-check-allows: *//p' "$ROOT/$OVERRIDES")"  # from requirement lines only
    out="$("${PYTHON:-python3}" -m pip check 2>&1)" || true
    printf '%s\n' "$out"
    unexpected="$(printf '%s\n' "$out" | grep -v -e '^No broken requirements found' -e '^$' | { if [ -n "$allowed" ]; then grep -v -F -e "$allowed"; else cat; fi; } || true)"
    if [ -n "$unexpected" ]; then
        echo "lock_gpu.sh: pip check found broken requirements that $OVERRIDES does not allow:" >&2
        printf '%s\n' "$unexpected" >&2
        return 1
    fi
    echo "lock_gpu.sh: pip check clean (apart from the overrides' pip-check-allows)"
}

find_uv() {
    if [ -n "${UV:-}" ]; then echo "$UV"
    elif [ -x "$ROOT/.venv/control/bin/uv" ]; then echo "$ROOT/.venv/control/bin/uv"
    elif command -v uv >/dev/null 2>&1; then command -v uv
    elif python3 -m uv --version >/dev/null 2>&1; then echo "python3 -m uv"
    else echo "lock_gpu.sh: no uv found: run \`make setup\` (the control venv pins uv==$UV_VERSION) or set UV=/path/to/uv" >&2; return 2
    fi
}

compile() {  # $1: output file
    local uv version
    uv="$(find_uv)" || return 2
    version="$($uv --version | awk '{print $2}')"
    if [ "$version" != "$UV_VERSION" ]; then
        echo "lock_gpu.sh: $uv is uv $version; the lock is made with uv $UV_VERSION (another version may resolve or format differently)" >&2
        return 2
    fi
    cd "$ROOT"
    $uv pip compile "$IN" \
        --overrides "$OVERRIDES" \
        --python-version 3.12 \
        --python-platform x86_64-manylinux_2_35 \
        --exclude-newer "$EXCLUDE_NEWER" \
        --no-config \
        --no-python-downloads \
        --custom-compile-command "make lock-gpu" \
        --quiet \
        --output-file "$1"
}

case "${1:-}" in
    "")
        compile "$ROOT/$LOCK" || exit 2
        echo "lock_gpu.sh: wrote $LOCK ($(grep -c '==' "$ROOT/$LOCK") pins)"
        ;;
    --check)
        tmp="$(mktemp -d)"
        trap 'rm -rf "$tmp"' EXIT
        # Start from the committed lock, as `make lock-gpu` does (uv prefers an output file's pins): the check asks
        # "would re-locking change it?", so a release the index publishes late under an earlier date cannot fail it.
        cp "$ROOT/$LOCK" "$tmp/gpu.lock.txt"
        compile "$tmp/gpu.lock.txt" || exit 2
        if diff -u "$ROOT/$LOCK" "$tmp/gpu.lock.txt"; then
            echo "lock_gpu.sh: $LOCK is current"
        else
            echo "lock_gpu.sh: $LOCK is stale: run \`make lock-gpu\` and commit it" >&2
            exit 1
        fi
        ;;
    --pip-check)
        pip_check
        ;;
    *)
        echo "usage: $0 [--check | --pip-check]" >&2
        exit 2
        ;;
esac
