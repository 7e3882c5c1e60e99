#!/usr/bin/env bash
# The GPU checks of the fused kernels and the Llama block, in stages that each fit one 10-minute device command.
#
#   bash benchmarks/gpu_checks.sh STAGE...      # from the repository root; results under $OUT/w (default /tmp/w)
#
# Stages:
#   tests-gemm       GPU tests of the fused GEMM kernels (every tile variant, 1 GPU and all GPUs)
#   tests-attention  GPU tests of the fused ring attention, causal and not
#   tests-attention-ws  GPU tests of the warp-specialized fused ring attention, its pipelined consumers too
#   tests-lowering   GPU tests of every fused lowering under its schedules (outputs, gradients, tuner)
#   tests-lowering-attention  the ring-attention part of tests-lowering (outputs and gradients)
#   tests-lowering-gemm  the GEMM part of tests-lowering (outputs, gradients through the dual fused GEMM, tuner)
#   tests-cudnn      cuDNN blocks in distributed schedules: outputs, gradients, the joint backward
#   tests-mosaic-gradients  Mosaic-patched schedules' gradients (their backward on cuDNN blocks)
#   bench-ag         all-gather GEMM table: XLA, the shard_map ring, JAX's kernel, our three kernels
#   bench-rs         reduce-scatter GEMM table
#   bench-attention  non-causal fused ring attention (S 16K-64K, KV 32 and 8) against all-gathered K/V and rings
#   bench-causal     causal fused ring attention (S 32K, KV 8) against Ulysses, all-gathered K/V and rings
#   bench-training   forward+backward: the fused ring-attention lowerings against the cuDNN baselines (S 16K-32K,
#                    KV 8; S16K also the fused lowering's backward before 2026-11-24)
#   bench-training-causal  the same, causal S 32K KV 8, zigzag lowerings and the zigzag cuDNN ring
#   bench-backward   attention's backward on cuDNN blocks: dq and dk-dv in one nest against apart (S 16K-32K, KV 8,
#                    non-causal and causal)
#   tune-training    the tuner for a causal GQA training step (S8K, H32 KV8 D128 bf16), fresh database
#   llama-4096       one Llama-3 8B block at 4K tokens, calibrated figures, operator candidates measured
#   llama-16384      the same at 16K tokens
#   llama-32768      the same at 32K tokens
# Every job runs under `timeout` (STAGE_LIMIT=seconds overrides each stage's): a ring that deadlocks hangs
# rather than fails.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast is off on our machines
W=${OUT:-/tmp}/w
mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$W/gpus.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$W/gpus.txt" 2>&1

gpu_tests() {  # name, seconds, test files...
  local name=$1 limit=${STAGE_LIMIT:-$2}
  shift 2
  JAX_PLATFORMS=cuda timeout "$limit" python3 -m pytest -q -p no:cacheprovider --durations=20 "$@" > "$W/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$W/stages.txt"
}

job() {  # name, seconds, command...
  local name=$1 limit=${STAGE_LIMIT:-$2}
  shift 2
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$W/stages.txt"
}

for stage in "$@"; do
  case $stage in
    tests-gemm) gpu_tests "$stage" 540 tests/gpu/test_fused_allgather_matmul.py \
        tests/gpu/test_fused_allgather_matmul_comm.py tests/gpu/test_fused_matmul_reducescatter.py ;;
    tests-attention) gpu_tests "$stage" 540 tests/gpu/test_fused_ring_attention.py ;;
    tests-attention-ws) gpu_tests "$stage" 540 tests/gpu/test_fused_ring_attention_ws.py ;;
    tests-lowering) gpu_tests "$stage" 540 tests/gpu/test_fused_lowering.py ;;
    tests-lowering-attention) gpu_tests "$stage" 400 tests/gpu/test_fused_lowering.py -k ring_attention ;;
    tests-lowering-gemm) gpu_tests "$stage" 540 tests/gpu/test_fused_lowering.py -k "not ring_attention" ;;
    tests-cudnn) gpu_tests "$stage" 300 tests/gpu/test_cudnn_attention.py ;;
    tests-mosaic-gradients) gpu_tests "$stage" 400 tests/gpu/test_mosaic_kernels.py -k gradients ;;
    bench-ag) job "$stage" 560 python3 -m benchmarks.fused_gemm --kind allgather --iters 20 --out "$W/fused_ag.json" ;;
    bench-rs) job "$stage" 560 python3 -m benchmarks.fused_gemm --kind reducescatter --iters 20 \
        --out "$W/fused_rs.json" ;;
    bench-attention) job "$stage" 560 python3 -m benchmarks.fused_attention --seq 16384 32768 65536 \
        --kv_heads 32 8 --iters 10 --out "$W/fused_attention.json" ;;
    bench-causal) job "$stage" 560 python3 -m benchmarks.fused_attention --causal --seq 32768 --kv_heads 8 \
        --iters 10 --out "$W/fused_attention_causal.json" ;;
    bench-training) job "$stage-16k" 300 python3 -m benchmarks.fused_attention --training --previous_backward \
          --seq 16384 --kv_heads 8 --iters 10 --out "$W/fused_attention_training_16k.json"
        job "$stage-32k" 300 python3 -m benchmarks.fused_attention --training --seq 32768 --kv_heads 8 --iters 10 \
          --out "$W/fused_attention_training_32k.json" ;;
    bench-training-causal) job "$stage" 400 python3 -m benchmarks.fused_attention --training --causal --seq 32768 \
        --kv_heads 8 --iters 10 --out "$W/fused_attention_training_causal.json" ;;
    bench-backward) job "$stage" 200 python3 -m benchmarks.attention_backward --seq 16384 32768 --kv_heads 8 \
          --out "$W/attention_backward.json"
        job "$stage-causal" 200 python3 -m benchmarks.attention_backward --causal --seq 16384 32768 --kv_heads 8 \
          --out "$W/attention_backward_causal.json" ;;
    tune-training) rm -f "$W/tuning.db"
        job "$stage" 560 python3 -m jaxmercury.tune attention --training --causal --seq_len 8192 --heads 32 \
          --kv_heads 8 --head_dim 128 --dtype bfloat16 --iters 5 --space 4 --top 3 --db "$W/tuning.db" \
          --json "$W/tune_training.json" ;;
    llama-4096|llama-16384|llama-32768) job "$stage" 570 python3 -m benchmarks.llama_block --seq "${stage#llama-}" \
        --measure_iters 5 --iters 10 --out "$W/$stage.json" ;;
    *) echo "unknown stage $stage" | tee -a "$W/stages.txt" ;;
  esac
done
