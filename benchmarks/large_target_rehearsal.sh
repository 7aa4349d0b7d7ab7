#!/usr/bin/env bash
# The README's "Distilling a large target" recipe, run as written at small scale on the default target:
#   1. the features by vLLM (answers, top-64 log-probs, EAGLE-3's hidden states), tensor-parallel over
#      TP processes (vLLM's CPU backend runs them as processes; the default target has 9 attention
#      heads, which vLLM splits over 1, 3 or 9 only, so TP is 1 here by default: the suite's
#      tests/scripts/test_data_vllm.py runs TP 2 on a 4-head model);
#   2. training from that store in 2 processes under configs/accelerate/fsdp.yaml (no target forward
#      per step; each process loads only the target tensors the draft reads);
#   3. eval-run and publish.
# It prints each stage's peak resident memory, and per training process the target's parameters it
# loaded, then writes benchmarks/results/large_target_rehearsal.json. About 10 minutes on a 2-core CPU.
#
#   bash benchmarks/large_target_rehearsal.sh                 # the default target, on this machine
#   TARGET=meta-llama/Llama-3.1-8B-Instruct TP=8 PROCESSES=8 PROMPTS=2000 MAX_LENGTH=2048 STEPS=500 \
#       bash benchmarks/large_target_rehearsal.sh             # the same commands at a real size, on GPUs
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
read -ra DRAFTSMITH <<<"${DRAFTSMITH:-.venv/bin/draftsmith}"  # a command, e.g. "python3 -m draftsmith.cli"
PYTHON=${PYTHON:-.venv/bin/python}
TARGET=${TARGET:-smollm2-135m-instruct}
TP=${TP:-1}
PROCESSES=${PROCESSES:-2}
PROMPTS=${PROMPTS:-96}
MAX_LENGTH=${MAX_LENGTH:-256}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-96}
STEPS=${STEPS:-30}
LAYERS=${LAYERS:-2,15,27}  # EAGLE-3's aux layers (2, n/2, n-3) of the 30-layer default target
WORK=${WORK:-$(mktemp -d)}
RESULT=${RESULT:-benchmarks/results/large_target_rehearsal.json}
mkdir -p "$WORK/logs"
export TOKENIZERS_PARALLELISM=false

# Peak resident memory of a command: the largest of the processes it waited for, in KB, into $1 (a
# vLLM server's engine processes are children of the server, not of the command, and are not counted).
peak() {
    local out=$1; shift
    "$PYTHON" - "$out" "$@" <<'EOF'
import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child process's peak
open(sys.argv[1], "w").write(str(kb))
sys.exit(code)
EOF
}

start=$SECONDS
echo "== 1. features by vLLM, tensor-parallel $TP: $PROMPTS prompts the target writes, top-64, hidden states entering layers $LAYERS"
peak "$WORK/logs/data.kb" "${DRAFTSMITH[@]}" data --engine vllm --target "$TARGET" --prompts self \
    --num-prompts "$PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" --output "$WORK/data" --teacher-cache 64 \
    --hidden-layers "$LAYERS" --max-length "$MAX_LENGTH" --tensor-parallel-size "$TP" --no-progress 2>&1 \
    | tee "$WORK/logs/data.log" | tail -4
data_s=$((SECONDS - start))

echo "== 2. EAGLE-3 trained from the store: $PROCESSES processes, configs/accelerate/fsdp.yaml, $STEPS steps"
start=$SECONDS
peak "$WORK/logs/train.kb" "$PYTHON" -m accelerate.commands.launch --config_file configs/accelerate/fsdp.yaml \
    --num_processes "$PROCESSES" -m draftsmith.cli distill --config smollm2-135m-eagle3 "target=$TARGET" \
    "data.dataset=$WORK/data" "data.max_length=$MAX_LENGTH" "output_dir=$WORK/run" "optim.max_steps=$STEPS" \
    "save.steps=$STEPS" "log.steps=$STEPS" data.heldout=4 optim.batch_size=4 2>&1 | tee "$WORK/logs/train.log" | tail -3
train_s=$((SECONDS - start))

echo "== 3. eval-run and publish"
start=$SECONDS
peak "$WORK/logs/eval.kb" "${DRAFTSMITH[@]}" eval-run "$WORK/run" --limit 4 --max-new-tokens 48 --gammas 1,2 \
    2>&1 | tee "$WORK/logs/eval.log" | tail -4
"${DRAFTSMITH[@]}" publish "$WORK/run" --out "$WORK/published" 2>&1 | tee "$WORK/logs/publish.log" | tail -2
eval_s=$((SECONDS - start))

"$PYTHON" - "$WORK" "$RESULT" "$data_s" "$train_s" "$eval_s" "$TP" "$PROCESSES" "$TARGET" <<'EOF'
import json, os, platform, sys
from pathlib import Path
work, result = Path(sys.argv[1]), Path(sys.argv[2])
data_s, train_s, eval_s, tp, processes, target = *map(int, sys.argv[3:8]), sys.argv[8]
summary = json.loads((work / "run" / "train_summary.json").read_text())
store = next((work / "data" / "feature-store").glob("*/meta.json"))
flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
report = {
    "target": target,
    "tensor_parallel_size": tp,
    "train_processes": processes,
    "seconds": {"data": data_s, "train": train_s, "eval_and_publish": eval_s},
    "peak_rss_mb": {s: int((work / "logs" / f"{s}.kb").read_text()) // 1024 for s in ("data", "train", "eval")},
    "train_peak_rss_mb_per_process": [b // 2**20 for b in summary["peak_rss_bytes"]],
    "target_parameters": summary["target_parameters"],
    "target_parameters_loaded_per_process": summary["target_parameters_loaded"],
    "teacher_forwards": summary["teacher_forwards"],
    "teacher": summary["teacher"],
    "store": json.loads(store.read_text()),
    "published": sorted(p.name for p in (work / "published").iterdir()),
    "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags},
}
result.parent.mkdir(parents=True, exist_ok=True)
result.write_text(json.dumps(report, indent=2) + "\n")
share = [round(n / summary["target_parameters"], 3) for n in summary["target_parameters_loaded"]]
print(f"peak RSS (MB): the data command {report['peak_rss_mb']['data']} (its vLLM server's engine processes: "
      f"benchmarks/feature_store_memory.py), training {report['train_peak_rss_mb_per_process']} per process, "
      f"eval-run {report['peak_rss_mb']['eval']}")
print(f"target parameters loaded per training process: {summary['target_parameters_loaded']} of "
      f"{summary['target_parameters']} ({share}); teacher forwards in training: {summary['teacher_forwards']}")
print(f"minutes: data {data_s / 60:.1f}, training {train_s / 60:.1f}, eval-run and publish {eval_s / 60:.1f}; {result}")
EOF
