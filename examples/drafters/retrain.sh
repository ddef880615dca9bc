#!/usr/bin/env bash
# Retrain the committed DSpark / DFlash pair from the committed corpus (examples/drafters/README.md).
# Every stage skips what is already done, so a session that stops can rerun this script.
#   STEPS   training steps of both drafters (one schedule; sessions continue with --resume)
#   AB_AT   the step at which the warm-start A/B is decided (both arms are also reported at step 200)
#   PRECISION  bf16 (autocast) where the CPU multiplies bf16 natively, else fp32 (train refuses
#              bf16 on a CPU without AVX512-BF16 or AMX: emulated, it is slower than fp32)
#   MODE  the pair calibrate takes: the A/B's winner by default; the RUN name after `continue`
#   RUN   the name of a continuation (runs/<drafter>-RUN; default "continued"); each new warm
#         restart needs a new name, since a finished run is never trained again
#   AB_STEPS  steps of each arm of the teacher-forced data A/B (teacher-ab)
# Usage: bash examples/drafters/retrain.sh [features|ab|pair|continue|calibrate|acceptance|teacher-ab|all]
#   continue: a warm restart of the committed pair (its weights, a new schedule of STEPS) on
#             the features of the whole corpus; then `MODE=$RUN ... calibrate`
set -euo pipefail
cd "$(dirname "$0")/../.."
source examples/env.sh
T=$VLLM_DSPARK_CACHE/targets/SmolLM2-135M-Instruct
STEPS=${STEPS:-3000}
LR=${LR:-6e-4}
AB_AT=${AB_AT:-1000}
VOCAB=${VOCAB:-4096}
RANK=${RANK:-24}
CLI=.venv/bin/vllm-dspark
PRECISION=${PRECISION:-$(.venv/bin/python -c "from vllm_dspark.training.distributed import cpu_has_bf16_matmul as native
print('bf16' if native() else 'fp32')")}
CORPUS=examples/drafters/corpus/smollm2-generated.jsonl.xz
F=runs/features2
COMMON=(--target "$T" --features $F/train --heldout $F/heldout --heldout-anchors 16 --steps "$STEPS"
        --lr "$LR" --warmup-frac 0.04 --batch-seqs 4 --anchors-per-seq 32 --seed 0 --save-every 100
        --save-dtype bfloat16 --precision "$PRECISION")
stage=${1:-all}
mkdir -p logs runs

features() {
  [ -f data/train.jsonl ] || { mkdir -p data; xz -dc $CORPUS > data/train.jsonl; }
  $CLI extract-features --target "$T" --data data/train.jsonl --out $F/train --heldout-out $F/heldout \
    --heldout-frac 0.05 --layers 1 8 14 20 27 --max-seq-len 1024 --soft-label-topk 64 --precision "$PRECISION"
}

init() {  # init NAME MARKOV_RANK MODE(random|warm)
  local out=runs/init/$1-$3 extra=()
  [ "$3" = warm ] && extra=(--layers-from-target)
  [ -f $out/model.safetensors ] || $CLI init-drafter --target "$T" --out $out --num-layers 2 --block-size 7 \
    --markov-rank "$2" --markov-head-type vanilla --seed 0 --draft-vocab-size "$VOCAB" --corpus $CORPUS "${extra[@]}"
}

train() {  # train NAME MODE INIT [extra args]: one thread from drafter INIT, resumes a stopped run
  local name=$1 mode=$2 out=runs/$1-$2 init=$3; shift 3
  local resume=()
  [ -f $out/checkpoint/trainer_state.pt ] && resume=(--resume)
  [ -f $out/model.safetensors ] && return 0
  local init_args=()
  [ ${#resume[@]} -eq 0 ] && init_args=(--init "$init")
  OMP_NUM_THREADS=1 $CLI train "${COMMON[@]}" --out $out "${init_args[@]}" "${resume[@]}" "$@" > logs/train-$name-$mode.log 2>&1
}

tau_at() {  # tau_at RUN STEP: held-out accepted length of RUN's checkpoint at STEP
  python3 -c "import json,sys; rows=[json.loads(l) for l in open('runs/$1/heldout_log.jsonl')];
print(next(r['tau'] for r in rows if r['step'] == $2))"
}

ab() {  # warm start against random init, DSpark, equal steps of the same schedule
  init dspark "$RANK" random; init dspark "$RANK" warm
  for mode in random warm; do
    [ -f runs/dspark-$mode/heldout_log.jsonl ] && grep -q "\"step\": $AB_AT," runs/dspark-$mode/heldout_log.jsonl && continue
    train dspark $mode runs/init/dspark-$mode --stop-at "$AB_AT" &
  done
  wait
  for step in 200 "$AB_AT"; do
    echo "held-out tau at step $step: random $(tau_at dspark-random $step), warm $(tau_at dspark-warm $step)"
  done
}

winner() {
  python3 -c "import sys; r, w = float(sys.argv[1]), float(sys.argv[2]); print('warm' if w > r else 'random')" \
    "$(tau_at dspark-random $AB_AT)" "$(tau_at dspark-warm $AB_AT)"
}

pair() {  # the winner's DSpark continues its schedule; DFlash (markov_rank 0) trains beside it
  local mode; mode=$(winner)
  echo "init: $mode"
  init dflash 0 "$mode"
  train dspark "$mode" runs/init/dspark-$mode & train dflash "$mode" runs/init/dflash-$mode & wait
}

continue_pair() {  # the committed pair's weights, a new schedule on the current features
  local name
  for name in dspark dflash; do
    train $name "${RUN:-continued}" examples/drafters/smollm2-$name-b7 &
  done
  wait
}

calibrate() {  # a continued pair keeps the logs of the schedules before it under previous/
  local mode=${MODE:-$(winner)}
  for name in dspark dflash; do
    local out=examples/drafters/smollm2-$name-b7 keep=runs/$name-$mode/previous-logs
    if [[ $mode == continued* ]] && [ ! -d $keep ]; then  # the committed logs this run went on from
      mkdir -p $keep && cp $out/train_log.jsonl $out/heldout_log.jsonl $keep/
      [ -d $out/previous ] && cp -r $out/previous $keep/
    fi
    rm -rf $out && mkdir -p $out
    [ -d $keep ] && cp -r $keep $out/previous
    $CLI calibrate --target "$T" --drafter runs/$name-$mode --features $F/heldout --out $out --png $out/reliability.png
    cp runs/$name-$mode/train_log.jsonl runs/$name-$mode/heldout_log.jsonl $out/
  done
}

teacher_ab() {  # does ShareGPT's own text (teacher-forced, labelled by the target) help? DSpark, equal steps
  local tf=runs/features-teacher steps=${AB_STEPS:-1000}
  [ -f data/teacher_forced.jsonl ] || $CLI teacher-forced-data --target "$T" --out data/teacher_forced.jsonl \
    --response-tokens 300000 --exclude data/train.jsonl
  $CLI extract-features --target "$T" --data data/teacher_forced.jsonl --out $tf/train \
    --layers 1 8 14 20 27 --max-seq-len 1024 --soft-label-topk 64 --precision "$PRECISION"  # resumes
  train dspark ab-core examples/drafters/smollm2-dspark-b7 --steps "$steps" &
  train dspark ab-teacher examples/drafters/smollm2-dspark-b7 --steps "$steps" --features $F/train $tf/train &
  wait
  for arm in ab-core ab-teacher; do echo "$arm: held-out tau at step $steps: $(tau_at dspark-$arm "$steps")"; done
}

acceptance() {
  .venv/bin/python benchmarks/acceptance.py --num-prompts "${PROMPTS:-30}" --max-new-tokens "${TOKENS:-64}" --jobs 2
}

case $stage in
  features) features ;;
  ab) ab ;;
  pair) pair ;;
  continue) continue_pair ;;
  calibrate) calibrate ;;
  acceptance) acceptance ;;
  teacher-ab) teacher_ab ;;
  all) features; ab; pair; calibrate; acceptance ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
