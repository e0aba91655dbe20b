#!/usr/bin/env bash
# Installs difftest and its pinned ML stack (with the [tf] extra) into ./.venv, whatever virtualenv the shell has
# active, so the README's next command (.venv/bin/difftest run) always exists.
# torchrec is installed with --no-deps: its metadata requires the CUDA build of fbgemm-gpu,
# which does not load on a machine without a GPU driver. We pick the fbgemm build that fits.
set -euo pipefail
cd "$(dirname "$0")"

# DIFFTEST_TORCH=2.10 (or 2.10.0) installs that torch release with the fbgemm-gpu, torchrec and torchvision built
# for it (difftest/releases/releases.toml); without it, the newest release difftest supports
read -r TORCH FBGEMM TORCHREC TORCHVISION < <(python3 - "${DIFFTEST_TORCH:-}" <<'PY'
import sys, tomllib
rows = sorted(tomllib.load(open("difftest/releases/releases.toml", "rb"))["release"], key=lambda r: [int(p) for p in r["torch"].split(".")])
wanted = sys.argv[1].strip()
pick = [r for r in rows if not wanted or r["torch"] == wanted or r["torch"].rsplit(".", 1)[0] == wanted or (wanted.count(".") == 2 and r["torch"].rsplit(".", 1)[0] == wanted.rsplit(".", 1)[0])]
if not pick:
    sys.exit(f"install.sh: DIFFTEST_TORCH={wanted} is not supported; difftest supports torch {rows[0]['torch']} to {rows[-1]['torch']}")
row = pick[-1]
print(wanted if wanted.count(".") == 2 else row["torch"], row["fbgemm"], row["torchrec"], row["torchvision"])
PY
)

PY=.venv/bin/python
if [ -n "${VIRTUAL_ENV:-}" ] && [ "$(cd "$VIRTUAL_ENV" 2>/dev/null && pwd -P)" != "$(pwd -P)/.venv" ]; then
  echo "install.sh: installing into $(pwd)/.venv, not the active virtualenv $VIRTUAL_ENV; run difftest as .venv/bin/difftest" >&2
fi
if [ "${DIFFTEST_INSTALL_PLAN:-}" = 1 ]; then  # say where and what it would install, change nothing (tests)
  echo "install.sh: torch $TORCH, fbgemm $FBGEMM, torchrec $TORCHREC, torchvision $TORCHVISION" >&2
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

EXTRAS=${DIFFTEST_EXTRAS:-test,tf,ray,zoo,titan}
pip_install "torch==$TORCH"
# the converters and timm import torchvision, whose build must match torch's
case ",$EXTRAS," in *,tf,*|*,zoo,*) pip_install "torch==$TORCH" "torchvision==$TORCHVISION" ;; esac
pip_install "$FBGEMM_PKG"
pip_install --no-deps "torchrec==$TORCHREC"
# DIFFTEST_EXTRAS=test installs without TensorFlow (DLRM models and PyTorch settings only) and without Ray
pip_install -e ".[$EXTRAS]"
# what this torchrec release needs at run time, but the CUDA fbgemm-gpu (torchrec 1.1 still imports iopath)
TORCHREC_NEEDS=$("$PY" -m difftest.releases.environments torchrec-requirements)
[ -z "$TORCHREC_NEEDS" ] || pip_install $TORCHREC_NEEDS
"$PY" -c "import torch, torchrec, fbgemm_gpu; print('difftest stack: torch', torch.__version__, '| torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '$TORCHREC', '| $FBGEMM_PKG')"
