#!/usr/bin/env bash
# The GPU checks of one session, in one call: GPU tests, A/B harnesses, compute-sanitizer,
# benchmarks and the end-to-end report. Each step has its own time limit and log; a summary of exit
# codes ends the output, and the script exits nonzero if any step failed.
#   bash scripts/gpu_checks.sh LOGDIR STEP [STEP...]
# steps: compile tests tests-no-tilelang engine memcheck ab bench sweep decode flashmla tp-heads gather
#        e2e e2e-rank-per-gpu e2e-fp8 e2e-fp32 e2e-nextn e2e-sampled long-context sample e2e-hub
#        step-profile step-profile-compare prefill-compare hf
# A TileLang bundle at .tilelang_bundle/*.tar.xz (scripts/tilelang_bundle.sh) is installed first; the
# built FlashMLA package at .flashmla/flash_mla_sm90_pkg.tar.xz (the peer scripts/bench_flash_mla.py
# measures against) is unpacked and put on the path.
set -uo pipefail
cd "$(dirname "$0")/.."
logdir=$1; shift
mkdir -p "$logdir"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TILELANG_CACHE_DIR=/tmp/tilelang_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH="/usr/local/cuda/bin:$PATH"
# Each install runs once per machine (a marker file), so several gpu_checks.sh may run side by side.
install_once() {  # install_once DIR CMD...: CMD unless DIR holds the marker; then DIR goes first on PYTHONPATH
    local dir=$1; shift
    [ -f "$dir/.installed" ] || { "$@" >>"$logdir/bundle.log" 2>&1 && touch "$dir/.installed"; }
    [ -f "$dir/.installed" ] && export PYTHONPATH="$dir:$PYTHONPATH"
}
bundle=$(ls .tilelang_bundle/*.tar.xz 2>/dev/null | head -1)
[ -n "$bundle" ] && install_once /tmp/tl bash scripts/tilelang_bundle.sh install "$bundle" /tmp/tl
[ -f .flashmla/flash_mla_sm90_pkg.tar.xz ] && install_once /tmp/fmla \
    bash -c 'mkdir -p /tmp/fmla && tar -C /tmp/fmla -xJf .flashmla/flash_mla_sm90_pkg.tar.xz'
# Wheels carried in .wheels_e2e/ (e.g. a newer transformers for the bf16 oracle) shadow the image's.
ls .wheels_e2e/*.whl >/dev/null 2>&1 && install_once /tmp/site \
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels_e2e/*.whl
flaggems=.whl/flaggems/flashmla_sparse.py
summary=()
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "=== $name: $*" | tee -a "$logdir/all.log"
    timeout "$secs" "$@" 2>&1 | tee -a "$logdir/all.log" | tail -40
    local rc=${PIPESTATUS[0]}
    summary+=("$name rc=$rc")
}
for s in "$@"; do
    case $s in
        compile)  # the TileLang kernels, one process each, into TILELANG_CACHE_DIR for the steps after
            step compile 300 bash -c 'for v in "attention.tilelang_sm90 64,512,False" "attention.tilelang_sm90 128,512,False" \
                "attention.tilelang_sm90 64,576,False" "attention.tilelang_sm90 128,576,False" \
                "attention.tilelang_sm90 64,512,True" "attention.tilelang_sm90 128,512,True" \
                "attention.tilelang_sm90 64,576,True" "attention.tilelang_sm90 128,576,True" \
                "attention.tilelang_sm90_paged_fp8 64,\"MODEL1\"" "attention.tilelang_sm90_paged_fp8 128,\"MODEL1\"" \
                "attention.tilelang_sm90_paged_fp8 64,\"V32\"" "attention.tilelang_sm90_paged_fp8 128,\"V32\""; do
                set -- $v; python3 -c "from engine.h20_ops.$1 import compiled_kernel; compiled_kernel($2)" & done
                fail=0; for j in $(jobs -p); do wait $j || fail=1; done; exit $fail' ;;
        # the kernel test files in 6 processes (the image's pytest-xdist): one process takes ~9 minutes
        tests) step tests 560 python3 -m pytest -q -n 6 -p no:cacheprovider tests/test_sparse_mla_ref.py \
                tests/test_dispatcher.py tests/test_flashmla_sparse.py tests/test_sparse_mla_sm90.py \
                tests/test_sparse_mla_sm90_paged_fp8.py tests/test_triton_paged_fp8.py tests/test_decode.py \
                tests/test_prefill.py tests/test_kv_quant.py tests/test_fused_sample.py ;;
        tests-no-tilelang)  # the Triton-backend files with the bundle off the path: the Triton backend on this GPU
            # (what a node without TileLang runs; on an image without TileLang of its own)
            step tests_no_tilelang 300 env PYTHONPATH="$PWD" python3 -m pytest -q -p no:cacheprovider \
                tests/test_dispatcher.py tests/test_flashmla_sparse.py tests/test_triton_paged_fp8.py tests/test_decode.py \
                tests/test_prefill.py tests/test_kv_quant.py tests/test_fused_sample.py ;;
        engine) step engine 400 python3 -m pytest -q -s -p no:cacheprovider tests/test_model_engine.py \
                tests/test_decode_graphs.py -m gpu ;;
        memcheck)
            step memcheck_triton 150 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q \
                -p no:cacheprovider tests/test_flashmla_sparse.py -k "fillers or empty_kv or topk_larger"
            step memcheck_tilelang 150 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q \
                -p no:cacheprovider tests/test_sparse_mla_sm90.py \
                -k "(test_matches_oracle and 100-700 and 128-576) or (several_items and 300-128-576)"
            step memcheck_paged_fp8 150 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q \
                -p no:cacheprovider tests/test_sparse_mla_sm90_paged_fp8.py -k "test_matches_oracle and extras1"
            # engine.h20_ops.flash_mla on both backends: all-invalid rows, fillers, NaN bytes in unselected slots
            step memcheck_flash_mla 200 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q \
                -p no:cacheprovider tests/test_flash_mla.py -m gpu -k "test_gpu_decode_grid and corner and b4 and inv1" ;;
        ab) step ab_vendored 150 python3 scripts/ab_vendored.py --no-bench ;;
        bench) step bench 300 python3 scripts/bench_sparse_mla.py --flaggems-file "$flaggems" ;;
        sweep) step sweep 300 python3 scripts/bench_sparse_mla.py --sweep --shapes v4flash512,v32 --flaggems-file "$flaggems" ;;
        decode) step bench_flash_mla 480 python3 scripts/bench_flash_mla.py ;;  # decode and prefill vs FlashMLA
        flashmla) step flash_mla_tests 480 python3 -m pytest -q -p no:cacheprovider tests/test_flash_mla.py -m gpu ;;
        tp-heads) step bench_tp_heads 540 python3 scripts/bench_tp_heads.py --quick ;;  # h_q 8/16/32 vs padded to 64
        gather) step row_gather 120 bash -c "nvcc -arch=sm_90a -O3 -o /tmp/bench_row_gather scripts/bench_row_gather.cu && /tmp/bench_row_gather" ;;
        e2e) step e2e 400 bash scripts/h20_e2e_report.sh --compare --json "$logdir/e2e.json" ;;
        # one rank per GPU of this machine: the NCCL group (e2e's 8 ranks are that on 8 GPUs only)
        e2e-rank-per-gpu) step e2e_rank_per_gpu 400 bash scripts/h20_e2e_report.sh --compare \
                --ranks "$(python3 -c 'import torch; print(torch.cuda.device_count())')" \
                --json "$logdir/e2e_rank_per_gpu.json" ;;
        e2e-fp8) step e2e_fp8 400 bash scripts/h20_e2e_report.sh --compare --kv-cache fp8 --json "$logdir/e2e_fp8.json" ;;
        # a 65500-token prompt, 64 steps: TileLang and Triton, fp8 and bf16 caches, vs the float32 oracle run
        long-context) step long_context 580 python3 scripts/long_context_check.py --backends tilelang,triton \
                --json "$logdir/long_context.json" ;;
        # float32: the TileLang sparse MLA kernels are bf16-only, so attention is pinned to Triton and the
        # two runs differ in the sampler's backend only (the comparison is then required)
        e2e-fp32) step e2e_fp32 450 env DEEPINFER_SPARSE_MLA_BACKEND=triton bash scripts/h20_e2e_report.sh --dtype float32 \
                --compare --json "$logdir/e2e_fp32.json" ;;
        e2e-nextn) step e2e_nextn 400 env DEEPINFER_USE_NEXTN_DECODE=1 bash scripts/h20_e2e_report.sh --compare \
                --json "$logdir/e2e_nextn.json" ;;
        e2e-sampled) step e2e_sampled 450 env DEEPINFER_SPARSE_MLA_BACKEND=triton DEEPINFER_USE_NEXTN_DECODE=1 \
                bash scripts/h20_e2e_report.sh --compare --temperature 0.8 --top-p 0.9 --seed 1 \
                --json "$logdir/e2e_sampled.json" ;;
        sample) step ab_fused_sample 450 python3 scripts/ab_fused_sample.py ;;
        step-profile) step engine_step_profile 500 python3 scripts/engine_step_profile.py ;;  # eager vs CUDA graphs
        # the same and, eager, the checkout in .compare_tree/ (e.g. `git archive ab6d1b8 engine scripts | tar -x`)
        step-profile-compare) step engine_step_profile_compare 560 python3 scripts/engine_step_profile.py \
                --compare-tree .compare_tree ;;
        # the prefill kernels of this checkout and of .compare_tree/, each through its own bench_sparse_mla.py
        prefill-compare) rest=$(tr ':' '\n' <<<"$PYTHONPATH" | grep -vx "$PWD" | paste -sd:)
            for t in "$PWD" "$PWD/.compare_tree"; do
                step "bench_prefill_$(basename "$t")" 240 env PYTHONPATH="$t:$rest" \
                    python3 "$t/scripts/bench_sparse_mla.py" --shapes v4flash512,v4pro,v32 --flaggems-file none; done ;;
        # the transformers integration (needs transformers 5.21.1 + kernels 0.17.2: wheels in .wheels_e2e/)
        hf) step hf_integration_bench 500 python3 scripts/hf_integration_bench.py --json "$logdir/hf.json" ;;
        # the report with the hub kernel source: this checkout's kernels built as a kernel repository, put
        # into an offline cache with a lock, verified and loaded by every rank under HF_HUB_OFFLINE=1
        # (needs kernels 0.17.2 and transformers 5.18-5.21.x: their wheels in .wheels_e2e/ on an older image)
        e2e-hub) step e2e_hub 500 bash -c 'set -e; d=/tmp/kernel_hub; rm -rf "$d"
                python3 scripts/build_kernel_repo.py "$d/repo"
                python3 scripts/kernel_offline_cache.py "$d/repo" --lock "$d/kernels.lock" --cache "$d/cache"
                HF_HUB_OFFLINE=1 KERNELS_CACHE="$d/cache" DEEPINFER_KERNEL_SOURCE=hub DEEPINFER_OPS_STRICT=1 \
                DEEPINFER_KERNEL_REPO=deepinfer/sparse-mla@v1 DEEPINFER_KERNEL_LOCK="$d/kernels.lock" \
                bash scripts/h20_e2e_report.sh --compare --json "$0/e2e_hub.json"' "$logdir" ;;
        *) echo "unknown step $s" >&2; exit 2 ;;
    esac
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$logdir/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$logdir/gpu.txt" 2>&1
printf '%s\n' "${summary[@]}" | tee "$logdir/summary.txt"
! grep -qv "rc=0$" "$logdir/summary.txt"
