#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and no network, run the test suite with the decoder
# tests on CUDA (eager and compiled), then the decoder on random-weight models of real shapes, eager vs
# compiled (benchmarks/real_shapes.py), then every kind for a few bfloat16 training steps, live and
# from the feature store (one process on one GPU; DDP and FSDP on two). It runs from the checkout
# without installing it: draftsmith is put together from symbolic links as pyproject.toml maps it
# (scripts/ is draftsmith, specdec/ is draftsmith.specdec, ...), and wheels in .whl/ (a transformers the image is too old for) are
# installed into a temporary folder. Tests that need datasets or gguf are skipped where those are
# missing. It ends within 8 minutes (each part has its own time limit) and says which versions it ran
# with; with $OUT set, its logs and results are copied there.
#
#   bash benchmarks/gpu_check.sh --fetch-wheels   # where pip reaches PyPI: the wheels to carry, into .whl/
#                                                 # (transformers, datasets, gguf)
#   bash benchmarks/gpu_check.sh                  # on the GPU machine, with .whl/ carried along
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PYTHON=${PYTHON:-python3}
TESTS_S=${TESTS_S:-220}            # time limit of the test suite
BENCHMARKS_S=${BENCHMARKS_S:-150}  # time limit of the benchmarks
REAL_SHAPES_MODES=${REAL_SHAPES_MODES:-eager,compiled}
KINDS_S=${KINDS_S:-100}            # time limit of the kinds' training runs (one GPU; 2 GPUs take longer)

# transformers is the one package whose API the checkout needs newer than the GPU image has (5.17):
# the cache is passed as `cache=`, and a static cache is cropped on rollback.
required_transformers() {
    "$PYTHON" - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(re.search(r">=([0-9.]+)", d).group(1) for d in deps if d.startswith("transformers")))
EOF
}

if [[ ${1:-} == --fetch-wheels ]]; then
    version=$(required_transformers) || exit 2
    # datasets (and what it needs beyond a PyTorch image) and gguf at the versions installed here, for
    # the GPU image's Python (WHEEL_PYTHON, 3.12 by default): without them their tests cannot run there.
    extra=$("$PYTHON" -c "import importlib.metadata as m
print(' '.join(f'{n}=={m.version(n)}' for n in ('datasets', 'dill', 'multiprocess', 'gguf')))") || exit 2
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" -d .whl \
        "transformers==$version" $extra || exit 2
    echo "wheels in $REPO/.whl: carry that folder to the GPU machine and run bash benchmarks/gpu_check.sh there"
    exit 0
fi

WORK=$(mktemp -d)
mkdir -p "$WORK/pkg/draftsmith" "$WORK/site" "$WORK/logs"
for file in scripts/*.py; do ln -s "$REPO/$file" "$WORK/pkg/draftsmith/"; done
for sub in specdec distill train configs; do ln -s "$REPO/$sub" "$WORK/pkg/draftsmith/$sub"; done
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl || exit 2
fi
export PYTHONPATH="$WORK/pkg:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

"$PYTHON" - "$(required_transformers)" <<'EOF' | tee "$WORK/logs/versions.txt" || exit 2
import platform, sys
import torch, transformers
from packaging.version import Version
import draftsmith.specdec.decoder

gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__} from {transformers.__file__.rsplit('/', 2)[0]}, GPU: {gpu}")
print(f"draftsmith from {draftsmith.specdec.decoder.__file__.rsplit('/', 2)[0]}")
if Version(transformers.__version__) < Version(sys.argv[1]):
    sys.exit(f"transformers {transformers.__version__} is older than the checkout needs (>= {sys.argv[1]}): "
             "run bash benchmarks/gpu_check.sh --fetch-wheels where PyPI is reachable and carry .whl along")
if not torch.cuda.is_available():
    sys.exit("no CUDA device: the GPU check needs one")
EOF

status=0
echo "== tests: decoder tests on CUDA, the rest as on any machine (limit ${TESTS_S} s)"
parallel=()
"$PYTHON" -c "import xdist" 2>/dev/null && parallel=(-n 8 --dist loadfile)
DRAFTSMITH_TEST_DEVICES=cuda timeout -s INT "$TESTS_S" "$PYTHON" -m pytest -q -m "not slow and not vllm" \
    "${parallel[@]}" -p no:cacheprovider tests 2>&1 | tee "$WORK/logs/tests.log"
[[ ${PIPESTATUS[0]} == 0 ]] || status=1

echo "== decoder on random-weight models of real shapes, bfloat16, eager vs compiled (limit ${BENCHMARKS_S} s)"
timeout -s INT "$BENCHMARKS_S" "$PYTHON" benchmarks/real_shapes.py --device cuda --dtype bfloat16 \
    --budget-s $((BENCHMARKS_S / 2)) --modes "$REAL_SHAPES_MODES" 2>&1 | tee "$WORK/logs/real_shapes.log"
[[ ${PIPESTATUS[0]} == 0 ]] || status=1

# Each kind for a few bfloat16 steps with a live teacher, then again from the feature store the first
# run filled ($1: the run's name; the rest: how to start distill).
train_kinds() {
    local name=$1 deadline=$((SECONDS + KINDS_S)); shift
    for kind in $("$PYTHON" -c "from draftsmith.distill.drafts import KINDS; print(' '.join(KINDS))"); do
        dtype=bfloat16
        case $kind in
            parallel) opts=('draft.options={"mask_token_id": 2, "k": 3}') ;;
            dflash) opts=(draft.layers=1 'draft.options={"mask_token_id": 2, "block_size": 4}') ;;
            early_exit) opts=(); dtype=auto ;;  # the shared layers keep the target's own dtype
            *) opts=() ;;
        esac
        for cache in false true; do
            if (( SECONDS >= deadline )); then echo "$kind ($name, cache $cache): skipped, past ${KINDS_S} s"; status=1; continue; fi
            run="$WORK/runs/$kind-$name-cache-$cache"
            timeout -s INT $((deadline - SECONDS)) "$@" -m draftsmith.cli distill --config tiny "output_dir=$run" \
                "draft.kind=$kind" "teacher.dtype=$dtype" "${opts[@]}" optim.mixed_precision=bf16 optim.max_steps=4 \
                save.steps=4 log.steps=2 "teacher.cache=$cache" >"$WORK/logs/kind-$kind-$name-$cache.log" 2>&1
            code=$?
            echo "$kind ($name, teacher cache $cache): exit $code, $(tail -c 300 "$run/train_summary.json" 2>/dev/null | tr -d '\n ' || echo 'no train_summary.json')"
            [[ $code == 0 ]] || { status=1; tail -5 "$WORK/logs/kind-$kind-$name-$cache.log"; }
            cat "$run/train_summary.json" >>"$WORK/logs/train_summaries.log" 2>/dev/null
        done
    done
}

gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if (( gpus >= 2 )); then
    echo "== every kind for a few bfloat16 steps on 2 GPUs, DDP and FSDP, live and from the feature store"
    for launch in ddp fsdp; do
        train_kinds "$launch" "$PYTHON" -m accelerate.commands.launch --config_file "configs/accelerate/$launch.yaml" --num_processes 2
    done
else
    echo "== every kind for a few bfloat16 steps on 1 GPU, plain and under the FSDP config, live and from the feature store (limit ${KINDS_S} s each; DDP needs 2 GPUs)"
    train_kinds 1gpu "$PYTHON"
    # accelerate shards with FSDP only on accelerators (on CPUs its FSDP settings give DDP), so the FSDP
    # config's path for each kind (parameters taken after prepare, sharded checkpoints) is run here
    train_kinds fsdp1 "$PYTHON" -m accelerate.commands.launch --config_file configs/accelerate/fsdp.yaml --num_processes 1
fi

echo "== the feature store built by vLLM (extract_hidden_states) beside the bundled target's"
if "$PYTHON" -c "import draftsmith.specdec.vllm_server as v; v.check_engine_importable(v.find_engine())" 2>/dev/null; then
    timeout -s INT 900 "$PYTHON" -m pytest -q -m vllm -p no:cacheprovider tests/scripts/test_data_vllm.py \
        -k "feature_store" 2>&1 | tee "$WORK/logs/vllm_features.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
else
    echo "no vLLM environment: skipped"
fi

echo "== the README's large-target recipe at small scale (benchmarks/large_target_rehearsal.sh, limit ${REHEARSAL_S:-400} s)"
if "$PYTHON" -c "import draftsmith.specdec.vllm_server as v; v.check_engine_importable(v.find_engine())" 2>/dev/null; then
    # the GPUs there are: vLLM over them (the default target's 9 heads split over 1, 3 or 9), training in as many processes
    PYTHON="$PYTHON" DRAFTSMITH="$PYTHON -m draftsmith.cli" PROCESSES=$(( gpus >= 2 ? 2 : 1 )) \
        RESULT="$WORK/logs/large_target_rehearsal.json" timeout -s INT "${REHEARSAL_S:-400}" \
        bash benchmarks/large_target_rehearsal.sh 2>&1 | tee "$WORK/logs/rehearsal.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
else
    echo "no vLLM environment: skipped"
fi

if [[ -n ${OUT:-} ]]; then
    cp "$WORK"/logs/versions.txt "$WORK"/logs/tests.log "$WORK"/logs/real_shapes.log "$WORK"/logs/train_summaries.log "$OUT"/ 2>/dev/null
    tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null
    cp benchmarks/results/real_shapes_cuda.json "$WORK"/logs/large_target_rehearsal.json "$OUT"/ 2>/dev/null
fi
echo "== GPU check $([[ $status == 0 ]] && echo passed || echo FAILED); $(head -1 "$WORK/logs/versions.txt")"
exit $status
