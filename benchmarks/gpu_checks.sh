#!/usr/bin/env bash
# The GPU checks: the GPU tests and every benchmark suite, in stages that each fit one 10-minute device command.
#
#   JAXMERCURY_COMMIT=<sha> bash benchmarks/gpu_checks.sh STAGE...   # from the repository root; results under $OUT
#
# JAXMERCURY_COMMIT names the commit in the results files where the checkout has no git metadata (a copy of the
# working tree). RESUME=1 continues the benchmark stages' results files (--resume: what a time budget left out).
# Stages:
#   tests            every GPU test (python3 -m pytest tests/gpu -x -q); on one GPU longer than one command: the
#                    tests-* stages below split it
#   tests-gemm       the fused GEMM kernels (every tile variant, 1 GPU and all GPUs)
#   tests-attention  the fused ring attention, causal and not
#   tests-attention-ws  the warp-specialized fused ring attention: every block configuration, causal and not, one
#                    GPU's orders (pipelined consumers, split tails, folded rounds) and the ring
#   tests-ws-backward  our one-pass attention backward kernel (the queries whole and in chunks), ws_attention, and
#                    the fused ring attention with our backward on every GPU
#   tests-ws         one GPU, one command (under 10 minutes on an H200): the warp-specialized kernels, forward and
#                    backward, at every path their defaults take, and their schedules' training steps
#   tests-lowering   every fused lowering under its schedules (outputs, gradients, tuner)
#   tests-cudnn      cuDNN blocks in distributed schedules, the Mosaic kernels and their gradients; the plain programs
#                    in the caller's layouts on Explicit axes (tensor-parallel GEMMs, sequence-split attention)
#   tests-packed     packed rows on cuDNN blocks: the rings that skip steps by segment ids, the balanced ring; our
#                    ws kernels reading segment ids on one GPU (forward, backward, ws_attention training)
#   tests-ws-mask    our ws kernels reading mask arrays on one GPU (forward, backward, ws_attention training), B1 H32
#                    KV8 D128 S 4K 8K, masks with hidden, full and partial tiles, over every head or broadcast
#   tests-cudnn-packed  kernel cudnn_packed (cuDNN's packed layout, Hopper): a block's output and log-sum-exp, whole
#                    rows on one GPU and the ring, forward and gradients, B1 H8 KV2 D128 S 8K packed rows
#   attention        the attention suite: tuned jaxmercury against every baseline, B1, S 8K 32K 128K
#   gemm             the GEMM suite: Llama-3 8B and 70B layers at M 8K and 32K (XLA's windowed einsum in a child)
#   fused-gemm       the fused GEMM kernels against the unfused programs and JAX's kernel
#   fused-attention  the fused ring attentions, non-causal S 16K-64K, MHA and GQA
#   fused-causal     the fused ring attentions, causal S 32K GQA, natural and zigzag order
#   fused-training   training steps of the fused ring attentions, GQA S 16K-32K, causal and not
#   fused-training-sustained-32K fused-training-sustained-64K  the same at one length, timed in sustained blocks
#                    (--sustain_s 1), each fused kernel also with our backward (configured backward="ws_attention")
#   fused-noncausal  the warp-specialized ring attention without a mask, MHA and GQA S 16K-64K, sustained blocks;
#                    -training: training steps, S 16K-32K (with cuDNN's backward blocks and with ours)
#   fused-training-trace  training steps of the warp-specialized ring attention, causal GQA S32K, then each one's
#                    kernels on the first GPU in 5 traced rounds (--trace_rounds): where the zigzag ring's step loses
#                    its time against Ulysses'
#   training         training steps: jaxmercury tuned for them against every baseline
#   packed           packed rows on every GPU (the 4-GPU machine): ring, ring_zigzag and ring_balanced on cuDNN blocks,
#                    skipping by segment ids, against Ulysses with the dense packed mask, B1 H32 KV8 D128 S 32K 128K,
#                    uniform and long-tailed documents (benchmarks.packed); -training: training steps at S32K;
#                    -tuned: with the tuner's winner too, S32K
#   packed-1gpu      one GPU: packed rows on ws_attention (our kernels reading the segment ids), cuDNN's packed layout
#                    (cudnn_packed) and cuDNN with the packed mask as a bias, and jm.ops.attention untuned, against
#                    jax.nn.dot_product_attention (cuDNN) with the dense mask and cuDNN causal over the whole row, B1
#                    H32 KV8 D128 S 32K 128K, uniform and long-tailed documents and a row of one document; -training:
#                    training steps at S32K (uniform, one document)
#   packed-1gpu-mask one GPU: the same rows with the packed mask as a mask array on ws_attention (its tiles alone:
#                    no segment ids), against the dense-mask call, S32K uniform and one document; -training: training
#                    steps
#   kernels          the local attention kernels against cuDNN on one GPU, every configuration
#   tuner            the tuner's winner against every library strategy, and its cost model's ranking
#   llama-4096 llama-16384 llama-32768  one Llama-3 8B block, calibrated figures, operator candidates measured
#   one-gpu-attention  never slower, one GPU: attention GQA S 16K 32K causal and not, forward and training step
#   one-gpu-gemm     never slower, one GPU: Llama-3 8B layers at M 8K, and `python -m jaxmercury.tune` on a GEMM
#                    8192^3 (calibrating, then again with the calibration stored)
#   model            the models/ Llama (2 layers, 8B widths, 4K tokens) decorated against undecorated, training step
#   model-4gpu-32K model-4gpu-128K  every GPU (issue 55 item 2): the models/ Llama at Llama-3 8B widths, 4 layers,
#                    batch 1, 32K or 128K tokens, one training step, FSDP weights and sequence-split activations on
#                    JAX's default (Explicit) mesh: jm.distribute(tune=True, training=True) against the plain-JAX
#                    model with Ulysses + cuDNN and with all-gathered K/V + cuDNN attention, and jm.graph's block
#                    plan run for every block; tokens/s per GPU, MFU, tune time, the routes (mark: >= 1.05x of the
#                    best plain model). 128K reads the 32K stage's tuning database (its calibration): run 32K first
#   model-1gpu       one GPU: the same at 2 layers and 8K tokens
#   tune-speed       one GPU: how fast the tuner decides and that it never loses (benchmarks.tune_speed, issue 52's
#                    marks): calibration (<= 40 s), tune time once calibrated of attention B1 H32 KV8 D128 S32K causal
#                    forward (<= 10 s) and training step (<= 20 s), GEMM 8192^3 (<= 5 s), the decorated models/ Llama
#                    (2 layers, 8B widths, 4K tokens) tuned for training on a fresh database (<= 60 s in all); each
#                    tuned program against the plain program side by side (>= 0.98x)
#   tune-speed-4gpu  four GPUs, one process (issue 55 item 1): the same, attention at S32K sequence-split, the
#                    Llama-3 70B all-gather and reduce-scatter GEMMs at M 16K (x[16K@, 8K] . w[8K, 28K@] and
#                    x[16K, 28K@] . w[28K@, 8K] -> [16K@, 8K]); no model case
#   tune-speed-4proc the same with one process per GPU under jax.distributed (CUDA_VISIBLE_DEVICES=i, process 0
#                    writes the results; every process's log apart)
#   moe              the MoE layer at Mixtral-8x7B sizes against the plain-JAX einsum dispatch; ragged_dot against the
#                    Pallas Mosaic GPU grouped GEMM (and a padded einsum), forward and forward + backward
#   moe-gemm         only the grouped GEMMs of stage moe (ragged_dot and the Mosaic grouped GEMM side by side)
#   tests-moe        tests/gpu/test_grouped_gemm.py (the Mosaic grouped GEMM against ragged_dot; in a MoE schedule)
#   ws-backward      one GPU: our one-pass attention backward kernel against cuDNN's flash backward, B1 H32 D128
#                    S 4K-64K (benchmarks.ws_local --backward), and the training steps of the fused ring attention
#                    with cuDNN's backward and with ours at S 16K 32K GQA (its GPU tests: tests-ws-backward)
#   ws-sustained     one GPU: the training steps timed in sustained blocks (ws_local --training --sustain_s 1.5),
#                    B1 H32 D128 S 16K and 32K (SUSTAINED_SEQS)
#   ws-matrix        one GPU: issue 30's forward cases at the kernel's defaults against cuDNN's, sustained blocks
#                    (ws_local --causal both --sustain_s 1.5 --iters 3): B1 H32 D128 S 4K-64K, KV 32
#                    and 8, causal and not (about 350 s on an H200)
#   ws-matrix-training  one GPU: the training step on our kernels end to end (--training_steps ws_own) against
#                    cuDNN's, the same way, S 16K-64K causal and not (about 290 s on an H200)
# Every job runs under `timeout` (STAGE_LIMIT=seconds overrides each stage's), its suite under a time budget a
# minute shorter, so that a ring that deadlocks hangs rather than fails and a slow stage still writes its results.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAXMERCURY_COMMIT=${JAXMERCURY_COMMIT:-}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast is off on our machines
W=${OUT:-/tmp/gpu_checks}
mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$W/gpus.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$W/gpus.txt" 2>&1

tests() {  # name, seconds, pytest arguments...
  local name=$1 limit=${STAGE_LIMIT:-$2}
  shift 2
  JAX_PLATFORMS=cuda timeout "$limit" python3 -m pytest -q -p no:cacheprovider --durations=20 "$@" > "$W/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$W/stages.txt"
}

suite() {  # name, seconds, benchmarks.run arguments...
  local name=$1 limit=${STAGE_LIMIT:-$2}
  shift 2
  timeout "$limit" python3 -m benchmarks.run --out "$W/$name.json" --time_budget $((limit - 60)) \
    ${RESUME:+--resume} "$@" > "$W/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$W/stages.txt"
}

local_suite() {  # name, seconds, benchmarks.ws_local arguments... (one GPU)
  local name=$1 limit=${STAGE_LIMIT:-$2}
  shift 2
  timeout "$limit" python3 -m benchmarks.ws_local --out "$W/$name.json" --time_budget $((limit - 30)) "$@" \
    > "$W/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$W/stages.txt"
}

for stage in "$@"; do
  case $stage in
    tests) tests "$stage" 570 tests/gpu -x ;;
    tests-gemm) tests "$stage" 540 tests/gpu/test_fused_allgather_matmul.py tests/gpu/test_fused_allgather_matmul_comm.py \
        tests/gpu/test_fused_matmul_reducescatter.py ;;
    tests-attention) tests "$stage" 540 tests/gpu/test_fused_ring_attention.py ;;
    tests-attention-ws) tests "$stage" 540 tests/gpu/test_fused_ring_attention_ws.py ;;
    tests-ws-backward) tests "$stage" 480 tests/gpu/test_ws_attention.py ;;
    tests-ws) tests "$stage" 570 tests/gpu/test_ws_attention.py tests/gpu/test_fused_ring_attention_ws.py \
        -k "not every_gpu or smallest_grid or one_warpgroup or cudnn or head_dimension" ;;
    tests-lowering) tests "$stage" 540 tests/gpu/test_fused_lowering.py ;;
    tests-cudnn) tests "$stage" 540 tests/gpu/test_cudnn_attention.py tests/gpu/test_plain_programs.py tests/gpu/test_mosaic_kernels.py \
        tests/gpu/test_pallas_attention_gpu.py ;;
    tests-packed) tests "$stage" 540 tests/gpu/test_packed_gpu.py ;;
    tests-ws-mask) tests "$stage" 540 tests/gpu/test_ws_mask_array_gpu.py ;;
    tests-cudnn-packed) tests "$stage" 300 tests/gpu/test_cudnn_packed.py ;;
    attention) suite "$stage" 570 --suite attention --batches 1 --seqs 8K 32K 128K ;;
    gemm) suite "$stage" 570 --suite gemm --gemm_m 8K 32K ;;
    fused-gemm) suite "$stage" 570 --suite fused --ops gemm ;;
    fused-attention) suite "$stage" 570 --suite fused --ops attention --causal no ;;
    fused-causal) suite "$stage" 570 --suite fused --ops attention --causal yes --variants GQA --seqs 32K ;;
    fused-training) suite "$stage" 570 --suite fused --training --ops attention --variants GQA ;;
    fused-noncausal) suite "$stage" 290 --suite fused --ops attention --causal no --seqs 16K 32K 64K \
        --fused_kernels fused_ring_attention_ws --sustain_s 1 --iters 3 ;;
    fused-noncausal-training) suite "$stage" 420 --suite fused --training --ops attention --causal no \
        --seqs 16K 32K --fused_kernels fused_ring_attention_ws --sustain_s 1 --iters 3 ;;
    fused-training-trace) suite "$stage" 450 --suite fused --training --ops attention --causal yes --variants GQA \
        --seqs 32K --fused_kernels fused_ring_attention_ws --sustain_s 1 --iters 3 --trace_rounds 5 ;;
    fused-training-sustained-32K|fused-training-sustained-64K) suite "$stage" 570 --suite fused --training \
        --ops attention --variants GQA --seqs "${stage##*-}" --sustain_s 1.0 --iters 3 ;;
    training) suite "$stage" 570 --suite training ;;
    packed|packed-training|packed-tuned)
      args=(--seqs 32K 128K)
      [ $stage = packed-training ] && args=(--seqs 32K --training)
      [ $stage = packed-tuned ] && args=(--seqs 32K --tune)
      timeout "${STAGE_LIMIT:-570}" python3 -m benchmarks.packed --out "$W/$stage.json" \
        --time_budget $((${STAGE_LIMIT:-570} - 60)) "${args[@]}" > "$W/$stage.log" 2>&1
      echo "$stage rc=$?" | tee -a "$W/stages.txt" ;;
    packed-1gpu|packed-1gpu-training)
      args=(--seqs 32K 128K --mixes uniform long_tailed one)
      [ $stage = packed-1gpu-training ] && args=(--seqs 32K --training --mixes uniform one)
      timeout "${STAGE_LIMIT:-570}" python3 -m benchmarks.packed --out "$W/$stage.json" --mesh 1 \
        --kernels ws_attention cudnn_packed cudnn_attention --dense_limit $((32 << 30)) \
        --time_budget $((${STAGE_LIMIT:-570} - 60)) "${args[@]}" \
        > "$W/$stage.log" 2>&1
      echo "$stage rc=$?" | tee -a "$W/stages.txt" ;;
    packed-1gpu-mask|packed-1gpu-mask-training)
      args=(--seqs 32K --mixes uniform one)
      [ $stage = packed-1gpu-mask-training ] && args+=(--training)
      timeout "${STAGE_LIMIT:-570}" python3 -m benchmarks.packed --out "$W/$stage.json" --mesh 1 \
        --mask_kernels ws_attention --time_budget $((${STAGE_LIMIT:-570} - 60)) "${args[@]}" > "$W/$stage.log" 2>&1
      echo "$stage rc=$?" | tee -a "$W/stages.txt" ;;
    kernels) suite "$stage" 570 --suite kernels --configs ;;
    tuner) suite "$stage" 570 --suite tuner ;;
    llama-4096|llama-16384|llama-32768) suite "$stage" 570 --suite llama --seqs "${stage#llama-}" --measure_iters 5 \
        --iters 10 ;;
    one-gpu-attention)
      suite "$stage-forward" 280 --suite attention --mesh 1 --batches 1 --variants GQA --seqs 16K 32K --causal both
      suite "$stage-training" 290 --suite training --mesh 1 --ops attention --seqs 16K 32K --causal both ;;
    one-gpu-gemm)
      suite "$stage" 330 --suite gemm --mesh 1 --gemm_m 8K --models 8B --no_windowed
      for run in calibrating stored; do
        timeout 120 python3 -m jaxmercury.tune matmul --m 8192 --n 8192 --k 8192 --dtype bfloat16 --db "$W/cli.db" \
          --retune --json "$W/$stage-cli-$run.json" > "$W/$stage-cli-$run.log" 2>&1
        echo "$stage-cli-$run rc=$?" | tee -a "$W/stages.txt"
      done ;;
    model) suite "$stage" 570 --suite model ;;
    model-4gpu-32K|model-4gpu-128K) suite "$stage" 570 --suite model --fsdp --model_layers 4 \
        --seqs "${stage##*-}" --db "$W/model-4gpu.tuning.db" ;;
    model-1gpu) suite "$stage" 570 --suite model --fsdp --mesh 1 --model_layers 2 --seqs 8K ;;
    tune-speed)
      timeout "${STAGE_LIMIT:-590}" python3 -m benchmarks.tune_speed --out "$W/$stage.json" \
        --time_budget $((${STAGE_LIMIT:-590} - 60)) > "$W/$stage.log" 2>&1
      echo "$stage rc=$?" | tee -a "$W/stages.txt" ;;
    tune-speed-4gpu)
      timeout "${STAGE_LIMIT:-590}" python3 -m benchmarks.tune_speed --out "$W/$stage.json" \
        --cases calibration attention attention-training gemm-ag gemm-rs --gemm 16384,8192,28672 \
        --gemm_rs 16384,28672,8192 --time_budget $((${STAGE_LIMIT:-590} - 60)) > "$W/$stage.log" 2>&1
      echo "$stage rc=$?" | tee -a "$W/stages.txt" ;;
    tune-speed-4proc)
      port=$((20000 + RANDOM % 20000))
      for i in 0 1 2 3; do
        CUDA_VISIBLE_DEVICES=$i timeout "${STAGE_LIMIT:-590}" python3 -m benchmarks.tune_speed --out "$W/$stage.json" \
          --processes 4 --process_id $i --coordinator "127.0.0.1:$port" \
          --cases calibration attention attention-training gemm-ag gemm-rs --gemm 16384,8192,28672 \
          --gemm_rs 16384,28672,8192 --time_budget $((${STAGE_LIMIT:-590} - 60)) > "$W/$stage-p$i.log" 2>&1 &
      done
      rc=0
      for job in $(jobs -p); do wait "$job" || rc=$?; done
      echo "$stage rc=$rc" | tee -a "$W/stages.txt" ;;
    moe) suite "$stage" 570 --suite moe ;;
    moe-gemm) suite "$stage" 570 --suite moe --moe_kinds grouped_gemm ;;
    tests-moe) tests "$stage" 540 tests/gpu/test_grouped_gemm.py ;;
    ws-backward)
      local_suite "$stage" 200 --backward --seqs 4K 8K 16K 32K 64K
      local_suite "$stage-training" 120 --training --seqs 16K 32K --kv 8 ;;
    ws-sustained) local_suite "$stage" 420 --training --sustain_s 1.5 --iters 3 --seqs ${SUSTAINED_SEQS:-16K 32K} ;;
    ws-matrix) local_suite "$stage" 570 --causal both --kv 32 8 --seqs 4K 8K 16K 32K 64K \
        --sustain_s 1.5 --iters 3 ;;
    ws-matrix-training) local_suite "$stage" 480 --training --training_steps ws_own --causal both --kv 32 8 \
        --seqs 16K 32K 64K --sustain_s 1.5 --iters 3 ;;
    *) echo "unknown stage $stage" | tee -a "$W/stages.txt" ;;
  esac
done
