#!/usr/bin/env bash
# Every GPU check in one go, each stage under its own time limit; under $OUT (default ./gpu-out) one log (run.log)
# and the stages' figures and data (device.json, bench-summary.json, distill.tar, shipped.tar):
#   1. tests/gpu (graphs equal eager, one sync a step, sampling, every method equal to AR in float32);
#   2. bench-device: AR one stream against transformers' generate() (plain and static-cache), batched AR, speculation
#      at 16 rows (device.json; `python -m jobs.bench_device --from-json device.json --readme README.md --block gpu`
#      writes it into the README);
#   3. the 13 Spec-Bench categories: AR, the model-free methods, eagle (chain and trees), the distilled draft's tree
#      (bench_variants' summary.json);
#   4. probe (only when asked): per-step costs of AR, eagle (chain, level tree) and the distilled draft, with their
#      draft loops replayed as one CUDA graph and op by op (tests/gpu/probe.py; probe.json);
#   5. distill (only when asked): the committed self-distillation run resumed on the GPU (`specray distill --local`,
#      GPU_DISTILL_WORKERS engine processes sharing the GPU);
#   6. train (only when asked): the shipped drafters retrained on that data (`specray ship-drafters --device cuda`),
#      each under its own limit (GPU_TRAIN="eagle:3 distill:2 ...", minutes);
#   7. train-speed (only when asked): a training step one sequence at a time against one batch, side by side
#      (`specray bench-training`; train-speed.json).
# Run from the project root on a machine with a CUDA GPU: `bash tests/gpu/run.sh`. Stage limits (seconds):
# GPU_TESTS_S, GPU_DEVICE_S, GPU_BENCH_S; GPU_STAGES picks stages (default "tests device bench"); GPU_BENCH_VARIANTS
# replaces the bench stage's variants ("name=method:knob=v,... ...").
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
stages=${GPU_STAGES:-tests device bench}
dev=${GPU_DEVICE:-cuda}  # GPU_DEVICE=cpu dry-runs the commands here
new=${GPU_NEW_TOKENS:-128}
work=${GPU_WORK:-$(mktemp -d)}  # GPU_WORK: a fixed folder, so that a later call finds what this one trained
mkdir -p "$work"
touch "$work/stamp"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" 2>&1 | tee -a "$out/run.log"
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests)
      timeout -s INT -k 30 "${GPU_TESTS_S:-240}" "$py" -m pytest tests/gpu -q -p no:cacheprovider -rfEs --durations=8 ${GPU_TESTS_ARGS:-} 2>&1 | tee -a "$out/run.log"
      rc=${PIPESTATUS[0]} ;;
    device)
      timeout -s INT -k 30 "${GPU_DEVICE_S:-240}" "$py" -m jobs.bench_device --device "$dev" --max-new-tokens "$new" --prompts "${GPU_PROMPTS:-3}" \
        --rows "${GPU_ROWS:-1,4,16,64,128}" --spec-rows 16 --methods "${GPU_SPEC_METHODS:-ngram,eagle,suffix}" \
        --out "$out" 2>&1 | tee -a "$out/run.log"
      rc=${PIPESTATUS[0]} ;;
    bench)
      timeout -s INT -k 30 "${GPU_BENCH_S:-300}" "$py" -m jobs.bench_variants --set device="$dev" --dtype bfloat16 --limit "${GPU_LIMIT:-1}" \
        --max-new-tokens "$new" ${GPU_BENCH_ARGS:-} --out "$work/bench" \
        $(for v in ${GPU_BENCH_VARIANTS:-ngram=ngram:k=8 suffix=suffix recycling=recycling eagle=eagle \
            eagle-levels=eagle:tree=levels,tree_budget=32,k=6 eagle-dyspec=eagle:tree=dyspec,tree_budget=48,k=8 \
            distill-dyspec=trained:drafter=smollm2-135m/distill,tree=dyspec,tree_budget=32,k=6}; do echo --variant "$v"; done) \
        2>&1 | tee -a "$out/run.log"
      rc=${PIPESTATUS[0]}
      cp "$work/bench/summary.json" "$out/bench-summary.json" 2>/dev/null ;;
    probe)  # per-step draft and verification costs, each drafter's draft loop as one graph and op by op (probe.json)
      timeout -s INT -k 30 "${GPU_PROBE_S:-240}" "$py" tests/gpu/probe.py --device "$dev" --new "$new" --out "$out/probe.json" \
        2>>"$out/probe.err" | tee -a "$out/run.log"
      rc=${PIPESTATUS[0]} ;;
    distill)  # resume the committed self-distillation run with the batched engine on the GPU; new shards in distill.tar
      cp -rp data/distill/smollm2-135m "$work/distill"
      timeout -s INT -k 30 "${GPU_DISTILL_S:-180}" "$py" -m jobs.distill --local --device "$dev" --out "$work/distill" \
        --per-kind 800 --questions 2000 --articles 600 --german 300 --shard-size 192 --rows "${GPU_DISTILL_ROWS:-64}" --workers "${GPU_DISTILL_WORKERS:-4}" \
        --max-minutes "${GPU_DISTILL_MIN:-2}" --no-progress 2>&1 | tee -a "$out/run.log"
      rc=${PIPESTATUS[0]}
      (cd "$work/distill" && tar -cf "$out/distill.tar" manifest.json $(find . -name 'shard-*.parquet' -newer "$work/stamp" | sort)) ;;
    train)  # retrain shipped drafters on the data (the distill stage's when it ran, else the committed); back in shipped.tar
      data="$work/distill"; [ -d "$data" ] || data=data/distill/smollm2-135m
      # GPU_TRAIN="name:minutes ...": each drafter under its own time limit (a GPU step takes 32 sequences)
      rc=0
      for job in ${GPU_TRAIN:-eagle:3 distill:2 kangaroo-l6:1 kangaroo-l12:1}; do
        timeout -s INT -k 30 "${GPU_TRAIN_S:-420}" "$py" -m jobs.ship_drafters --device "$dev" --data "$data" \
          --only "${job%%:*}" --steps-scale "${GPU_TRAIN_SCALE:-4}" --batch "${GPU_TRAIN_BATCH:-32}" --max-minutes "${job##*:}" \
          --shipped "$work/shipped" --docs "$work/curves" --no-progress 2>&1 | tee -a "$out/run.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      done
      tar -cf "$out/shipped.tar" -C "$work" $(cd "$work" && ls -d shipped curves 2>/dev/null)
      # each drafter's weights as trained (bfloat16, from its last checkpoint), for warm starts and repacks at home;
      # in pieces of 15 MiB (float.tar.aa, ...): `cat float.tar.* | tar -x`
      "$py" - "$work/float" ${GPU_TRAIN:-eagle:3 distill:2 kangaroo-l6:1 kangaroo-l12:1} <<'PY' 2>&1 | tee -a "$out/run.log"
import sys
from pathlib import Path

import torch

from decoding.paths import specray_home

out = Path(sys.argv[1])
for job in sys.argv[2:]:
    name = job.split(":")[0]
    ckpt = specray_home() / "ship" / "smollm2-135m" / name / "checkpoint.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        (out / name).mkdir(parents=True, exist_ok=True)
        torch.save({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state["module"].items()}, out / name / "module.pt")
        print(f"float weights of {name}: step {state['step']}")
PY
      [ -d "$work/float" ] && tar -cf - -C "$work" float | split -b 15m - "$out/float.tar." ;;
    train-speed)  # the trainer's step: one sequence at a time against the step's sequences as one batch (train-speed.json)
      timeout -s INT -k 30 "${GPU_TRAIN_SPEED_S:-240}" "$py" -m jobs.bench_training --device "$dev" --only "${GPU_TRAIN_SPEED_DRAFTER:-eagle}" \
        --batch "${GPU_TRAIN_BATCH:-32}" --steps 4 --json > "$out/train-speed.json" 2>>"$out/train-speed.err"
      rc=$?
      cat "$out/train-speed.json" | tee -a "$out/run.log" ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
  echo "stage $stage: $(($(date +%s) - start)) s, exit $rc" | tee -a "$out/run.log"
done
