#!/usr/bin/env bash
# One GPU check, about 8 minutes on one GPU; prints one summary table at the end.
#
#   1. the CUDA-marked tests (pytest -m cuda);
#   2. scripts/bench_train.py at the 124M shape in bf16: HF's LlamaForCausalLM, minillm eager and
#      compiled, each with and without activation checkpointing (tokens/s, MFU against the GPU's
#      datasheet bf16 peak, peak memory);
#   3. a 200-step `minillm train` of configs/small.yaml with train.batch_size: auto, without and
#      with activation checkpointing (the micro-batch chosen, tokens/s, MFU, final val loss).
#
#   scripts/gpu_check.sh             # on the GPU machine, from the repository root
#   scripts/gpu_check.sh --dry-run   # the same steps at toy sizes on the CPU (seconds; a test)
#
# PYTHON (default: python) runs everything; GPU_CHECK_DIR (default: a new temporary folder) holds
# the logs, the tokenized data and the runs. A step that fails is reported in the table and the
# script goes on; the exit code is 1 if any step failed.
set -uo pipefail

DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python}
WORK=${GPU_CHECK_DIR:-$(mktemp -d -t minillm-gpu-check.XXXXXX)}
mkdir -p "$WORK"
STATUS="$WORK/status.txt"
: >"$STATUS"

if [ "$DRY" = 1 ]; then
  BENCH=(--device cpu --shapes tiny --compile no --checkpointing both --steps 2 --warmup 1
         --peak-seconds 0.05 --threads 0)
  CONFIG=configs/tiny.yaml
  # A toy model and run: the same code paths (tokenize, auto batch, checkpointing) in seconds.
  TRAIN=(--set train.device=cpu --set model.d_model=32 --set model.n_layer=2 --set model.n_head=2
         --set model.max_seq_len=64 --set train.seq_len=64 --set train.batch_tokens=512
         --set train.max_steps=4 --set train.log_every=2 --set train.eval_steps=2
         --set data.vocab_size=300 --set train.warmup_steps=1)
else
  BENCH=(--shapes 124m --dtype bf16 --compile both --checkpointing both --steps 10 --warmup 3)
  CONFIG=configs/small.yaml
  TRAIN=(--set train.max_steps=200 --set train.batch_tokens=131072 --set train.log_every=20
         --set train.warmup_steps=20 --set train.eval_steps=20)
fi
TRAIN+=(--set data.out_dir="$WORK/tokens" --set train.batch_size=auto --set train.eval_every=0
        --set train.ckpt_every=0)

# run NAME LOG CMD...: run a step, tee its output into LOG, record its exit status.
run() {
  local name=$1 log=$2
  shift 2
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  echo "$name|$rc|$((SECONDS - t0))" >>"$STATUS"
  return 0
}

# Only the files that hold `cuda` tests are collected: a GPU image need not have every test's
# peers (fastapi, openai, llama_cpp, ...) installed, and a collection error would fail the step.
CUDA_TESTS=$(grep -l "pytest.mark.cuda" tests/test_*.py)
run "cuda tests" "$WORK/tests.log" "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs $CUDA_TESTS
run "bench_train" "$WORK/bench.log" "$PY" scripts/bench_train.py "${BENCH[@]}"
run "tokenize" "$WORK/tokenize.log" "$PY" -m minillm tokenize "$CONFIG" --set data.out_dir="$WORK/tokens" \
  "${TRAIN[@]}"
for ckpt in false true; do
  run "train ckpt=$ckpt" "$WORK/train_$ckpt.log" "$PY" -m minillm train "$CONFIG" "${TRAIN[@]}" \
    --set train.activation_checkpointing=$ckpt --set train.out_dir="$WORK/run_$ckpt" --no-resume --force
done

"$PY" - "$WORK" "$DRY" <<'EOF'
"""The summary table: each step's status, bench_train's rows, the two training runs."""
import re
import sys
from pathlib import Path

work, dry = Path(sys.argv[1]), sys.argv[2] == "1"
print("\n" + "=" * 100)
print(f"gpu_check summary{' (--dry-run: toy sizes on the CPU)' if dry else ''}; logs in {work}")
print("=" * 100)
print(f"{'step':28} {'exit':>4} {'seconds':>8}")
for line in (work / "status.txt").read_text().splitlines():
    name, rc, secs = line.split("|")
    print(f"{name:28} {rc:>4} {secs:>8}")

bench = (work / "bench.log").read_text() if (work / "bench.log").exists() else ""
rows = [l for l in bench.splitlines() if re.match(r"(HF Llama|minillm)", l)]
header = [l for l in bench.splitlines() if "ms/step" in l]
shape = [l for l in bench.splitlines() if l.startswith("== ")]
print("\nbench_train.py" + (f" {shape[0][3:]}" if shape else ""))
for line in header[:1] + rows:
    print("  " + line)

print(f"\n{'minillm train':20} {'micro x accum':>14} {'tok/s':>10} {'mfu':>7} {'val loss':>9}")
for ckpt in ("false", "true"):
    log = work / f"train_{ckpt}.log"
    text = log.read_text() if log.exists() else ""
    chosen = re.search(r"micro-batch (\d+) x grad_accum (\d+)", text)
    steps = re.findall(r"tok/s ([\d,]+)(?:\s+mfu ([\d.]+%))?", text)
    val = re.findall(r"val loss ([\d.]+)", text)
    print(f"{'checkpointing ' + ckpt:20} "
          f"{(chosen.group(1) + ' x ' + chosen.group(2)) if chosen else '-':>14} "
          f"{steps[-1][0] if steps else '-':>10} {(steps[-1][1] or '-') if steps else '-':>7} "
          f"{val[-1] if val else '-':>9}")
EOF

! grep -qv '|0|' "$STATUS"
