#!/usr/bin/env bash
# megalite on one GPU, in two tiers (benchmarks/gpu/steps.tsv lists the steps, their tier,
# their time limit and their last GPU run):
#
#   bash benchmarks/gpu_check.sh                 # TIER=core: the first command on a GPU
#                                                # (its limits sum to under 8 minutes)
#   TIER=extended bash benchmarks/gpu_check.sh   # the rest (TIER=all: both)
#   SMOKE=1 TIER=all bash benchmarks/gpu_check.sh  # the same steps, tiny, on the CPU (gloo;
#                                                # torch.compile with aot_eager, not inductor)
#
# core: the environment; the tests that skip without a GPU; attention kernels and RNG on the
# GPU; a bf16 matmul peak; MFU, tokens/s, peak memory next to the planner's figure, the time
# to the first step and a one-step profile of a TinyLlama-shaped 1.1B with the default flags
# (compiled layers); save + resume bit-exact (fp32 Adam, bf16 ZeRO-1); torchrun over NCCL
# with ZeRO-1 and both overlaps; compiled layers with ZeRO-1's overlapped param gather (no
# recompile, no graph break); MoE (grouped GEMM against the loop, experts without tokens,
# the expert bias, under FSDP2 with offload); the save paths (async, async with offload, async
# with the expert bias, local non-persistent, a CPU-written checkpoint resumed on the GPU).
# extended: GPT-2 350M in bf16 (the log line) and the peak table; FSDP2 with CPU offload
# against ZeRO-1; a Megatron checkpoint loaded by each optimizer; ring attention's fused
# blocks; the zero-bubble B/W split; a CUDA memory snapshot; GPT 1.3B and eager 1.1B MFU;
# compiled layers with full recompute and under PP 2 (two GPUs), the compiled loss with eager
# layers; FP8 rowwise, eager with its weight cache, with recompute and in the W pass; the
# cluster check at world size 1 with --tune; pretrain()'s own tests on the GPU; FP8 against
# bf16 on Llama-3-8B layer shapes over FP8_ITERS (default 300) steps (about 6 minutes).
#
# One "PASS|FAIL|SKIP <step>: detail" line per step, the results (">>" lines) under it, and
# a summary; a failing step never stops the next, and every step is cut to what is left of
# BUDGET_S. Exit status 0 when no step failed.
# Output (at most 5 files): $OUT/gpu_check/ (or $TMPDIR/megalite_gpu_check/gpu_check when OUT is
# unset): summary.txt (the result lines, written as they come), step_times.tsv (each step's
# seconds and exit status: the "measured" column of steps.tsv), logs.tar.gz (every log),
# trace_llama_1b.json.gz (chrome trace of the profiled step), cluster_report.md (the
# cluster check's report). Checkpoints and loose logs live in a temporary directory that is
# removed at the end.
# Env: TIER (core, extended, all; default core, or all when STEPS is set), BUDGET_S (default: the tier's limits summed,
# 4x under SMOKE), PYTHON, PEAK_TFLOPS (default 989: H100/H200 SXM dense bf16),
# EXTRA_PERF_FLAGS (appended to the MFU runs), STEPS (run only these step names; the others
# SKIP), FP8_ITERS, FP8_MAX_LAYERS (at most this many layers in the fp8 step), SMOKE=1.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
export REPO=$PWD
[ -f "$REPO/pretrain_gpt.py" ] || { echo "FAIL setup: $REPO is not a megalite checkout"; exit 2; }
export PY=${PYTHON:-python3} SMOKE=${SMOKE:-0} PEAK=${PEAK_TFLOPS:-989}
export EXTRA_PERF_FLAGS=${EXTRA_PERF_FLAGS:-}
export HELPERS=$REPO/benchmarks/gpu
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
STEPS=${STEPS:-}
T0=$(date +%s)
export RESULTS=${OUT:-${TMPDIR:-/tmp}/megalite_gpu_check}/gpu_check
export LOG
LOG=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
mkdir -p "$RESULTS"
rm -f "$RESULTS/summary.txt" "$RESULTS/step_times.tsv" "$RESULTS/logs.tar.gz" \
    "$RESULTS"/trace_*.json.gz "$RESULTS/cluster_report.md"
SUMMARY=()

finish() {  # one archive of the logs (no checkpoints), then the scratch directory goes
    tar -czf "$RESULTS/logs.tar.gz" -C "$LOG" --exclude 'ckpt_*' . 2>/dev/null
    rm -rf "$LOG"
}
trap finish EXIT
trap 'exit 143' TERM INT  # a killed check still leaves its logs

note() { echo "$1 $2: $3"; echo "$1 $2: $3" >>"$RESULTS/summary.txt"; SUMMARY+=("$1 $2: $3"); }

# step NAME LIMIT_S FUNCTION [MIN_S]: run FUNCTION (exported) under timeout, cut to what is
# left of the budget (SKIP if less than MIN_S, default 25, is left); lines it prints that
# start with ">>" are shown and kept in summary.txt, and on failure the log's tail.
step() {
    local name=$1 limit=$2 fn=$3 min=${4:-25} rem rc start why
    if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then
        note SKIP "$name" "not in STEPS"; return 1
    fi
    [ "$SMOKE" = 1 ] && limit=$((4 * limit))  # a shared CPU is slow; the GPU limits stand
    rem=$((BUDGET_S - ($(date +%s) - T0)))
    if [ "$rem" -lt "$min" ]; then note SKIP "$name" "${rem}s of the budget left"; return 1; fi
    [ "$limit" -gt "$rem" ] && limit=$rem
    start=$(date +%s)
    timeout -k 15 "$limit" bash -c "$fn" </dev/null >"$LOG/$name.log" 2>&1
    rc=$?
    grep -a '^>>' "$LOG/$name.log" | sed 's/^>>/   /' | tee -a "$RESULTS/summary.txt"
    printf "%s\t%s\t%s\n" "$name" "$(($(date +%s) - start))" "$rc" >>"$RESULTS/step_times.tsv"
    if [ $rc -eq 0 ]; then
        note PASS "$name" "$(($(date +%s) - start))s"
    elif [ $rc -eq 99 ]; then
        note SKIP "$name" "$(grep -a '^SKIP:' "$LOG/$name.log" | tail -n 1 | cut -c7-)"
    else
        { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && why="timed out after ${limit}s" || why="exit $rc"
        note FAIL "$name" "$why (log: $name.log in logs.tar.gz)"
        grep -a -v '^>>' "$LOG/$name.log" | grep -av USDT | tail -n 20 | sed 's/^/    | /'
    fi
}
skip() { echo "SKIP: $1"; exit 99; }

# ---- models -------------------------------------------------------------------------------
BACKEND=""
[ "$SMOKE" = 1 ] && BACKEND="--distributed-backend gloo"
export BACKEND
# GPT-2 medium 355M: learned positions, LayerNorm, GeLU, tied, vocab 50257, dropout 0.1.
export GPT350="--mock-data --vocab-size 50257 --num-layers 24 --hidden-size 1024
  --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
  --micro-batch-size 8 --global-batch-size 16"
# TinyLlama 1.1B: GQA 32/4, SwiGLU 5632, RoPE, RMSNorm, untied, vocab 32000, no dropout.
export LLAMA1B="--mock-data --vocab-size 32000 --num-layers 22 --hidden-size 2048
  --num-attention-heads 32 --group-query-attention --num-query-groups 4 --ffn-hidden-size 5632
  --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope
  --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0 --hidden-dropout 0"
# GPT 1.3B: 24 layers, hidden 2048, 16 heads (MHA), LayerNorm, GeLU, tied, no dropout.
export GPT13B="--mock-data --vocab-size 50257 --num-layers 24 --hidden-size 2048
  --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
  --attention-dropout 0 --hidden-dropout 0"
# A small model with dropout on, so the RNG state matters on resume.
export SMALL="--mock-data --vocab-size 1000 --num-layers 4 --hidden-size 256
  --num-attention-heads 8 --seq-length 256 --micro-batch-size 4 --global-batch-size 8
  --lr 1e-3 --attention-dropout 0.1 --hidden-dropout 0.1 --num-workers 0"
export ITERS=30 MFU_ITERS=15 RESUME_ITERS=10 COMPILE_BACKEND=""  # torch's default: inductor
export FOUR_MICRO="--micro-batch-size 2 --global-batch-size 8" PEAK_FLAG="" GPU_DEFAULT=""
if [ "$SMOKE" = 1 ]; then
    TINY="--mock-data --vocab-size 256 --num-layers 2 --hidden-size 32 --num-attention-heads 4
      --seq-length 32 --max-position-embeddings 32 --num-workers 0"
    GPT350="$TINY --micro-batch-size 2 --global-batch-size 4"
    LLAMA1B="$TINY --position-embedding-type rope --normalization RMSNorm --swiglu
      --group-query-attention --num-query-groups 2 --disable-bias-linear
      --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0"
    GPT13B="$TINY --attention-dropout 0 --hidden-dropout 0"
    SMALL="$TINY --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --attention-dropout 0.1
      --hidden-dropout 0.1"
    ITERS=6 MFU_ITERS=5 RESUME_ITERS=4 FOUR_MICRO="--micro-batch-size 1 --global-batch-size 4"
    PEAK_FLAG="--peak-tflops $PEAK"  # a CPU has no entry in the peak table: MFU on the log
    # Inductor's C++ build of one tiny model's layer takes about a minute on a 2-core CPU;
    # aot_eager runs the same torch.compile capture (dynamo, AOTAutograd) on eager kernels.
    COMPILE_BACKEND=aot_eager GPU_DEFAULT="--compile-layers"
fi
export PERF="--bf16 --attention-backend sdpa --lr 1e-4 --eval-iters 0 --log-throughput"
# Llama-3-8B's layer shapes (hidden 4096, SwiGLU 14336, GQA 32/8, RoPE base 500000) with a
# 32000 vocabulary (128256 would cost the memory of ~5 layers), as many layers as the planner
# fits in 80% of the GPU; 4 micro-batches of 2 x 2048 tokens a step, FP8_ITERS steps.
export LLAMA8B="--vocab-size 32000 --hidden-size 4096 --ffn-hidden-size 14336
  --num-attention-heads 32 --group-query-attention --num-query-groups 8 --seq-length 2048
  --max-position-embeddings 2048 --position-embedding-type rope --rotary-base 500000
  --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0 --hidden-dropout 0 --micro-batch-size 2 --global-batch-size 8"
export FP8_ITERS=${FP8_ITERS:-300} FP8_FIT="--fit 0.8 ${FP8_MAX_LAYERS:+--max-layers $FP8_MAX_LAYERS}"
export FP8_COMPILE="--compile-layers"
if [ "$SMOKE" = 1 ]; then
    LLAMA8B="--vocab-size 256 --num-layers 2 --hidden-size 32 --num-attention-heads 4
      --seq-length 32 --max-position-embeddings 32 --num-workers 0
      --position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention --num-query-groups 2 --disable-bias-linear
      --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
      --micro-batch-size 2 --global-batch-size 4"
    FP8_ITERS=4 FP8_FIT="" FP8_COMPILE=""  # seconds, not a compile on a loaded CPU
fi

# ---- the steps ----------------------------------------------------------------------------
env_info() {
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit \
        --format=csv,noheader | sed 's/^/>> nvidia-smi: /'
    "$PY" - <<'EOF'
import importlib.util, os, torch
gpu = torch.cuda.is_available()
print(">> torch", torch.__version__, "| cuda", torch.version.cuda, "| GPU visible", gpu)
try:  # details only: a missing attribute on some build must not stop the check
    if gpu:
        p = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        print(f">> {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
              f"{p.multi_processor_count} SMs, nccl "
              f"{'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}, "
              f"cudnn {torch.backends.cudnn.version()}")
    print(">> modules:", ", ".join(f"{m} {'yes' if importlib.util.find_spec(m) else 'NO'}"
                                   for m in ("flash_attn", "triton", "numpy", "sentencepiece",
                                             "tensorboard", "pytest", "transformers")))
    import megalite
    print(">> megalite from", os.path.dirname(megalite.__file__))
except Exception as e:  # noqa: BLE001
    print(">> (environment detail failed:", type(e).__name__, e, ")")
raise SystemExit(0 if gpu or os.environ["SMOKE"] == "1" else 1)
EOF
}

gpu_tests() {  # the tests that skip without a GPU: a skip reason naming a GPU or CUDA
    local files
    files=$(grep -rlE --include='test_*.py' 'skipif' tests | xargs -r grep -lE 'GPU|CUDA')
    [ -n "$files" ] || skip "no test says it needs a GPU"
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -rs -p no:cacheprovider -p benchmarks.gpu.gpu_only_tests $files >"$LOG/pytest.txt" 2>&1
    local rc=$?
    cat "$LOG/pytest.txt"
    grep -aE "^(SKIPPED|FAILED|ERROR)|[0-9]+ (passed|failed|skipped)" "$LOG/pytest.txt" \
        | cut -c1-160 | sed 's/^/>> /'
    if [ "$SMOKE" != 1 ] && grep -qE "^SKIPPED.*(CUDA|GPU)" "$LOG/pytest.txt"; then
        echo ">> (a skip above on a GPU machine: a missing package such as flash-attn)"
    fi
    exit $rc
}

kernels() { "$PY" "$HELPERS/kernels.py"; }
matmul_peak() { "$PY" "$HELPERS/matmul_peak.py" "$LOG/matmul_tflops.txt"; }

train_350m() {  # with --profile and the timers' device events (--timing-log-level 2)
    $PY pretrain_gpt.py $GPT350 $BACKEND --bf16 --lr 3e-4 --min-lr 3e-5 \
        --lr-decay-style cosine --lr-warmup-iters 5 --train-iters "$ITERS" \
        --log-interval $((ITERS / 3)) --log-throughput --eval-iters 0 $PEAK_FLAG \
        --profile --profile-step-start 2 --profile-step-end 3 --profile-dir "$LOG/profile" \
        --timing-log-level 2 >"$LOG/train_350m.out" 2>&1
    rc=$?
    cat "$LOG/train_350m.out"
    [ $rc -eq 0 ] || exit $rc
    # --profile's trace (CUDA activity on a GPU): written, then dropped (tens of MB)
    ls "$LOG"/profile/rank0.iter3-3.pt.trace.json >/dev/null || exit 1
    echo ">> --profile: rank 0's trace of iteration 3 written"; rm -rf "$LOG/profile"
    "$PY" "$HELPERS/parse_log.py" "$LOG/train_350m.out" "$PEAK"
}

# mfu FLAGS_VAR_NAME NAME [PROFILE]: the planner's micro-batch (2 micro-batches per step),
# MFU_ITERS logged iterations; with PROFILE one more, profiled, iteration after them.
mfu() {
    local flags="${!1} $PERF $EXTRA_PERF_FLAGS" name=$2 mbs try rc extra=() iters=$MFU_ITERS
    local matmul
    # Within 85% of the GPU: the plan counts compiled layers and loss as they are (the 1.1B
    # at micro-batch 8 planned 42.2 GiB with the eager loss against 43.2 measured on an
    # H100; 41.3 with the compiled loss); at 75% the 1.1B would stay at micro-batch 8. An
    # out-of-memory run halves it below.
    mbs=$("$PY" "$HELPERS/planner.py" 0.85 $flags --train-iters "$iters") || exit 1
    if [ "${3:-}" = profile ]; then
        iters=$((MFU_ITERS + 1))
        extra=(--profile-step "$iters" --trace "$RESULTS/trace_$name.json.gz")
    fi
    for try in 1 2 3; do
        echo ">> micro-batch $mbs, global batch $((2 * mbs)) (2 micro-batches), $MFU_ITERS" \
            "timed iterations${EXTRA_PERF_FLAGS:+, extra flags: $EXTRA_PERF_FLAGS}"
        $PY "$HELPERS/run_pretrain.py" "${extra[@]}" ${COMPILE_BACKEND:+--compile-backend \
            $COMPILE_BACKEND} -- $flags $BACKEND --micro-batch-size "$mbs" \
            --global-batch-size $((2 * mbs)) --train-iters "$iters" \
            --log-interval $((MFU_ITERS / 3)) >"$LOG/$name.run$try.log" 2>&1
        rc=$?
        cat "$LOG/$name.run$try.log"
        [ $rc -eq 0 ] && break
        if grep -q "out of memory" "$LOG/$name.run$try.log" && [ "$mbs" -gt 1 ]; then
            echo ">> out of memory at micro-batch $mbs: the planner underestimates; halving"
            mbs=$((mbs / 2))
        else
            exit $rc
        fi
    done
    [ $rc -eq 0 ] || exit $rc
    matmul=$(cat "$LOG/matmul_tflops.txt" 2>/dev/null || echo 0)
    "$PY" "$HELPERS/parse_log.py" "$LOG/$name.run$try.log" "$PEAK" "$matmul" nofall
}
# With no flag, a GPU compiles each layer (config.compile_by_default); under SMOKE the CPU
# is asked to, so the same path runs (aot_eager).
mfu_llama_1b() { EXTRA_PERF_FLAGS="$GPU_DEFAULT $EXTRA_PERF_FLAGS" mfu LLAMA1B llama_1b profile; }
mfu_gpt_1b3() { mfu GPT13B gpt_1b3; }
mfu_llama_1b_eager() {  # the same 1.1B run with the documented way out: eager layers
    EXTRA_PERF_FLAGS="$EXTRA_PERF_FLAGS --no-compile-layers" mfu LLAMA1B llama_1b_eager
}

# resume_case NAME EXTRA_FLAGS...: straight N vs N/2 + save + load + N/2. Deterministic
# kernels (torch.use_deterministic_algorithms): embedding and attention backward use atomics
# on a GPU by default, which would make even two straight runs differ in the last bit.
resume_case() {
    local name=$1; shift
    local d="$LOG/ckpt_$name" half=$((RESUME_ITERS / 2))
    local common="$SMALL $BACKEND --train-iters $RESUME_ITERS --log-interval 1 --eval-iters 0"
    local run=("$PY" "$HELPERS/run_pretrain.py" --deterministic --)
    export CUBLAS_WORKSPACE_CONFIG=:4096:8
    "${run[@]}" $common "$@" --save "$d/straight" >"$LOG/$name.straight.log" 2>&1 \
        || { tail -n 20 "$LOG/$name.straight.log"; echo ">> $name: the straight run failed"; return 1; }
    "${run[@]}" $common "$@" --save "$d/resumed" --exit-interval "$half" \
        >"$LOG/$name.first.log" 2>&1 \
        || { tail -n 20 "$LOG/$name.first.log"; echo ">> $name: the run to $half failed"; return 1; }
    "${run[@]}" $common "$@" --save "$d/resumed" --load "$d/resumed" \
        >"$LOG/$name.resumed.log" 2>&1 \
        || { tail -n 20 "$LOG/$name.resumed.log"; echo ">> $name: the resumed run failed"; return 1; }
    echo ">> $name:"
    "$PY" "$HELPERS/compare_resume.py" "$LOG/$name.straight.log" "$LOG/$name.resumed.log" \
        "$d/straight" "$d/resumed"
}
checkpoint_resume() {
    local rc=0
    resume_case fp32_adam || rc=1
    resume_case bf16_zero1 --bf16 --use-distributed-optimizer --position-embedding-type rope \
        --normalization RMSNorm --swiglu --group-query-attention --num-query-groups 2 || rc=1
    exit $rc
}

torchrun_nccl() {
    local backend="--distributed-backend nccl"
    [ "$SMOKE" = 1 ] && backend="--distributed-backend gloo"
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py $SMALL \
        $backend --bf16 --use-distributed-optimizer --overlap-grad-reduce \
        --overlap-param-gather --accumulate-allreduce-grads-in-fp32 \
        --recompute-granularity selective --exit-signal-handler --train-iters "$RESUME_ITERS" \
        --log-interval $((RESUME_ITERS / 2)) --log-throughput --eval-interval $((RESUME_ITERS / 2)) \
        --eval-iters 2 --save "$LOG/ckpt_torchrun" --save-interval $((RESUME_ITERS / 2)) \
        >"$LOG/torchrun.out" 2>&1
    rc=$?
    cat "$LOG/torchrun.out"
    [ $rc -eq 0 ] || exit $rc
    grep -q "validation loss at iteration $RESUME_ITERS" "$LOG/torchrun.out" \
        || { echo ">> no validation at iteration $RESUME_ITERS"; exit 1; }
    "$PY" "$HELPERS/parse_log.py" "$LOG/torchrun.out"
}

mfu_table() {  # train_350m's MFU and matmul_peak's rate against peak_flops.py's entry
    [ -f "$LOG/train_350m.out" ] && [ -f "$LOG/matmul_tflops.txt" ] \
        || skip "needs the output of train_350m and matmul_peak"
    "$PY" "$HELPERS/mfu_table.py" "$LOG/train_350m.out" "$LOG/matmul_tflops.txt" "$PEAK"
}

export NO_DROPOUT="--attention-dropout 0 --hidden-dropout 0"  # runs of optimizers compared
fsdp_offload() {  # under torchrun, one process: NCCL on the GPU
    local backend="--distributed-backend nccl"
    [ "$SMOKE" = 1 ] && backend="--distributed-backend gloo"
    "$PY" "$HELPERS/fsdp_offload.py" "$LOG" -- $SMALL $backend --bf16 $NO_DROPOUT $FOUR_MICRO \
        --train-iters "$RESUME_ITERS"
}
megatron_load() { "$PY" "$HELPERS/megatron_load.py" "$LOG" -- $SMALL $BACKEND $NO_DROPOUT \
    --eval-iters 0; }
ring_attention() { "$PY" "$HELPERS/ring_attention.py"; }
# causal against block-causal (flash varlen, flex, sdpa per document), outputs checked
document_attention() { "$PY" "$REPO/benchmarks/document_attention.py"; }
# MLA's V heads narrower than Q/K's: sdpa, flash (V padded), documents, the ring's fused blocks
multi_latent_attention() { "$PY" "$HELPERS/mla_paths.py"; }
zero_bubble() { "$PY" "$HELPERS/zero_bubble.py"; }
fp8() {  # bf16 and --fp8-format hybrid, both compiled: tokens/s ratio, loss after FP8_ITERS
    "$PY" "$HELPERS/fp8_vs_bf16.py" "$LOG" "$FP8_ITERS" $FP8_FIT \
        ${COMPILE_BACKEND:+--compile-backend $COMPILE_BACKEND} -- $LLAMA8B $PERF --lr 3e-4 \
        --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters $((FP8_ITERS / 10)) \
        $FP8_COMPILE $EXTRA_PERF_FLAGS $BACKEND $PEAK_FLAG
}

memory_snapshot() {  # --record-memory-history without --profile: the snapshot, checked
    local snapshot="$LOG/snapshot.pickle" rc
    $PY pretrain_gpt.py $SMALL $BACKEND --bf16 --train-iters 4 --log-interval 2 --eval-iters 0 \
        --record-memory-history --memory-snapshot-path "$snapshot" >"$LOG/snapshot.out" 2>&1
    rc=$?
    cat "$LOG/snapshot.out"
    if [ "$SMOKE" = 1 ] && [ $rc -ne 0 ] && grep -q "needs a GPU" "$LOG/snapshot.out"; then
        skip "the CUDA allocator's history needs a GPU (on the CPU the flag is refused)"
    fi
    [ $rc -eq 0 ] || exit $rc
    "$PY" "$HELPERS/memory_snapshot.py" "$snapshot"
    rc=$?
    rm -f "$snapshot"  # megabytes of stacks: not for logs.tar.gz
    exit $rc
}

implicit_gpu_tests() {
    [ "$SMOKE" = 1 ] && skip "CPU CI runs these end-to-end tests already"
    # pretrain() picks nccl and the GPU by itself when one is visible, so these end-to-end
    # tests run on the GPU here. A numeric (not a crash) failure may be GPU nondeterminism.
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_training.py::test_log_line_fields \
        tests/test_training.py::test_bf16_learns_and_tracks_fp32 \
        tests/test_checkpointing.py::test_resume_in_a_new_process_is_bit_exact
    rc=$?
    echo ">> $(grep -aE "[0-9]+ (passed|failed)" "$LOG/implicit_gpu_tests.log" | tail -n 1)"
    exit $rc
}

# The paths no step ran before issue 39 (the `# gpu_check: <step>` tags in the code name them).
compiled_zero1_overlap() {  # no recompile, no graph break: the param-gather waits outside
    "$PY" "$HELPERS/compiled_paths.py" zero1_overlap "$LOG" \
        ${COMPILE_BACKEND:+--compile-backend $COMPILE_BACKEND} -- $SMALL $BACKEND --bf16 \
        $NO_DROPOUT --train-iters 4 --log-interval 1 --eval-iters 0
}
moe_paths() { "$PY" "$HELPERS/moe_paths.py" "$LOG" -- $SMALL $BACKEND --bf16 $NO_DROPOUT \
    --train-iters 4 --log-interval 1 --eval-iters 0; }
save_paths() { "$PY" "$HELPERS/save_paths.py" "$LOG" -- $SMALL $BACKEND --bf16 \
    --train-iters "$RESUME_ITERS" --log-interval 1 --eval-iters 0; }
compiled_paths() {
    "$PY" "$HELPERS/compiled_paths.py" paths "$LOG" \
        ${COMPILE_BACKEND:+--compile-backend $COMPILE_BACKEND} -- $SMALL $BACKEND --bf16 \
        $NO_DROPOUT --train-iters 4 --log-interval 1 --eval-iters 0
}
fp8_paths() { "$PY" "$HELPERS/fp8_paths.py" "$LOG" \
    ${COMPILE_BACKEND:+--compile-backend $COMPILE_BACKEND} -- $SMALL $BACKEND --bf16 \
    $NO_DROPOUT --train-iters 4 --log-interval 1 --eval-iters 0; }
check_cluster_tune() {  # world size 1: every check, --tune; the report kept beside summary.txt
    local rc
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 tools/check_cluster.py \
        --output-dir "$LOG/cluster" --tune --tune-micro-batch-sizes 1 2 4 --tune-max 2 \
        --steps 2 --timed-steps 2 $GPT350 $BACKEND --bf16 --train-iters 10 \
        >"$LOG/check_cluster.out" 2>&1
    rc=$?
    cat "$LOG/check_cluster.out"
    [ -f "$LOG/cluster/REPORT.md" ] && cp "$LOG/cluster/REPORT.md" "$RESULTS/cluster_report.md" \
        && echo ">> report: $RESULTS/cluster_report.md"
    exit $rc
}

export -f env_info gpu_tests skip kernels matmul_peak train_350m mfu mfu_llama_1b mfu_gpt_1b3 mfu_llama_1b_eager \
    resume_case checkpoint_resume torchrun_nccl mfu_table fsdp_offload megatron_load \
    ring_attention document_attention multi_latent_attention zero_bubble memory_snapshot implicit_gpu_tests fp8 \
    compiled_zero1_overlap moe_paths save_paths compiled_paths fp8_paths check_cluster_tune

# The steps of TIER, in steps.tsv's order (name tier limit measured run): core, extended, all.
TIER=${TIER:-$([ -n "$STEPS" ] && echo all || echo core)}  # STEPS: from either tier
case $TIER in core|extended|all) ;; *) echo "FAIL setup: TIER=$TIER (core, extended or all)"; exit 2;; esac
PLAN=$(grep -v '^#' "$HELPERS/steps.tsv" | awk -v t="$TIER" 'NF && (t == "all" || $2 == t)')
# The budget: the tier's limits (4x under SMOKE, as each step's) unless BUDGET_S says.
BUDGET_S=${BUDGET_S:-$(echo "$PLAN" | awk -v f=$([ "$SMOKE" = 1 ] && echo 4 || echo 1) \
    '{s += $3} END {print s * f}')}
echo "megalite GPU check in $REPO$([ "$SMOKE" = 1 ] && echo ' (SMOKE: tiny, on the CPU)')," \
    "tier $TIER, budget ${BUDGET_S}s, results in $RESULTS"
echo "$PLAN" | awk '{n++; lim += $3; if ($4 ~ /^[0-9]+$/) {m++; sec += $4} else if ($4 == "ran") r++
    else never = never " " $1}
    END {printf "plan: %d steps, limits %d s; %d timed on the last GPU run (%d s), %d ran untimed;" \
         " never on a GPU:%s\n", n, lim, m, sec, r, (never == "" ? " none" : never)}' \
    | tee -a "$RESULTS/summary.txt"
printf "# step\tseconds\tverdict\n" >"$RESULTS/step_times.tsv"
while read -r name _tier limit _rest; do
    case $name in
        implicit_gpu_tests) step "$name" "$limit" "$name" 90 ;;  # only if 90 s are left
        mfu_llama_1b_eager) step "$name" "$limit" "$name" 80 ;;
        *) step "$name" "$limit" "$name" ;;
    esac
    if [ "$name" = env_info ] && grep -q "^FAIL env_info" "$RESULTS/summary.txt" \
        && [ "$SMOKE" != 1 ]; then
        echo "no GPU visible to torch: the other steps would run on the CPU; stopping"; exit 1
    fi
done <<<"$PLAN"
echo "---- summary ($(($(date +%s) - T0))s of ${BUDGET_S}s) ----" | tee -a "$RESULTS/summary.txt"
printf "%s\n" "${SUMMARY[@]}" | tee -a "$RESULTS/summary.txt"
! printf '%s\n' "${SUMMARY[@]}" | grep -q '^FAIL'
