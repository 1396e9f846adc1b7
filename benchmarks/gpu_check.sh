#!/usr/bin/env bash
# The one-shot GPU check, for the day a GPU machine is lent (about 15 minutes, once): every `gpu`-marked test, then
# the default job's throughput per precision on one GPU and, with 2+ GPUs, peak memory per GPU for DDP vs DP and
# DDP vs FSDP vs DP (fsdp/bench_fsdp_memory.py), into one report file. Three stages, each bounded to fit one device
# command (at most 10 minutes): `one` (gpu_check_one.py: what one GPU can show, one line per check, each in a fresh
# process; about 5 minutes), `tests` (pytest -m gpu, cut at 330 s) and `jobs` (the runs; estimated at about 2
# minutes on one GPU, at most 8 with two: benchmarks/README.md says what has been run).
#
#   bash benchmarks/gpu_check.sh one [REPORT]      # default REPORT: gpu_check_<stage>.txt (in $OUT if set)
#   bash benchmarks/gpu_check.sh tests [REPORT]
#   bash benchmarks/gpu_check.sh jobs [REPORT]
#   bash benchmarks/gpu_check.sh all [REPORT]      # tests and jobs, one after the other
set -u
cd "$(dirname "$0")/.."
stage=${1:-all}
case "$stage" in one|tests|jobs|all) ;; *) echo "usage: $0 one|tests|jobs|all [REPORT]" >&2; exit 2 ;; esac
report=${2:-${OUT:-.}/gpu_check_$stage.txt}
work=$(mktemp -d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

section() { printf '\n== %s (%ss) ==\n' "$1" "$(($(date +%s) - start))"; }

row() {  # the last epoch of a run: samples/s, peak memory per GPU (MB), imbalance, val accuracy
  python - "$1" "$2" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[2]}/metrics.jsonl")]
r = rows[-1]
print(f"| {sys.argv[1]} | {r['samples_per_s']:.0f} | {r['time_per_iter_ms']:.2f} | "
      f"{' / '.join(f'{m:.0f}' for m in r['peak_memory_mb'])} | {r['memory_imbalance']:.2f} | {r['val_accuracy']:.3f} |")
EOF
}

{
  section "machine"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,mig.mode.current --format=csv
  python -c "import torch, ignite; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', \
torch.cuda.device_count(), 'ignite', ignite.__version__)"
  ngpu=$(python -c "import torch; print(torch.cuda.device_count())")

  if [ "$stage" = one ]; then
    section "one GPU: NCCL, FSDP2, DCP, resumes, syncs, out of memory, the memory plan, files read without CUDA"
    timeout 570 python benchmarks/gpu_check_one.py
    section "done"
  fi
  if [ "$stage" = tests ] || [ "$stage" = all ]; then
    section "pytest -m gpu"
    timeout 330 python -m pytest -m gpu -v -rs -p no:cacheprovider tests 2>&1 | tail -60
  fi
  if [ "$stage" = tests ]; then
    section "done"
  elif [ "$stage" != one ]; then

  section "default job on one GPU (2 epochs, 4096 + 1000 synthetic images, global batch 128)"
  echo "| run | samples/s | ms/iter | peak MB per GPU | max/min | val acc |"
  echo "|---|---|---|---|---|---|"
  for precision in fp32 bf16 fp16; do
    if timeout 90 python -m ignite_mgpu train --gpus 0 "train.precision=$precision" train.progress_bar=false \
        --output-dir "$work/1gpu-$precision" > "$work/1gpu-$precision.log" 2>&1; then
      row "1 GPU $precision" "$work/1gpu-$precision"
    else
      echo "| 1 GPU $precision | FAILED: $(tail -1 "$work/1gpu-$precision.log") |"
    fi
  done

  if [ "${ngpu:-0}" -ge 2 ]; then
    section "peak memory per GPU on 2 GPUs: DDP (a process per GPU) vs DataParallel (one process)"
    echo "| run | samples/s | ms/iter | peak MB per GPU | max/min | val acc |"
    echo "|---|---|---|---|---|---|"
    for strategy in ddp dp; do
      if timeout 90 python -m ignite_mgpu train --gpus 0,1 --strategy "$strategy" model.name=resnet18 \
          data.image_size=64 train.epochs=1 train.progress_bar=false --output-dir "$work/2gpu-$strategy" \
          > "$work/2gpu-$strategy.log" 2>&1; then
        row "2 GPUs $strategy resnet18 64px" "$work/2gpu-$strategy"
      else
        echo "| 2 GPUs $strategy | FAILED: $(tail -1 "$work/2gpu-$strategy.log") |"
      fi
    done
    section "peak memory per GPU on 2 GPUs: DDP vs FSDP vs DP, a 169M-parameter MLP with AdamW (target: FSDP <= 0.7 DDP)"
    timeout 240 python benchmarks/fsdp/bench_fsdp_memory.py --gpus 0,1 2>&1 | tail -15
  else
    section "DDP vs DP and DDP vs FSDP memory: skipped (needs 2 GPUs, $ngpu here)"
  fi
  section "done"
  fi  # jobs
} > "$report" 2>&1
rm -rf "$work"
if [ "$stage" = one ]; then cat "$report"; fi  # one line per check: short enough to read where it ran
echo "wrote $report"
