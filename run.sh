#!/usr/bin/env bash
# longformer-jax set-up and entry points. Each command creates .venv when it is missing.
#
#   ./run.sh demo    train char_tiny on the bundled Wikipedia sample (CPU, ~10 min), evaluate
#                    test bits-per-character, plot the curves
#   ./run.sh test    install the test extras (torch for the HF parity tests, libtpu for the
#                    TPU compile tests) and the demo's (tensorboardX: the suite runs with what a
#                    newcomer has installed) and run the whole suite (CI); extra args go to pytest
#   ./run.sh fast    the same set-up, then the fast tier: -m "not integration and not slow"
#   ./run.sh bench   the attention benchmark (benchmarks/attention.py), extra args passed on
#
# The interpreter: $PYTHON if set, else the first python >= 3.12 (3.12 preferred) found on
# PATH, in pyenv or in the usual install prefixes (current JAX needs 3.12+; python 3.11 stops at jax 0.10).
set -euo pipefail
cd "$(dirname "$0")"

VENV=${VENV:-.venv}

python_ok() {  # python_ok EXE -> succeeds for a working interpreter >= 3.12
  "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

find_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    python_ok "$PYTHON" || { echo "PYTHON=$PYTHON is not a working python >= 3.12" >&2; return 1; }
    echo "$PYTHON"; return
  fi
  local candidates=()
  for v in 3.12 3.13 3.14; do  # 3.12 first: every dependency has wheels for it
    candidates+=("$(command -v "python$v" 2>/dev/null || true)")
  done
  local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  # pyenv shims fail unless the version is selected, so look at the installs themselves.
  candidates+=($(ls -d "$pyenv_root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V || true))
  candidates+=(/usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9] /opt/homebrew/bin/python3.1[2-9]
               "$(command -v python3 2>/dev/null || true)")
  for exe in "${candidates[@]}"; do
    [[ -n "$exe" && -x "$exe" ]] && python_ok "$exe" && { echo "$exe"; return; }
  done
  echo "no python >= 3.12 found (looked on PATH, in $pyenv_root/versions and /usr/{local/,}bin);" \
       "install one or set PYTHON=/path/to/python3.12" >&2
  return 1
}

ensure_venv() {  # ensure_venv EXTRAS
  local extras=$1 stamp="$VENV/.installed-$1"
  if [[ ! -x "$VENV/bin/python" ]]; then
    local py; py=$(find_python)
    echo "[run.sh] creating $VENV with $py ($("$py" -V 2>&1))"
    "$py" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
  fi
  # Reinstall when pyproject.toml changes.
  local want; want=$("$VENV/bin/python" -c \
    'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest()[:16])')
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "[run.sh] installing longformer-jax[$extras] into $VENV ($("$VENV/bin/python" -V 2>&1))"
    "$VENV/bin/python" -m pip install -q -e ".[$extras]"
    echo "$want" > "$stamp"
  fi
}

cmd=${1:-help}
shift || true
case "$cmd" in
  demo)
    ensure_venv demo
    exec "$VENV/bin/python" -m train.charlm --config train/configs/char_tiny.py "$@"
    ;;
  test|fast)
    # tpu: libtpu's compile-only TPU client (tests/test_tpu_aot.py compiles for TPU slices on
    # this CPU). A venv with libtpu prints a few lines of libtpu warnings on the first jax use
    # when JAX_PLATFORMS is unset; JAX_PLATFORMS=cpu (the tests' setting) avoids them.
    # demo too: every extra the README's commands install, so that the suite sees what a
    # newcomer's venv has after `./run.sh demo` (tensorboardX logs through the training loop).
    ensure_venv test,torch,tpu,demo
    "$VENV/bin/python" -c 'import jax, flax, sys; print(f"[run.sh] python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}")'
    "$VENV/bin/python" -m ruff check .
    # Tiers are markers (pyproject.toml, tests/conftest.py); the fast tier leaves out the command
    # lines, multi-process and whole training runs, and the costly kernel and TPU suites.
    tier=(); [[ "$cmd" == fast ]] && tier=(-m "not integration and not slow")
    # --no-loadscope-reorder: keep conftest.py's order (costly modules first) instead of xdist's
    # (modules with the most tests first, which leaves the long single-test modules for last).
    exec "$VENV/bin/python" -m pytest -n 2 --dist loadscope --no-loadscope-reorder "${tier[@]}" "$@"
    ;;
  bench)
    ensure_venv test
    exec "$VENV/bin/python" benchmarks/attention.py "$@"
    ;;
  *)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
