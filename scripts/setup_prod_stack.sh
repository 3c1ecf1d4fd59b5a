#!/usr/bin/env bash
# Debian's PostgreSQL and Redis for `make prod-stack` (the production executor without Docker:
# infra/local/prod_stack.py). Idempotent; needs root (or sudo) only the first time.
# The S3 side is moto's server from the control environment (MinIO has no Debian package).
set -euo pipefail
need=()
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need+=(postgresql)
command -v redis-server >/dev/null || need+=(redis-server)
if [ ${#need[@]} -eq 0 ]; then
  echo "setup: $(ls -d /usr/lib/postgresql/*/ | tail -1 | xargs basename | sed 's/^/postgresql /') and $(redis-server --version | awk '{print $1, $3}') present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
command -v apt-get >/dev/null || { echo "setup: no apt-get here; install ${need[*]} yourself" >&2; exit 1; }
$SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null \
  || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; }
echo "setup: installed ${need[*]}"
