#!/usr/bin/env bash
# What the next H200 session must measure for issue #21, in device calls that each end inside 10 minutes
# (benchmarks/README.md §10, "Next on the H200"). Every stage writes under $OUT.
# After run 33 (H100s only: Nsight Compute's view of the step, FP8 linears on torch's block-scaled GEMM, three kernels
# a layer and two a step fewer, untimed): STAGE=session20 and STAGE=cublasfp8 on any card; on an H200 STAGE=h200step (HEAD's step against its bound) and STAGE=session17's A/B (ab_old = 93bf13f),
# STAGE=layout's two-rank tests and onoff on two GPUs.
#
#   STAGE=tests  the full GPU test list (~8 min; run 24 on an H100: 481 s; PART=1 / PART=2 split it in two calls): kernels, graphed == eager, prefix caching and preemption on
#                graphed overlapped steps, the node's GPU path
#   STAGE=ab     an earlier H200-measured tree (in ab_old/: run 19 a2c4df7, run 21 c40564e) beside HEAD, 256 and 64 streams (~6 min):
#                everything since — allocation skip, node process, KV on demand, routing, block-table copy, GC freeze
#   STAGE=knobs  HEAD at 256 streams with the defaults, --api-servers 2 / 4 and --stream-interval 4 (~6 min)
#   STAGE=long   the block-table copy at DeepSeek-V3's 163,840 positions: ab_old vs HEAD at 256 streams, then
#                split-KV: the graphed decode step at a 32,768-token context, 1 / 4 / 16 sequences, one pass
#                (--kv-splits off) vs the served splits (~7 min)
#   STAGE=kernels  launch points not swept before, in the 256-stream step: the gate/up grouped GEMM with 2 stages
#                or 64-wide K tiles (two or three programs per SM; kernel_resources.py), the MLA decode kernel with
#                16 warps; then split-KV at a 32,768-token context (~5 min)
#   STAGE=longkernels  the split MLA kernel at a 32,768-token context, 1 / 4 / 16 sequences, over head and context
#                blocks, warps and stages (run 20: 16 sequences were latency-bound at one program per SM) (~6 min)
#   STAGE=router the fused routers', truncated sampling's, log-probabilities' and penalties' GPU tests (graphed ==
#                eager), then the graphed decode step at 16 / 64 / 256 sequences greedy, top-p 0.95, with
#                log-probabilities and with a repetition penalty (one process), then DeepSeek-V3's and Qwen3-MoE's
#                fused routers against transformers', eager and compiled, per layer (router_kernel.py) (~8 min)
#   STAGE=sidestream  the shared experts on a side stream: the GPU tests of the graphed paths, then the graphed decode
#                step at 16 / 64 / 256 sequences with the shared experts on the step's stream (off) and on their own (on,
#                the default; also constrained by a grammar), then structured output's masks on the host (~8 min)
#   STAGE=fp8    --kv-cache-dtype fp8: its GPU tests (graphed == eager over an FP8 cache, the MLA kernel over one), then
#                the graphed decode step at a 32,768-token context, 1 / 4 / 16 / 64 sequences, bf16 vs FP8 cache (~6 min)
#   STAGE=mlalong  the MLA decode kernel at long contexts and 16-256 sequences (run 24 on an H100: the step at 64
#                sequences of 32,768 tokens 7.6x its bound, and an FP8 cache slower than bf16): 32- vs 64-head blocks
#                and splits, bf16 and FP8 caches (~2 min)
#   STAGE=priority  --scheduling-policy priority against fcfs at 256 and 64 streams (all requests priority 0): what
#                the heap-ordered waiting queue costs at GPU admission rates (~6 min)
#   STAGE=fp8experts  block-FP8 experts read in place by the grouped GEMM (DeepSeek-V3's own format): their GPU tests,
#                the kernel beside bf16 rows and the dequantise-first path, its launch points over FP8 rows (~6 min)
#   STAGE=fp8step  the graphed decode step with bf16 vs block-FP8 experts (the checkpoint's FP8 copy, loaded as a rank
#                loads it) at 16 / 64 / 256 sequences (~7 min)
#   STAGE=fp8serve  vexpert serve on the block-FP8 copy beside the bf16 checkpoint at 256 / 64 streams (~7 min)
#   STAGE=w8a8   FP8 rows against FP8 activations (--expert-compute w8a8, activations quantised ahead of each GEMM): the
#                W8A8 GPU tests (the kernel = its float32 twin at DeepSeek-V3's sizes, the node verifies, graphed ==
#                eager), the kernel beside W8A16 (fp8_expert.py), its launch points (--w8a8; APPLY=1 writes the
#                table; it comes back in $OUT) (~6 min); STEP=1 goes on with w8a8step
#   STAGE=w8a8step  the graphed decode step at 16 / 64 / 256 sequences (BATCHES), W8A16 vs W8A8 experts (the tokens
#                dispatched as FP8 wire rows), each with the other linears bf16 and block-FP8 (--linear-format fp8_block;
#                W8A8 there too under w8a8) (~8 min)
#   STAGE=w8a8check  W8A8's accuracy on the GPU: each GEMM against float64 over the kernel's own FP8 inputs and the
#                whole against its exact twin, per launch configuration (w8a8_accuracy.py), then the W8A8 GPU tests
#                (each GEMM against float32, the node's --verify, graphed == eager with W8A8 experts and linears) (~4 min)
#   STAGE=linears  the block-FP8 linear layers' launch table (fp8_linear_tuning.py over DeepSeek-V3's linear shapes at
#                16 / 64 / 256 rows, W8A16 and W8A8, beside cuBLAS bf16; APPLY=1 writes the "linear" rows and brings the
#                kernel module back), then the graphed step with FP8 linears (w8a8-dense vs w8a8-fp8_block) (~8 min)
#   STAGE=session17  the MLA launch sweep at 256 / 64 sequences, the GPU tests of run 30's changes, an A/B round
#                against ab_old (93bf13f) at 256 sequences and the step's profile, scaled to LIMIT seconds (~9 min)
#   STAGE=session18  the layout kernel's launch sweep (benchmarks/layout_kernel_tuning.py), the step with its stream
#                above the shared experts' side stream (decode_step_bound.py --stream-priority -1 vs 0, PRIORITY_ROUNDS rounds), the
#                256-sequence profile with the shared experts on the step's stream, then (where LIMIT leaves time) the
#                step beside ab_old's = ac953c8, the layout kernel's four-reduction rank pass (carry .whl, ab_old; ~9 min)
#   STAGE=layout  the EP layer's layout kernel: its GPU tests, STAGE=abstep against ab_old (93bf13f), the step's profile
#                (carry .whl and ab_old; ~7 min)
#   STAGE=abstep  the graphed decode step of the tree in ab_old/ beside HEAD's, ROUNDS (2) interleaved rounds at 256 / 64
#                sequences on one warm card (carry ab_old; ~5 min)
#   STAGE=dense  inductor's GEMM autotuning (max-autotune: Triton templates beside cuBLAS) for the step's dense linears
#                at 64 / 256 rows against the served cuBLAS call, graphed (benchmarks/dense_gemm_autotune.py; ~3 min)
#   STAGE=session20  run 33's served, untimed changes to the bf16 step (the MLA kernels rotating the queries, two MoE
#                kernels and two final kernels fewer): their GPU tests, the step against ab_old = 3fc0f6e, a profile (~8 min)
#   STAGE=cublasfp8  run 33's FP8 linears on torch's block-scaled GEMM: their GPU tests, the graphed step with the linears
#                kept FP8 against dequantised, W8A8 experts, two interleaved rounds (~6 min)
#   STAGE=session21  one call on whatever card comes: on an H200 STAGE=h200step, elsewhere the MLA decode and input kernels' GPU tests and
#                STAGE=cublasfp8 at 256 / 64 sequences (~9 min)
#   STAGE=session22  on an H200 STAGE=h200step; elsewhere vexpert serve vs transformers generate at 16 / 64 / 256
#                streams (the README's headline table at HEAD, on that card) (~9 min)
#   STAGE=hostab  HEAD against 22aa075 (ab_old) at 256 streams, interleaved, on one host: is run 36's 35k tokens/s
#                (run 23: 66k on another H100) the tree's or the host's? (~7 min)
#   STAGE=qwenstep  the graphed decode step of a Qwen3-MoE at Qwen3-30B-A3B's sizes against its bound (~5 min)
#   STAGE=onoff  only on a 2-GPU host (kind nvidia-h200-x2): vExpert on vs off (static = τ 0) on two EP ranks, one
#                per GPU, at 64 and 256 streams, the skewed router of the benchmark checkpoint, the calibrated H200
#                profile, with the EP layer's share of a traced iteration (~6 min)
#
# Before the device call, here:  mkdir -p ab_old && git archive a2c4df7 runtime benchmarks | tar -x -C ab_old
# and carry ab_old and .whl (wheels of pydantic and its needs, llguidance, py-spy): run(command="STAGE=ab OUT=$OUT ./benchmarks/gpu_pending.sh",
# carry=[".whl", "ab_old"]).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${OUT:-out/gpu_pending}")"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
SITE=/tmp/site
# the GPU host's image lacks these: stop at once, not after a server fails to start (run 37's first call lost two
# benchmark rounds to a .whl without llguidance, which a rank imports at its start)
PYTHONPATH=$SITE python3 -c "import pydantic, llguidance" || { echo "error: .whl lacks a wheel the runtime imports (pydantic, llguidance): download it here and carry .whl" >&2; exit 2; }
HEAD_PATH="$SITE:$PWD/runtime:$PWD/tests"
LOAD=(--duration 12 --warmup 4 --client-processes 4)
bench() {  # bench TREE NAME ARGS...: serve_engine.py from TREE (. or ab_old) on the shared checkpoint
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH="$SITE:$PWD/runtime:$OLDPWD/tests" timeout "${BENCH_TIMEOUT:-290}" python3 benchmarks/serve_engine.py \
     --out "$OUT/$name" --modes vexpert "$@" 2>&1 | grep -v "Loading weights" | tail -8)
}
case "${STAGE:-tests}" in
  tests)  # PART=1: the serving engine's file; PART=2: the rest (each well inside a call); default: all
    files=(tests/test_runtime_gpu.py tests/test_gpu_path.py tests/test_serve_gpu.py tests/test_expert_format_gpu.py
           tests/test_runtime_ep_moe.py tests/test_dispatch.py tests/test_attention_kernels.py
           tests/test_grouped_gemm_kernel.py tests/test_fusion.py tests/test_layout_kernel.py tests/test_mla_output.py)
    case "${PART:-all}" in
      1) files=(tests/test_serve_gpu.py) ;;
      2) files=("${files[@]/tests\/test_serve_gpu.py}") ;;
    esac
    PYTHONPATH=$HEAD_PATH timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu ${files[*]} 2>&1 \
      | tee "$OUT/pytest_gpu.txt" | tail -25 ;;
  ab)
    for round in 1 2; do
      bench . "head$round" --model-dir /tmp/bench-ds3 --streams 256 64 "${LOAD[@]}"  # HEAD writes the checkpoint
      bench ab_old "old$round" --model-dir /tmp/bench-ds3 --streams 256 64 "${LOAD[@]}"
      [ "$round" = 1 ] && [ "$SECONDS" -gt 300 ] && break  # one round when the checkpoint's writing took long
    done ;;
  hostab)  # is the 256-stream throughput HEAD's or the host's? (run 23: 66k tokens/s on one H100 host, run 36: 35k on
    # another) — HEAD against ab_old (22aa075, run 22's tree: 53k beside 327b58f on run 25's host) on this host,
    # interleaved, with the host's CPU model (~7 min; carry .whl and ab_old)
    lscpu | grep -E "Model name|^CPU\(s\)"
    bench . hostab-head1 --model-dir /tmp/bench-ds3 --streams 256 "${LOAD[@]}"  # HEAD writes the checkpoint
    bench ab_old hostab-old1 --model-dir /tmp/bench-ds3 --streams 256 "${LOAD[@]}"
    bench . hostab-head2 --model-dir /tmp/bench-ds3 --streams 256 "${LOAD[@]}"
    [ "$SECONDS" -lt 400 ] && bench ab_old hostab-old2 --model-dir /tmp/bench-ds3 --streams 256 "${LOAD[@]}" ;;
  knobs)  # the serving knobs beside the defaults, in one call on one host
    bench . base --model-dir /tmp/bench-ds3 --streams 256 "${LOAD[@]}"
    bench . api2 --model-dir /tmp/bench-ds3 --streams 256 "${LOAD[@]}" --serve-args "--api-servers 2"
    bench . api4 --model-dir /tmp/bench-ds3 --streams 256 "${LOAD[@]}" --serve-args "--api-servers 4"
    bench . si4 --model-dir /tmp/bench-ds3 --streams 256 "${LOAD[@]}" --serve-args "--stream-interval 4" ;;
  long)
    bench . long-head --model-dir /tmp/bench-ds3-long --max-position-embeddings 163840 --streams 256 "${LOAD[@]}"
    bench ab_old long-old --model-dir /tmp/bench-ds3-long --streams 256 "${LOAD[@]}"
    for splits in off auto; do
      PYTHONPATH=$HEAD_PATH timeout 150 python3 benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3-long \
        --max-position-embeddings 163840 --batches 1 4 16 --context 32768 --kv-splits $splits \
        --out "$OUT/decode_step_long_$splits.json" 2>&1 | grep -v "Loading weights" | tail -4
    done ;;
  kernels)
    PYTHONPATH=$HEAD_PATH timeout 280 python3 benchmarks/grouped_gemm_tuning.py --tokens 256 64 --stages 2 3 4 \
      --gate-up-block-k 64 128 --out "$OUT/grouped_gemm_tuning_stages.json" 2>&1 | grep -E "best|bucket" | tail -12
    PYTHONPATH=$HEAD_PATH timeout 150 python3 benchmarks/mla_decode_tuning.py --batches 256 --context 96 \
      --block-h 32 64 --block-n 32 64 --warps 8 16 --stages 2 3 --out "$OUT/mla_decode_tuning_warps.json" 2>&1 | grep best
    PYTHONPATH=$HEAD_PATH timeout 120 python3 benchmarks/mla_decode_tuning.py --batches 1 4 16 --context 32768 \
      --block-h 32 64 --block-n 64 --warps 8 --stages 2 3 --kv-splits 1 4 16 64 --out "$OUT/mla_decode_splits.json" 2>&1 | grep best ;;
  longkernels)  # the split MLA kernel's launch points at a 32,768-token context, those holding 2-4 programs per SM
    # among them (kernel_resources.py --sweep --only mla_decode_split: 16x16 w4 s3, 16x32 w8, 32x16 w8 s2, ...)
    PYTHONPATH=$HEAD_PATH timeout 480 python3 benchmarks/mla_decode_tuning.py --batches 16 4 1 --context 32768 \
      --block-h 16 32 64 --block-n 16 32 64 --warps 4 8 --stages 2 3 --kv-splits 4 16 64 \
      --out "$OUT/mla_decode_split_sweep.json" 2>&1 | grep best ;;
  router)  # LIMIT: the seconds this call may take (less device time left: a shorter call, the same order)
    LIMIT=${LIMIT:-560}
    PYTHONPATH=$HEAD_PATH timeout $((LIMIT * 2 / 5)) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_serve_gpu.py \
      -k "${TESTS:-router or truncated_sampling or logprobs or penalties or structured_output or grammar_mask or graphed_decode}" 2>&1 | tail -3
    # the graphed decode step at 16 / 64 / 256 sequences, greedy and the variants whose graphs differ, in one process:
    # top-p 0.95 (DeepSeek-V3's generation config: a sort over the vocabulary), log-probabilities (a log-softmax and
    # top-20 over the vocabulary, three more copies to the host), a repetition penalty of 1.05 (Qwen-MoE generation
    # configs: the token tables written and read)
    PYTHONPATH=$HEAD_PATH timeout $((LIMIT - SECONDS - 10)) python3 benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3 \
      --batches ${BATCHES:-16 64 256} --context 96 --sampling ${SAMPLING:-greedy top-p logprobs penalties} --profile --top 24 \
      --out "$OUT/decode_step_bound_variants.json" 2>&1 | tee "$OUT/decode_step_bound_variants.log" | grep -v "Loading weights" | cut -c1-200 | tail -13
    # structured output's masks on this host's CPUs (16 cores): llguidance over a 128,000-token vocabulary
    [ -n "${MASKS:-}" ] && PYTHONPATH=$HEAD_PATH timeout 90 python3 benchmarks/grammar_mask_cost.py --vocab 128000 \
      --sequences 1 16 64 256 --out "$OUT/grammar_mask_cost.json" 2>&1 | tail -6
    # the fused routers against transformers' (DeepSeek-V3's and Qwen3-MoE's), eager and compiled, per layer
    [ -z "${NO_ROUTER:-}" ] && [ "$SECONDS" -lt $((LIMIT - 140)) ] && PYTHONPATH=$HEAD_PATH timeout $((LIMIT - SECONDS)) python3 \
      benchmarks/router_kernel.py --out "$OUT/router_kernel.json" 2>&1 | grep routing ;;
  sidestream)  # the shared experts on a side stream: GPU tests, then the graphed decode step without / with it
    PYTHONPATH=$HEAD_PATH timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_serve_gpu.py \
      -k "${TESTS:-side_stream or grammar_mask or structured_output or graphed_decode}" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -4
    for stream in off on; do  # one process each (the option is the model's); the grammar variant with the product's default
      sampling=greedy; [ "$stream" = on ] && sampling="greedy grammar"
      PYTHONPATH=$HEAD_PATH timeout 170 python3 benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3 \
        --batches 16 64 256 --context 96 --sampling $sampling --shared-expert-stream $stream --profile --top 30 \
        --out "$OUT/decode_step_bound_shared_$stream.json" 2>&1 | grep -v "Loading weights" | grep '^{' | cut -c1-260
    done
    PYTHONPATH=$HEAD_PATH timeout 60 python3 benchmarks/grammar_mask_cost.py --vocab 128000 --sequences 1 16 64 256 \
      --out "$OUT/grammar_mask_cost.json" 2>&1 | tail -6 ;;
  fp8)  # --kv-cache-dtype fp8: its GPU tests, then the graphed step over a bf16 vs an FP8 cache at a long context
    PYTHONPATH=$HEAD_PATH timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_serve_gpu.py \
      -k "${TESTS:-fp8 or graphed_decode}" 2>&1 | tee "$OUT/pytest_gpu_fp8.txt" | tail -4
    for kv in auto fp8; do
      PYTHONPATH=$HEAD_PATH timeout 150 python3 benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3-long \
        --max-position-embeddings 163840 --batches 1 4 16 64 --context 32768 --kv-cache-dtype $kv \
        --out "$OUT/decode_step_long_kv_$kv.json" 2>&1 | grep '^{' | cut -c1-240
    done ;;
  mlalong)  # the MLA decode kernel where the KV read is the step: long contexts, 16 / 64 (and 256 at 4,096) sequences
    tune() { PYTHONPATH=$HEAD_PATH timeout 150 python3 benchmarks/mla_decode_tuning.py --iters 20 --block-n 64 --warps 8 \
               --stages 3 "$@" 2>&1 | grep best; }
    tune --batches 64 16 --context 32768 --block-h 32 64 --kv-splits 1 2 4 --out "$OUT/mla_long_bf16.json"
    tune --batches 64 16 --context 32768 --block-h 32 64 --kv-splits 1 2 4 --kv-cache-dtype fp8 \
      --out "$OUT/mla_long_fp8.json"
    tune --batches 256 64 --context 4096 --block-h 32 64 --kv-splits 1 2 4 --out "$OUT/mla_4k_bf16.json" ;;
  priority)  # --scheduling-policy priority at GPU speed: its heap-ordered queue and victim rule against fcfs, every
    # request of priority 0 (the same order), at 256 and 64 streams, one process each (~6 min)
    bench . fcfs --model-dir /tmp/bench-ds3 --streams 256 64 "${LOAD[@]}"
    bench . priority --model-dir /tmp/bench-ds3 --streams 256 64 "${LOAD[@]}" --serve-args "--scheduling-policy priority" ;;
  fp8experts)  # block-FP8 experts read in place by the grouped GEMM: GPU tests, the kernel beside bf16 and the old
    # dequantise-then-multiply path (EP64's 4 experts and the benchmark rank's 8, skewed), then its launch points (~6 min)
    PYTHONPATH=$HEAD_PATH timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_expert_format_gpu.py \
      tests/test_grouped_gemm_kernel.py tests/test_serve_gpu.py -k "${TESTS:-fp8 or grouped or graphed_decode_equals}" 2>&1 \
      | tee "$OUT/pytest_gpu_fp8_experts.txt" | tail -4
    PYTHONPATH=$HEAD_PATH timeout 100 python3 benchmarks/fp8_expert.py --experts 8 --pairs 32 128 512 --skewed \
      > "$OUT/fp8_expert_8_skewed.json" 2>&1; grep -E '^\{"pairs' "$OUT/fp8_expert_8_skewed.json"
    PYTHONPATH=$HEAD_PATH timeout 80 python3 benchmarks/fp8_expert.py --experts 4 --pairs 512 2048 8192 \
      > "$OUT/fp8_expert_4.json" 2>&1; grep -E '^\{"pairs' "$OUT/fp8_expert_4.json"
    PYTHONPATH=$HEAD_PATH timeout $((540 - SECONDS)) python3 benchmarks/grouped_gemm_tuning.py --fp8 --tokens 16 64 256 \
      --out "$OUT/grouped_gemm_tuning_fp8.json" 2>&1 | grep -E "best|bucket" | tail -12 ;;
  fp8step)  # the graphed decode step with the benchmark checkpoint's experts bf16 vs block FP8 (its copy in DeepSeek-V3's
    # released format, loaded as a serving rank loads it), bounds counting bytes as served; first the FP8 GPU tests
    # of test_expert_format_gpu.py (TESTS="" skips them) (~8 min)
    [ -n "${TESTS-fp8}" ] && PYTHONPATH=$HEAD_PATH timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_expert_format_gpu.py -k "${TESTS-fp8}" 2>&1 | tee "$OUT/pytest_gpu_fp8_experts.txt" | tail -2
    for fmt in bf16 fp8; do
      flag=""; share=2; [ "$fmt" = fp8 ] && flag="--block-fp8" && share=1  # bf16: half the time left
      PYTHONPATH=$HEAD_PATH timeout $(( (${LIMIT:-540} - SECONDS) / share )) python3 \
        benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3 $flag --batches 16 64 256 --context 96 ${PROFILE:-} \
        --out "$OUT/decode_step_bound_experts_$fmt.json" 2>&1 | grep -v "Loading weights" | grep '^{' | cut -c1-300
    done ;;
  fp8serve)  # vexpert serve on the block-FP8 copy beside the bf16 checkpoint, 256 and 64 streams (~7 min; STREAMS=64:
    # ~4); SWEEP=1 first sweeps the FP8 GEMMs' launch points at 256 tokens with 128-row tiles too (~1.5 min)
    [ -n "${SWEEP:-}" ] && PYTHONPATH=$HEAD_PATH timeout 120 python3 benchmarks/grouped_gemm_tuning.py --fp8 --tokens 256 \
      --row-tile-block-m 32 64 128 --out "$OUT/grouped_gemm_tuning_fp8_256.json" 2>&1 | grep -E "bucket|<=" | tail -6
    bench . bf16 --model-dir /tmp/bench-ds3 --streams ${STREAMS:-256 64} "${LOAD[@]}"
    bench . blockfp8 --model-dir /tmp/bench-ds3 --block-fp8 --streams ${STREAMS:-256 64} "${LOAD[@]}" ;;
  w8a8)  # FP8 activations against FP8 rows: tests, the kernel, its launch points, the decode step (~9 min)
    PYTHONPATH=$HEAD_PATH timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_expert_format_gpu.py \
      tests/test_serve_gpu.py tests/test_grouped_gemm_kernel.py -k "${TESTS:-fp8 and not cache}" 2>&1 | tee "$OUT/pytest_gpu_w8a8.txt" | tail -3
    PYTHONPATH=$HEAD_PATH timeout 80 python3 benchmarks/fp8_expert.py --experts 8 --pairs 32 128 512 --skewed \
      > "$OUT/fp8_expert_8_skewed_w8a8.json" 2>&1; grep -E '^\{"pairs' "$OUT/fp8_expert_8_skewed_w8a8.json"
    PYTHONPATH=$HEAD_PATH timeout 150 python3 benchmarks/grouped_gemm_tuning.py --w8a8 --tokens 16 64 256 \
      ${APPLY:+--apply} --out "$OUT/grouped_gemm_tuning_w8a8.json" 2>&1 | grep -E "<=" | tail -6
    [ -n "${APPLY:-}" ] && cp runtime/vexpert_runtime/model/grouped_gemm_kernel.py "$OUT/"  # the table it wrote
    [ -z "${STEP:-}" ] && exit 0  # STEP=1: the decode steps too (else STAGE=w8a8step, a call of its own)
    ;&
  w8a8step)  # the graphed decode step: W8A16 / W8A8 experts, each with the other linears bf16 and FP8 (~8 min)
    variants=(w8a16-dense w8a8-dense w8a16-fp8_block w8a8-fp8_block)
    for i in "${!variants[@]}"; do
      variant=${variants[$i]}; left=$(( ${#variants[@]} - i ))
      PYTHONPATH=$HEAD_PATH timeout $(( (${LIMIT:-560} - SECONDS) / left )) python3 \
        benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3 --block-fp8 --expert-compute ${variant%%-*} \
        --linear-format ${variant#*-} --batches ${BATCHES:-16 64 256} --context 96 \
        --out "$OUT/decode_step_bound_$variant.json" 2>&1 | grep -v "Loading weights" | grep '^{' | cut -c1-300
    done ;;
  w8a8check)
    PYTHONPATH=$HEAD_PATH timeout 150 python3 benchmarks/w8a8_accuracy.py --tokens 16 256 > "$OUT/w8a8_accuracy.jsonl" 2>&1
    cut -c1-2600 "$OUT/w8a8_accuracy.jsonl"
    PYTHONPATH=$HEAD_PATH timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_expert_format_gpu.py \
      tests/test_serve_gpu.py tests/test_grouped_gemm_kernel.py -k "${TESTS:-w8a8 or block_fp8_checkpoint_graphed or fp8_linears}" \
      2>&1 | tee "$OUT/pytest_gpu_w8a8check.txt" | tail -4 ;;
  linears)
    PYTHONPATH=$HEAD_PATH:$PWD/benchmarks timeout 300 python3 benchmarks/fp8_linear_tuning.py --rows 16 64 256 \
      ${APPLY:+--apply} --out "$OUT/fp8_linear_tuning.json" 2>&1 | grep -E "rows <=|wrote" | tail -8
    [ -n "${APPLY:-}" ] && cp runtime/vexpert_runtime/model/grouped_gemm_kernel.py "$OUT/"
    for variant in w8a8-dense w8a8-fp8_block; do
      share=2; [ "$variant" = w8a8-fp8_block ] && share=1
      PYTHONPATH=$HEAD_PATH timeout $(( (${LIMIT:-560} - SECONDS) / share )) python3 benchmarks/decode_step_bound.py \
        --model-dir /tmp/bench-ds3 --block-fp8 --expert-compute w8a8 --linear-format ${variant#*-} --batches 64 256 \
        --context 96 --out "$OUT/decode_step_bound_linears_$variant.json" 2>&1 | grep '^{' | cut -c1-300
    done ;;
  session20)  # run 33's served, untimed changes to the bf16 step (~8 min; carry .whl and ab_old = git archive 3fc0f6e):
    # the MLA kernels rotating the queries themselves, pad masking in one kernel, no fill for an EP group of one's
    # dropped pairs, the last residual sum and the final norm with its gather compiled — their GPU tests (the MLA kernel
    # against the torch twin, graphed == eager for DeepSeek-V3, Qwen3-MoE, Qwen2-MoE, the FP8 cache), then ROUNDS (2)
    # interleaved rounds against ab_old at 256 / 64 sequences, then HEAD's 256-sequence profile
    PYTHONPATH=$HEAD_PATH timeout ${TEST_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_serve_gpu.py \
      tests/test_runtime_gpu.py -k "${TESTS:-mla_decode or cache_rows or graphed_decode_equals or fp8_kv_cache or node or truncated_sampling or logprobs_equal or penalties_equal}" 2>&1 \
      | tee "$OUT/pytest_gpu_session20.txt" | tail -2
    ROUNDS=${ROUNDS:-2} STAGE=abstep OUT=$OUT "$0"
    PYTHONPATH=$HEAD_PATH timeout 90 python3 benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3 --batches 256 \
      --context 96 --profile --top 40 --out "$OUT/decode_step_bound_profile_session20.json" 2>&1 | grep '^{' | cut -c1-300 ;;
  cublasfp8)  # run 33's untimed change (~5 min): FP8 linears' W8A8 on torch's block-scaled GEMM — their GPU tests, then
    # the graphed step with the block-FP8 copy's linears kept FP8 (fp8_block) against dequantised (dense), W8A8 experts
    PYTHONPATH=$HEAD_PATH timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_grouped_gemm_kernel.py \
      tests/test_serve_gpu.py -k "fp8_linears or block_fp8_checkpoint_graphed" 2>&1 | tee "$OUT/pytest_gpu_cublasfp8.txt" | tail -2
    for lf in ${LINEAR_FORMATS:-dense fp8_block dense fp8_block}; do
      PYTHONPATH=$HEAD_PATH timeout 150 python3 benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3 --block-fp8 \
        --expert-compute w8a8 --linear-format $lf --batches ${BATCHES:-256 64 16} --context 96 \
        --out "$OUT/decode_step_bound_cublasfp8_${lf}_$SECONDS.json" 2>&1 | grep -E '^\{|Error' | cut -c1-300
    done ;;
  session21)  # one call of whatever card comes (~9 min; carry .whl): on an H200, issue #21's measurement (STAGE=h200step:
    # HEAD's step against its bound, bf16 with a profile, then W8A8); on another card the MLA kernel's GPU test (its
    # rotating form against pre-rotated queries) and the MLA / GQA input kernels' tests, then STAGE=cublasfp8 at 256 /
    # 64 sequences (on an H200 the input kernels' tests first, 90 s)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      PYTHONPATH=$HEAD_PATH timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_serve_gpu.py \
        -k "cache_rows" --tb=short 2>&1 | tee "$OUT/pytest_gpu_cache_rows.txt" | tail -4
      LIMIT=$(( ${LIMIT:-555} - SECONDS )) STAGE=h200step OUT=$OUT "$0"
    else
      PYTHONPATH=$HEAD_PATH timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_serve_gpu.py \
        -k "mla_decode_kernel_matches or cache_rows" --tb=short 2>&1 | tee "$OUT/pytest_gpu_mla_decode.txt" | tail -4
      BATCHES=${BATCHES:-256 64} STAGE=cublasfp8 OUT=$OUT "$0"
    fi ;;
  session22)  # one call of whatever card comes (~9 min; carry .whl): on an H200 STAGE=h200step (issue #21's 256-sequence
    # step against its bound, unmeasured on an H200 since run 29e); on another card the README's headline table at HEAD —
    # `vexpert serve` against transformers `generate` on the same checkpoint and card, 16 / 64 / 256 streams (run 16's
    # table is the last with transformers beside it)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      LIMIT=${LIMIT:-555} STAGE=h200step OUT=$OUT "$0"
    else
      (PYTHONPATH=$HEAD_PATH timeout ${LIMIT:-555} python3 benchmarks/serve_engine.py --out "$OUT/headline" \
        --model-dir /tmp/bench-ds3 --modes hf vexpert --streams 16 64 256 "${LOAD[@]}" 2>&1 | grep -v "Loading weights" | tail -12)
    fi ;;
  qwenstep)  # the graphed decode step of a Qwen3-MoE at Qwen3-30B-A3B's sizes (3 layers, 128 experts, top-8; the GQA
    # path: its decode kernel and, since run 34, its input kernel) at 16 / 64 / 256 sequences with a profile (~5 min)
    PYTHONPATH=$HEAD_PATH timeout ${LIMIT:-400} python3 benchmarks/decode_step_bound.py --family qwen3_moe \
      --model-dir /tmp/bench-qwen3 --experts 128 --batches ${BATCHES:-16 64 256} --context 96 --profile --top 40 \
      --out "$OUT/decode_step_bound_qwen3.json" 2>&1 | grep -v "Loading weights" | grep '^{' | cut -c1-300 ;;
  h200step)  # the graphed decode step on this card: bf16 experts with each kernel's time (--profile), then W8A8 FP8
    # experts (the block-FP8 copy, as `auto` serves it on 8.9+ GPUs), 16 / 64 / 256 sequences, context 96 (~7 min)
    PYTHONPATH=$HEAD_PATH timeout $(( (${LIMIT:-540} - SECONDS) / 2 )) python3 benchmarks/decode_step_bound.py \
      --model-dir /tmp/bench-ds3 --batches ${BATCHES:-16 64 256} --context 96 --profile --top 40 \
      --out "$OUT/decode_step_bound_bf16_profile.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/decode_step_bound_bf16_profile.log" \
      | grep '^{' | cut -c1-300
    PYTHONPATH=$HEAD_PATH timeout $(( ${LIMIT:-540} - SECONDS )) python3 benchmarks/decode_step_bound.py \
      --model-dir /tmp/bench-ds3 --block-fp8 --expert-compute w8a8 --batches ${BATCHES:-16 64 256} --context 96 \
      --out "$OUT/decode_step_bound_w8a8.json" 2>&1 | grep -v "Loading weights" | grep '^{' | cut -c1-300 ;;
  gather)  # the EP layer's gate/up GEMM reading its rows in place (row_src: one rank's tokens, several ranks' received
    # rows): its GPU tests (the kernel gathering == the copied rows, bit for bit; the layer on one rank against the
    # reference, bf16 and FP8 rows; graphed == eager; two ranks and the node's GPU path, whose received rows it gathers
    # since run 28f), then the graphed step at 256 / 64 sequences, bf16 and W8A8 experts (~6 min; TEST_LIMIT=300)
    [ "${TESTS:-}" = none ] || PYTHONPATH=$HEAD_PATH timeout ${TEST_LIMIT:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_grouped_gemm_kernel.py tests/test_layout_kernel.py \
      tests/test_expert_format_gpu.py tests/test_serve_gpu.py tests/test_runtime_gpu.py tests/test_gpu_path.py \
      -k "${TESTS:-deepseek_sizes or dequantised_reference or graphed_decode_equals or two_ranks or verifies or layer or layout}" \
      2>&1 | tee "$OUT/pytest_gpu_gather.txt" | tail -3
    PYTHONPATH=$HEAD_PATH timeout $(( (${LIMIT:-280} - SECONDS) / 2 )) python3 benchmarks/decode_step_bound.py \
      --model-dir /tmp/bench-ds3 --batches ${BATCHES:-256 64} --context 96 --out "$OUT/decode_step_bound_gather_bf16.json" \
      2>&1 | grep '^{' | cut -c1-260
    PYTHONPATH=$HEAD_PATH timeout $(( ${LIMIT:-280} - SECONDS )) python3 benchmarks/decode_step_bound.py \
      --model-dir /tmp/bench-ds3 --block-fp8 --expert-compute w8a8 --batches ${BATCHES:-256 64} --context 96 \
      --out "$OUT/decode_step_bound_gather_w8a8.json" 2>&1 | grep '^{' | cut -c1-260 ;;
  layout)  # the EP layer's layout in one kernel: its GPU tests, then the step against ab_old's tree (the one before:
    # git archive 93bf13f), then a profile of the 256-sequence step (~7 min; ROUNDS=1 and TESTS to shorten)
    PYTHONPATH=$HEAD_PATH timeout ${TEST_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_layout_kernel.py \
      tests/test_serve_gpu.py tests/test_runtime_gpu.py -k "${TESTS:-layout or graphed_decode_equals or two_ranks}" 2>&1 \
      | tee "$OUT/pytest_gpu_layout.txt" | tail -2
    ROUNDS=${ROUNDS:-2} STAGE=abstep OUT=$OUT "$0"
    PYTHONPATH=$HEAD_PATH timeout 90 python3 benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3 --batches 256 \
      --context 96 --profile --top 40 --out "$OUT/decode_step_bound_profile_layout.json" 2>&1 | grep '^{' | cut -c1-300 ;;
  session17)  # one call (~9 min): the MLA launch sweep at 256 / 64 sequences (rows kept as they come; run 30 on an
    # H100 had 64-head blocks fastest at 64 too), the GPU tests of the layout kernel, W_UV's strided GEMM and the graphed
    # step (the cache rows written inside the compiled inputs), one A/B round against ab_old (93bf13f) at 256 sequences,
    # the step's profile; the later parts run only where they fit in LIMIT seconds
    LIMIT=${LIMIT:-560}
    PYTHONPATH=$HEAD_PATH timeout ${MLA_TIMEOUT:-150} python3 benchmarks/mla_decode_tuning.py --batches 256 64 --context 96 \
      --iters 20 --block-h 32 64 --block-n 32 64 --warps 4 8 --stages 2 3 \
      --out "$OUT/mla_decode_tuning.json" > "$OUT/mla_decode_tuning.log" 2>&1; grep best "$OUT/mla_decode_tuning.log"
    PYTHONPATH=$HEAD_PATH timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_layout_kernel.py \
      tests/test_mla_output.py tests/test_attention_kernels.py tests/test_serve_gpu.py \
      -k "${TESTS:-layout or mla_output or (graphed_decode_equals and deepseek)}" 2>&1 \
      | tee "$OUT/pytest_gpu_session17.txt" | tail -2
    [ "$SECONDS" -lt $((LIMIT - 150)) ] && BATCHES=256 ROUNDS=1 STAGE=abstep OUT=$OUT "$0"
    [ "$SECONDS" -lt $((LIMIT - 90)) ] && PYTHONPATH=$HEAD_PATH timeout $((LIMIT - 15 - SECONDS)) python3 benchmarks/decode_step_bound.py \
      --model-dir /tmp/bench-ds3 --batches 256 --context 96 --profile --top 40 \
      --out "$OUT/decode_step_bound_profile.json" 2>&1 | grep '^{' | cut -c1-300
    echo "session17 done at ${SECONDS}s" ;;
  session18)  # one call (~8 min): the layout kernel's launch sweep (run 31: 24 µs a layer at 256 sequences in the step's
    # profile, one block walking 512 rows), the step with its stream above the shared experts' side stream (priority
    # -1 vs 0, PRIORITY_ROUNDS (1) interleaved rounds at 256 / 64), then the step's profile with the shared experts on the step's stream
    # (the layout kernel's time without a concurrent GEMM beside it)
    PYTHONPATH=$HEAD_PATH timeout 150 python3 benchmarks/layout_kernel_tuning.py --tokens 16 64 256 \
      --out "$OUT/layout_kernel_tuning.json" 2>&1 | grep '^{' | cut -c1-300
    for round in $(seq 1 "${PRIORITY_ROUNDS:-1}"); do
      for priority in 0 -1; do
        PYTHONPATH=$HEAD_PATH timeout 130 python3 benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3 \
          --batches 256 64 --context 96 --stream-priority $priority \
          --out "$OUT/decode_step_bound_priority_${priority}_$round.json" 2>&1 | grep '^{' | cut -c1-200
      done
    done
    PYTHONPATH=$HEAD_PATH timeout 130 python3 benchmarks/decode_step_bound.py --model-dir /tmp/bench-ds3 --batches 256 \
      --context 96 --shared-expert-stream off --profile --top 40 --out "$OUT/decode_step_bound_side_off_profile.json" \
      2>&1 | grep '^{' | cut -c1-200
    [ "$SECONDS" -lt $((${LIMIT:-560} - 150)) ] && BATCHES="256 64" ROUNDS=1 STAGE=abstep OUT=$OUT "$0"
    echo "session18 done at ${SECONDS}s" ;;
  abstep)  # the graphed decode step of ab_old's tree beside HEAD's on one warm card, ROUNDS interleaved rounds at 256 /
    # 64 sequences, bf16 experts (run 28e's A/B, scripted; ~70 s a process once the checkpoint exists)
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for tree in ab_old .; do
        name=head; [ "$tree" = ab_old ] && name=ab_old
        (cd "$tree" && PYTHONPATH="$SITE:$PWD/runtime:$OLDPWD/tests" timeout 150 python3 benchmarks/decode_step_bound.py \
           --model-dir /tmp/bench-ds3 --batches ${BATCHES:-256 64} --context 96 \
           --out "$OUT/decode_step_bound_ab_${round}_$name.json" 2>&1 | grep '^{' | cut -c1-200)
      done
    done ;;
  dense)  # inductor's GEMM autotuning against cuBLAS for the step's dense linears at 64 / 256 rows (~3 min)
    PYTHONPATH=$HEAD_PATH:$PWD/benchmarks timeout ${DENSE_TIMEOUT:-300} python3 benchmarks/dense_gemm_autotune.py --rows 64 256 \
      --out "$OUT/dense_gemm_autotune.json" > "$OUT/dense_gemm_autotune.log" 2>&1; grep '^{' "$OUT/dense_gemm_autotune.log" ;;
  onoff)
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "STAGE=onoff needs 2 GPUs (kind nvidia-h200-x2)" >&2; exit 2; }
    BENCH_TIMEOUT=560 bench . onoff --model-dir /tmp/bench-ds3 --ranks 2 --modes vexpert static --streams 64 256 "${LOAD[@]}" \
      --profile benchmarks/results/calibration/profile_h200_deepseek_v3.json --profile-streams 64 256 \
      --profile-iters 600-619 ;;
  *) echo "STAGE: tests | ab | knobs | long | kernels | longkernels | router | sidestream | fp8 | mlalong | priority |" \
          "fp8experts | fp8step | fp8serve | w8a8 | w8a8step | w8a8check | linears | h200step | gather | layout | session17 | session18 | dense | abstep | onoff" >&2; exit 2 ;;
esac
