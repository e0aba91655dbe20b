#!/usr/bin/env bash
# Installs difftest and its pinned ML stack (with the [tf] extra) into ./.venv (or the active virtualenv).
# torchrec is installed with --no-deps: its metadata requires the CUDA build of fbgemm-gpu,
# which does not load on a machine without a GPU driver. We pick the fbgemm build that fits.
set -euo pipefail
cd "$(dirname "$0")"

TORCH=2.14.1
FBGEMM=1.9.0
TORCHREC=1.9.2

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
  PY=.venv/bin/python
else
  PY="$VIRTUAL_ENV/bin/python"
fi
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FBGEMM_PKG="fbgemm-gpu==$FBGEMM"
else
  FBGEMM_PKG="fbgemm-gpu-cpu==$FBGEMM"
fi

pip_install "torch==$TORCH"
pip_install "$FBGEMM_PKG"
pip_install --no-deps "torchrec==$TORCHREC"
# DIFFTEST_EXTRAS=test installs without TensorFlow (DLRM models and PyTorch settings only)
pip_install -e ".[${DIFFTEST_EXTRAS:-test,tf}]"
"$PY" -c "import torch, torchrec, fbgemm_gpu; print('difftest stack: torch', torch.__version__, '| torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '$TORCHREC', '| $FBGEMM_PKG')"
