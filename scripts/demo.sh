#!/usr/bin/env bash
# Quick start, command 1: set up and run the main job on the embedded default (no cluster, no GPU):
#  1. `vexpert demo`: one local node (coordinator + 4 CPU workers over gloo) serving a small
#     DeepSeek-shaped MoE whose routing drifts through three real DeepSeek-V3 load phases, every
#     step checked against a single-process reference;
#  2. `vexpert simulate`: the same real loads on a simulated 64-GPU / 8-node cluster, every policy.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh runtime,plot
. .venv/bin/activate
mkdir -p out
vexpert demo --iterations 40 --verify
vexpert trace build --phase bundled:decode_in1000out1000:283 --phase bundled:prefill_in4096:182 \
  --phase bundled:decode_in500out1500:185 --gpus 64 --tokens-per-gpu 256 --top-k 8 --seed 0 --jitter 4096 \
  -o out/deepseek-v3-drift.npz
vexpert simulate out/deepseek-v3-drift.npz --gpus 64 --nodes 8 --k 10 --group-size 2 --vmax 1 --warmup 50 \
  --compare-eplb-policies --plot out/balance.png
echo "plot: out/balance.png"
