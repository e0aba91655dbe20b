#!/usr/bin/env bash
# Installs difftest and its pinned ML stack (with the [tf] extra) into ./.venv, whatever virtualenv the shell has
# active, so the README's next command (.venv/bin/difftest run) always exists.
# torchrec is installed with --no-deps: its metadata requires the CUDA build of fbgemm-gpu,
# which does not load on a machine without a GPU driver. We pick the fbgemm build that fits.
set -euo pipefail
cd "$(dirname "$0")"

TORCH=2.14.1
FBGEMM=1.9.0
TORCHREC=1.9.2

PY=.venv/bin/python
if [ -n "${VIRTUAL_ENV:-}" ] && [ "$(cd "$VIRTUAL_ENV" 2>/dev/null && pwd -P)" != "$(pwd -P)/.venv" ]; then
  echo "install.sh: installing into $(pwd)/.venv, not the active virtualenv $VIRTUAL_ENV; run difftest as .venv/bin/difftest" >&2
fi
if [ "${DIFFTEST_INSTALL_PLAN:-}" = 1 ]; then  # say where it would install, change nothing (tests)
  echo "$(pwd)/$PY"
  exit 0
fi
unset VIRTUAL_ENV
[ -x "$PY" ] || python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FBGEMM_PKG="fbgemm-gpu==$FBGEMM"
else
  FBGEMM_PKG="fbgemm-gpu-cpu==$FBGEMM"
fi

pip_install "torch==$TORCH"
pip_install "$FBGEMM_PKG"
pip_install --no-deps "torchrec==$TORCHREC"
# DIFFTEST_EXTRAS=test installs without TensorFlow (DLRM models and PyTorch settings only) and without Ray
pip_install -e ".[${DIFFTEST_EXTRAS:-test,tf,ray}]"
"$PY" -c "import torch, torchrec, fbgemm_gpu; print('difftest stack: torch', torch.__version__, '| torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '$TORCHREC', '| $FBGEMM_PKG')"
