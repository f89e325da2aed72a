#!/usr/bin/env bash
# GPU smoke run of the training paths that have never run on a GPU (issue 11): one GPU, one process each, under 10
# minutes on an H200. Every step runs even when an earlier one fails; the summary at the end says which passed.
#
#   bash benchmarks/gpu_smoke.sh [OUT_DIR]          # default OUT_DIR: runs/gpu-smoke (wiped first)
#   DEVICE=cpu bash benchmarks/gpu_smoke.sh         # the script's own mechanics on a CPU (FSDP is then off)
#
# Steps:
#   1. the gpu-marked tests (skipped everywhere else)
#   2. specdistill distill configs/smoke.yaml target.device=cuda for 2, then 4 steps: bf16 autocast, chunked head,
#      a resume on CUDA (the CUDA RNG state of this device only)
#   3. the same under accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 1 (FSDP2 student,
#      fp32 gradient reduction, fsdp_cpu_ram_efficient_loading on), and again with draft.lora=true distill.lmbda=1
#      (a LoRA student merged into best/ from the gathered state; on-policy generation by the sharded student)
#   4. the sharded teacher (train/distributed.py shard_teacher) under torchrun --nproc_per_node 1 against the
#      unsharded model: the same logits, fp32 and bf16
#   5. DeepSpeed ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml) with one process, 2 then 4 steps
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${1:-runs/gpu-smoke}
rm -rf "$OUT" && mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
DEVICE=${DEVICE:-cuda}
SMALL=(target.device=$DEVICE tracking=none data.max_prompts=8 data.max_validation_prompts=4 train.eval_every=2
       train.save_every=2)
RESULTS=()

step() {  # step NAME LOGFILE CMD...: run CMD (at most 240 s), keep its output, record PASS/FAIL
    local name=$1 log=$OUT/$2; shift 2
    local start=$SECONDS rc
    echo "== $name"
    timeout 240 "$@" >"$log" 2>&1
    rc=$?
    if ((rc == 0)); then RESULTS+=("PASS $name ($((SECONDS - start)) s)")
    else RESULTS+=("FAIL $name ($((SECONDS - start)) s, exit $rc, see $log)"); tail -20 "$log"; fi
}

resumed() {  # resumed LOGFILE: the second run continued from the first one's checkpoint
    if grep -q "resumed .* from" "$OUT/$1"; then RESULTS+=("PASS   resumed ($1)"); else RESULTS+=("FAIL   no resume in $1"); fi
}

distill_twice() {  # distill_twice NAME LAUNCHER... -- OVERRIDES...: 2 steps, then 4 resumed from step 2
    local name=$1; shift
    local launcher=()
    while [[ $1 != -- ]]; do launcher+=("$1"); shift; done; shift
    for steps in 2 4; do
        step "$name, $steps steps" "$name-$steps.log" "${launcher[@]}" -m specdistill distill configs/smoke.yaml \
            "output_dir=$OUT/$name" "${SMALL[@]}" "train.max_steps=$steps" "$@"
    done
    resumed "$name-4.log"
}

ACCELERATE=("$PY" -m accelerate.commands.launch --num_processes 1 --main_process_port 29631)

step "gpu-marked tests" gpu-tests.log "$PY" -m pytest -q -m gpu tests
distill_twice single "$PY" --
distill_twice fsdp "${ACCELERATE[@]}" --config_file configs/accelerate/fsdp.yaml --
# one candidate: the preset's second one (tv-cache) reads the offline cache, which on-policy batches cannot use
distill_twice fsdp-lora "${ACCELERATE[@]}" --config_file configs/accelerate/fsdp.yaml -- draft.lora=true distill.lmbda=1 \
    'candidates=[]'

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
step "sharded teacher vs full (torchrun, 1 process)" shard.log \
    "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 "$OUT/shard_check.py"
distill_twice zero2 "${ACCELERATE[@]}" --config_file configs/accelerate/deepspeed_zero2.yaml --

echo; echo "== summary ($OUT)"; printf '%s\n' "${RESULTS[@]}" | tee "$OUT/summary.txt"
! grep -q '^FAIL' "$OUT/summary.txt"
