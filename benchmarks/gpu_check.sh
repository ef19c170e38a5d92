#!/usr/bin/env bash
# GPU check: a real pair in bf16 on this machine's GPUs, three ways: the models whole on one GPU,
# spread by --device-map auto, and data-parallel over every visible GPU with torchrun. Prints the
# wall time of each run (loading included) and both alphas; the alphas of the three runs should
# agree to the last digit printed (bf16 kernels on different devices can move the last bits).
#
#   bash benchmarks/gpu_check.sh                      # SmolLM2 from ../shared/models
#   MODEL=Qwen/Qwen2.5-7B-Instruct DRAFT=Qwen/Qwen2.5-0.5B-Instruct bash benchmarks/gpu_check.sh
#
# Needs torch with CUDA, and this repo's requirements (pip install -r requirements.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ -n "${DRAFT:-}" ]; then drafts=(--draft "$DRAFT"); else drafts=(--draft-layers 24); fi
N=${PROMPTS:-32}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge 1 ] || { echo "no CUDA GPU visible: this check needs one" >&2; exit 2; }
out=$(mktemp -d)
common=(--target "$MODEL" "${drafts[@]}" --simulate --max-samples "$N" --continuation-tokens 64
        --dtype bfloat16 --batch-size 8 --quiet)

run() {  # name, then the command; prints a table row
  local name=$1; shift
  local t0 t1
  t0=$(date +%s.%N)
  "$@" "${common[@]}" --json "$out/$name.json" > "$out/$name.txt"
  t1=$(date +%s.%N)
  python3 - "$name" "$out/$name.json" "$t0" "$t1" <<'PY'
import json, sys
name, path, t0, t1 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
r = json.load(open(path))
r = r[0] if isinstance(r, list) else r
print(f"| {name} | {t1 - t0:.1f} s | {r['alpha']:.4f} | {r['empirical_alpha']:.4f} | "
      f"{r['empirical_tokens_per_cycle']:.3f} |")
PY
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
echo "model: $MODEL; drafts: ${drafts[*]}; $N prompts x 64 tokens, bf16, $gpus GPU(s)"
echo "| run | wall time | alpha (teacher-forced) | alpha (simulated) | tokens/cycle |"
echo "|---|---|---|---|---|"
run one-gpu python3 specdec.py --device cuda
run device-map python3 specdec.py --device-map auto
run "torchrun-x$gpus" python3 -m torch.distributed.run --nproc_per_node "$gpus" specdec.py
