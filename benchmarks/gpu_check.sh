#!/usr/bin/env bash
# The GPU checks (issue 30), for a machine with a CUDA device and torch but not necessarily difftest installed: runs
# difftest from this checkout. Steps (any of them, in order): tests | cpu-vs-gpu | cuda-sweep. Keras models need
# TensorFlow to be generated; where it is absent, a run folder generated elsewhere is read from $KERAS_RUN (its
# torchrec models removed where torchrec is absent). Logs and CSVs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
difftest() { python3 -c 'from difftest.cli import main; main()' "$@"; }
work=$(mktemp -d)

# The largest calibrated ratio and |difference| per setting, and the verdicts.
table() {
  python3 - "$1" <<'EOF'
import sys
import pandas as pd
rows = pd.read_csv(f"{sys.argv[1]}/comparisons.csv")
rows = rows[~rows.setting.str.startswith("calib-")]
by = rows.groupby("setting").agg(cases=("model", "nunique"), worst_ratio=("calibrated_ratio", "max"),
                                 worst_linf=("linf", "max"), not_ok=("status", lambda s: int((s != "ok").sum())))
pd.set_option("display.width", 200)
print(by.sort_values("worst_ratio", ascending=False).to_string())
EOF
}

for step in "$@"; do
  case $step in
    tests)
      python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/gpu_tests.log" | tail -20
      ;;
    cpu-vs-gpu)
      settings='cuda/reference,cuda-tf32/reference,rerun/cuda/reference,cuda/accumulate/mb2,cuda/quant/bf16-autocast,cuda/ddp/default/ws2,cuda/fsdp2/per-layer/reshard/fp32/ws2,cuda/tp/colwise-rowwise/ws2'
      difftest generate --models 3 --kind transformer --out "$work/cvg" >/dev/null
      runs=("$work/cvg")
      if [ -n "${KERAS_RUN:-}" ]; then cp -r "$KERAS_RUN" "$work/keras" && runs+=("$work/keras"); fi
      for run in "${runs[@]}"; do
        /usr/bin/time -f "sweep %e s" python3 -c 'from difftest.cli import main; main()' sweep "$run" \
          --settings "$settings" --device cpu 2>&1 | tail -4
        difftest analyze "$run" --minimise-budget 0 > "$run/analyze.log" 2>&1
        tail -25 "$run/analyze.log"
        table "$run" | tee "$OUT/cpu_vs_gpu_$(basename "$run").txt"
        cp "$run/comparisons.csv" "$OUT/cpu_vs_gpu_$(basename "$run")_comparisons.csv"
      done
      ;;
    cuda-sweep)
      if [ -n "${KERAS_RUN:-}" ]; then cp -r "$KERAS_RUN" "$work/cuda"
      else difftest generate --models 2 --kind transformer --out "$work/cuda" >/dev/null; fi
      for run in "$work/cuda"; do
        # a sweep cut off by $SWEEP_LIMIT is judged as far as it got (a rerun would resume it)
        /usr/bin/time -f "sweep %e s" timeout "${SWEEP_LIMIT:-3600}" python3 -c 'from difftest.cli import main; main()' \
          sweep "$run" --device cuda --backend gloo --jobs "${JOBS:-4}" --models-filter "${MODELS:-*}" \
          --minimise-budget 0 2>&1 | tail -4
        difftest analyze "$run" --minimise-budget 0 > "$run/analyze.log" 2>&1
        tail -40 "$run/analyze.log"
        python3 - "$run" <<'EOF' | tee "$OUT/cuda_sweep_$(basename "$run").txt"
import sys, pandas as pd
rows = pd.read_csv(f"{sys.argv[1]}/inconsistencies.csv")
bad = rows[rows.status.isin(["error", "crash", "timeout"])].drop_duplicates(["setting", "message"])
for r in bad.itertuples():
    print(f"{r.status}\t{r.setting}\t{str(r.message)[:700]}")
rows = pd.read_csv(f"{sys.argv[1]}/comparisons.csv")
flagged = rows[rows.status.isin(["inconsistent", "nondeterministic"])].sort_values("linf", ascending=False)
print(flagged[["model", "setting", "phase", "tensor", "linf", "calibrated_ratio"]].head(12).to_string())
EOF
        table "$run" > "$OUT/cuda_sweep_$(basename "$run")_ratios.txt"
      done
      ;;
  esac
done
