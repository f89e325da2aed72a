#!/usr/bin/env bash
# The one-GPU check (issues 11 and 22): the CUDA paths no CPU test can run, in one command that fits in 8 minutes
# on one H200 (the CUDA check and the step budgets below sum to 465 s) and cannot pass by accident.
#
#   bash benchmarks/gpu_smoke.sh [OUT_DIR]       # default OUT_DIR: runs/gpu-smoke/<UTC time>-<pid>, a new folder
#   DEVICE=cpu bash benchmarks/gpu_smoke.sh      # this script's mechanics on a CPU: proves nothing about CUDA
#   DISTRIBUTED=1 bash benchmarks/gpu_smoke.sh   # also FSDP, FSDP + LoRA, the sharded teacher, ZeRO-2 (+~6 min)
#   PYTHON=/path/to/python bash ...              # another interpreter than .venv/bin/python
#
# Without a CUDA device (torch.cuda.is_available() false) it stops at once with one line on stderr and writes
# nothing. Otherwise every step runs under its own timeout, even when an earlier one failed:
#   1. the gpu-marked tests (-m gpu); a skipped one fails the step (SPECDISTILL_REQUIRE_GPU=1, and -rs is checked).
#      Among them: an EAGLE-3 head in bf16 on the bf16 compact target, greedy-identical to target-only decoding with
#      CUDA graphs on and off (test_eagle3_runtime.py)
#   2. the data stage on CUDA: specdistill data configs/smoke.yaml target.device=cuda (teacher answers, top-k cache)
#   3. a standalone student, specdistill distill for 2 steps, then 4 resumed from step 2 (bf16 autocast, the chunked
#      head, the CUDA RNG state of this device), on the data of step 2
#   4. an EAGLE-3 head the same way (bf16 autocast, training-time test depth 2, the online teacher's aux states)
#   5. benchmarks/gpu_bench.py (JSON), smaller than its default: paired speedups with their intervals for
#      `specdistill bench` (with fair HF assisted generation), the compact model with CUDA graphs on and off, the
#      generic path, the self draft and an EAGLE-3 head (bf16, graphs on); it exits 1
#      when one of its checks fails (greedy identity, no graph captured in a timed call, self draft acceptance and
#      efficiency, finite speedups inside their intervals)
# The summary (OUT_DIR/summary.txt): PASS/FAIL per step with its seconds of its budget and the device's peak memory
# in use during it (nvidia-smi, sampled every 250 ms: the CUDA context and allocator caches included), then the
# bench's speedups with intervals. Each run writes only to its own new OUT_DIR, its launchers take free ports (an
# accelerate port found free, torchrun --standalone), and a run stopped from outside stops its step: a second run
# meets no file, port or lingering process of the first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
case $DEVICE in
cuda)
    timeout 30 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' >/dev/null 2>&1
    rc=$?
    if ((rc == 3)); then
        echo "gpu_smoke.sh: FAIL: torch.cuda.is_available() is False on ${HOSTNAME:-this machine}: this check needs" \
            "a CUDA GPU (DEVICE=cpu runs only the script's mechanics)" >&2
        exit 1
    elif ((rc != 0)); then
        echo "gpu_smoke.sh: FAIL: $PY cannot import torch (exit $rc); set PYTHON to the project's interpreter" >&2
        exit 1
    fi
    PRECISION=bf16 BENCH_SIZE=(--num-prompts 4 --max-new-tokens 64 --repeats 2) STRETCH=1 ;;
cpu)
    export CUDA_VISIBLE_DEVICES=""  # every step on the CPU, even on a machine with a GPU (auto: fp32 there)
    PRECISION=auto BENCH_SIZE=(--small --num-prompts 3 --max-new-tokens 8 --repeats 2) STRETCH=4 ;;  # budgets x4
*)
    echo "gpu_smoke.sh: FAIL: DEVICE must be cuda or cpu, got '$DEVICE'" >&2
    exit 1 ;;
esac
OUT=${1:-runs/gpu-smoke/$(date -u +%Y%m%dT%H%M%SZ)-$$}
if [[ -e $OUT && -n $(ls -A "$OUT" 2>/dev/null) ]]; then
    echo "gpu_smoke.sh: FAIL: $OUT is not empty; give a new folder (each run keeps its own)" >&2
    exit 1
fi
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
COMMON=(target.device="$DEVICE" tracking=none data.max_prompts=8 data.max_validation_prompts=4)
TRAIN=(train.eval_every=2 train.save_every=2 train.mixed_precision="$PRECISION")
RESULTS=()
STEP_PID= MEM_PID=
# A run stopped from outside stops its step too (timeout passes the signal to the step's process group): nothing
# of it lingers to hold the GPU or a port when the next run starts.
trap '[[ -n $STEP_PID ]] && kill "$STEP_PID"; [[ -n $MEM_PID ]] && kill "$MEM_PID"; exit 143' INT TERM

mem_start() {  # mem_start FILE: sample the device's memory in use into FILE until mem_stop
    MEM_FILE=$1 MEM_PID=
    if [[ $DEVICE == cuda ]] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 >"$MEM_FILE" 2>/dev/null &
        MEM_PID=$!
    fi
}

mem_stop() {  # sets MEM_PEAK: the largest sample since mem_start
    MEM_PEAK="n/a (DEVICE=cpu)"
    [[ $DEVICE == cuda ]] && MEM_PEAK="n/a (no nvidia-smi)"
    if [[ -n $MEM_PID ]]; then
        kill "$MEM_PID" 2>/dev/null
        wait "$MEM_PID" 2>/dev/null
        MEM_PID=
        MEM_PEAK="$(sort -n "$MEM_FILE" | tail -1) MiB"
    fi
}

step() {  # step NAME LOG BUDGET CMD...: run CMD under a BUDGET-second timeout, keep its output, record the result
    local name=$1 log=$OUT/$2 budget=$(($3 * STRETCH)) start=$SECONDS rc
    shift 3
    echo "== $name"
    mem_start "$log.mem"
    timeout -k 5 "$budget" "$@" >"$log" 2>&1 &
    STEP_PID=$!
    wait "$STEP_PID"  # in the background: a signal to this script runs the trap at once, not after the step
    rc=$?
    STEP_PID=
    mem_stop
    local took="$((SECONDS - start)) s of $budget, peak GPU memory $MEM_PEAK"
    if ((rc == 0)); then
        RESULTS+=("PASS $name ($took)")
    elif ((rc == 124 || rc == 137)); then
        RESULTS+=("FAIL $name (timed out: $took; see $log)")
    else
        RESULTS+=("FAIL $name (exit $rc: $took; see $log)")
    fi
    ((rc == 0)) || tail -20 "$log"
}

no_skips() {  # no_skips LOG: pytest's -rs report lists no skipped test
    ! grep -q SKIPPED "$1"
}

check() {  # check NAME CMD...: a PASS/FAIL line for a condition on a step's output
    local name=$1
    shift
    if "$@"; then RESULTS+=("PASS   $name"); else RESULTS+=("FAIL   $name"); fi
}

distill_twice() {  # distill_twice NAME BUDGET LAUNCHER... -- OVERRIDES...: 2 steps, then 4 resumed from step 2
    local name=$1 budget=$2 launcher=()
    shift 2
    while [[ $1 != -- ]]; do launcher+=("$1"); shift; done
    shift
    for steps in 2 4; do
        step "$name, $steps steps" "$name-$steps.log" "$budget" "${launcher[@]}" -m specdistill distill \
            configs/smoke.yaml "${COMMON[@]}" "${TRAIN[@]}" "train.max_steps=$steps" "$@"
    done
    check "$name resumed from its step-2 checkpoint" grep -q "resumed .* from" "$OUT/$name-4.log"
}

# 1. the gpu-marked tests: none may skip
if [[ $DEVICE == cuda ]]; then
    step "gpu-marked tests" gpu-tests.log 110 env SPECDISTILL_REQUIRE_GPU=1 \
        "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests
    check "no gpu-marked test skipped" no_skips "$OUT/gpu-tests.log"
else
    RESULTS+=("SKIP gpu-marked tests (DEVICE=cpu: they need CUDA)")
fi

# 2-4. the data stage, then a student and an EAGLE-3 head trained on its data (one output_dir, two candidates)
# no candidates: the data the two below read (smoke.yaml's tv-cache would add the prompt rows' top-k to it)
step "data stage (target.device=$DEVICE)" data.log 45 "$PY" -m specdistill data configs/smoke.yaml \
    "output_dir=$OUT/smoke" 'candidates=[]' "${COMMON[@]}"
distill_twice student 40 "$PY" -- "output_dir=$OUT/smoke" 'candidates=[{name: student, overrides: {}}]'
HEAD='{draft.init: eagle3, draft.aux_layers: [1, 2, 3], draft.draft_vocab_size: 64, draft.ttt_depth: 2}'  # 4 layers
distill_twice eagle3 40 "$PY" -- "output_dir=$OUT/smoke" "candidates=[{name: eagle3, overrides: $HEAD}]"

# 5. the bench, checked
step "gpu_bench.py ${BENCH_SIZE[*]}" bench.log 120 env PYTHONPATH=. "$PY" benchmarks/gpu_bench.py \
    "${BENCH_SIZE[@]}" --json "$OUT/gpu_bench.json"

if [[ ${DISTRIBUTED:-0} == 1 ]]; then  # outside the 8-minute budget
    PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    ACCELERATE=("$PY" -m accelerate.commands.launch --num_processes 1 --main_process_port "$PORT")
    distill_twice fsdp 90 "${ACCELERATE[@]}" --config_file configs/accelerate/fsdp.yaml -- "output_dir=$OUT/fsdp"
    # one candidate: the preset's second one (tv-cache) reads the offline cache, which on-policy batches cannot use
    distill_twice fsdp-lora 90 "${ACCELERATE[@]}" --config_file configs/accelerate/fsdp.yaml -- \
        "output_dir=$OUT/fsdp-lora" draft.lora=true distill.lmbda=1 'candidates=[]'
    cat >"$OUT/shard_check.py" <<'EOF'
"""The sharded teacher over one process (FSDP2 on the GPU) computes the unsharded teacher's logits.

Under no_grad, not the loop's inference_mode: torch 2.13's FSDP2 single-rank unshard lacks the multi-rank path's
inference-tensor guard ("Inference tensors do not track version counter"); the recipe shards only with >= 2 ranks.
"""
import copy

import torch
from accelerate import PartialState

from specdec_runtime.loading import load_model
from train.distributed import shard_teacher

state = PartialState(cpu=not torch.cuda.is_available())
ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0)).to(state.device)


@torch.no_grad()
def teacher_forward(model, batch):
    return model(**batch, use_cache=False).logits


batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
for dtype, rtol in (("float32", 1e-5), ("bfloat16", 1e-2)):
    teacher, _ = load_model("random:tiny-llama", dtype=dtype, device="cpu")
    full = teacher_forward(copy.deepcopy(teacher).to(state.device), batch).float()
    print(shard_teacher(teacher, state.device, 1))
    diff = (teacher_forward(teacher, batch).float() - full).abs().max().item()
    print(f"{dtype}: max |logit difference| sharded vs full = {diff:.2e} (logits up to {full.abs().max():.2e})")
    assert diff <= rtol * full.abs().max().item(), (dtype, diff)
EOF
    step "sharded teacher vs full (torchrun, 1 process)" shard.log 60 \
        "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 "$OUT/shard_check.py"
    distill_twice zero2 90 "${ACCELERATE[@]}" --config_file configs/accelerate/deepspeed_zero2.yaml -- \
        "output_dir=$OUT/zero2"
fi

echo
{
    [[ $DEVICE == cpu ]] && echo "DEVICE=cpu: a check of this script's mechanics only; it proves nothing about CUDA"
    echo "gpu_smoke.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on ${HOSTNAME:-?}, DEVICE=$DEVICE, $SECONDS s, in $OUT"
    printf '%s\n' "${RESULTS[@]}"
    echo "gpu_bench.py (speedup [95 % interval] per section; $OUT/gpu_bench.json):"
    "$PY" -c 'import json, sys
bench = json.load(open(sys.argv[1]))
print("  device %s, torch %s, transformers %s" % (bench["device"], bench["torch"], bench["transformers"]))
for line in bench["summary"] + ["CHECK FAILED " + x for x in bench["checks"]["failed"]]:
    print("  " + line)
' "$OUT/gpu_bench.json" 2>/dev/null || echo "FAIL   no bench JSON to summarise"
} | tee "$OUT/summary.txt"
! grep -q '^ *\(FAIL\|CHECK FAILED\)' "$OUT/summary.txt"
