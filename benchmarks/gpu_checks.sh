#!/usr/bin/env bash
# The GPU checks, as one command for a machine lent for a few minutes (about 8 minutes on
# an H200; docs/results.md, "Cost of a step", says what the numbers are compared with):
#
#   bash benchmarks/gpu_checks.sh [OUT]             # OUT: where the results go (default gpu-out)
#   PARTS="machine cuda-tests step-cost" bash benchmarks/gpu_checks.sh OUT   # some parts only
#
# The parts' limits add up to more than one 10-minute call. Where a lease is short, in this
# order (each line one call, its limits under 10 minutes):
#   PARTS="machine cuda-tests step-cost"
#   PARTS="step-compiled-default step-async step-details"
#   PARTS="step-compiled-reduce-overhead train-asynchronous-false train-asynchronous-true"
#
# bigbatch is imported from src (no install). A machine without network takes wheels from
# WHEELS (a folder made here with `pip download mnist1d -d WHEELS --no-deps`), so the
# tests that build MNIST-1D import. Each part has its own time limit and the script goes
# on past a failed one; every part's output is in OUT.
set -uo pipefail
out=${1:-gpu-out}
mkdir -p "$out"
: >"$out/parts.txt"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${WHEELS:-}" ]; then
    python -m pip install -q --no-index --no-deps --find-links "$WHEELS" mnist1d >"$out/wheels.txt" 2>&1
fi

part() {  # part NAME SECONDS COMMAND...: run it with a limit, its output in OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then return; fi
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$out/parts.txt"
}

part machine 30 python -c "import torch, sys; print(sys.version); print(torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
# the CUDA-only tests (skipped on a CPU machine)
part cuda-tests 200 python -m pytest -q -p no:cacheprovider -m cuda tests
# a step's time against a plain step, per-step medians and steady blocks (issue: step cost)
part step-cost 180 python benchmarks/step_cost.py --device "${DEVICE:-cuda}" \
    --models text-gpu,gpt2 --batches "${BATCHES:-16,64,256,1024}" \
    --gpt2-batches "${GPT2_BATCHES:-16,64}" --steps 15 --steady 10 --arms plain,examples,off \
    --every auto
# where the host waits: synchronisations per step and the statistics' buffers
part step-details 90 python benchmarks/step_cost.py --device "${DEVICE:-cuda}" \
    --models text-gpu --batches "${DETAIL_BATCHES:-16,256}" --steps 5 \
    --arms examples,off,examples-fused,async --details
# the asynchronous step (each step's numbers read at the next) against the same step read
# at once and a plain step, all with torch's fused AdamW (it skips a step on the device)
part step-async 100 python benchmarks/step_cost.py --device "${DEVICE:-cuda}" \
    --models text-gpu,gpt2 --batches "${ASYNC_BATCHES:-16,64,256}" \
    --gpt2-batches 16 --steps 15 --steady 10 \
    --arms plain-fused,examples-fused,async
# bigbatch train end to end, each step read at once and at the next step (AdamW, fused in
# both), on the text task at GPU scale: samples per second of the whole run
for asynchronous in false true; do
    part "train-asynchronous-$asynchronous" 100 python benchmarks/step_cost.py --part throughput \
        --device "${DEVICE:-cuda}" --task text --train-samples 30000 --set optimizer=adamw --set optimizer_impl=fused \
        --set asynchronous=$asynchronous --set model.width=256 --set model.depth=4 \
        --set model.context=256
done
# torch.compile of every arm's model (the measured layers traced with it), and in the
# reduce-overhead mode (CUDA graphs as well; one micro-batch a step, so that no output is
# kept past the next replay): a compiled bigbatch step against a compiled plain one (each
# arm compiles first: the limit allows for it)
for mode in default reduce-overhead; do
    part "step-compiled-$mode" 240 python benchmarks/step_cost.py --device "${DEVICE:-cuda}" \
        --compile --compile-mode "$mode" --models text-gpu --batches "${COMPILE_BATCHES:-16,64,256}" \
        --steps 15 --steady 10 --arms plain,examples,off
done
cat "$out/parts.txt"
