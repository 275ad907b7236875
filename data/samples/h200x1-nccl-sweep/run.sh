#!/bin/bash
# Build nccl-tests 2.19.6 against the NCCL of the machine's nvidia-nccl-cu13 package, then run the Phase 5 sweep on its
# one GPU with servelab.measure.nccl_tests; $OUT is the folder the results were copied back from.
cd "$(dirname "$0")"
D=$PWD
export NCCL_NVLS_ENABLE=0        # NVLink multicast off, as the host's operator requires
{
  echo "### date -u"; date -u
  echo "### nvidia-smi"; nvidia-smi
  echo "### nvidia-smi topo -m"; nvidia-smi topo -m
  echo "### nvidia-smi -q (clocks)"; nvidia-smi -q -d CLOCK | head -40
  echo "### nvcc"; which nvcc; nvcc --version
  echo "### python3"; which python3; python3 -V
  echo "### pip show nvidia-nccl-cu13"; python3 -m pip show nvidia-nccl-cu13 2>&1 | head -3
  echo "### ldconfig -p | grep nccl"; ldconfig -p | grep -i nccl
  echo "### uname -a; nproc"; uname -a; nproc
} > "$OUT/env.txt" 2>&1
NCCL_PKG=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null)
if [ ! -f "$NCCL_PKG/include/nccl.h" ]; then
  H=$(find / -xdev -name nccl.h -path '*nccl/include/nccl.h' 2>/dev/null | head -1)
  NCCL_PKG=$(dirname "$(dirname "$H")")
fi
CUDA_HOME=/usr/local/cuda
[ -x "$CUDA_HOME/bin/nvcc" ] || CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(which nvcc)")")")
echo "NCCL_PKG=$NCCL_PKG CUDA_HOME=$CUDA_HOME" | tee -a "$OUT/env.txt"
ls "$NCCL_PKG/lib" >> "$OUT/env.txt" 2>&1
mkdir -p /tmp/nh/lib && ln -sfn "$NCCL_PKG/include" /tmp/nh/include && ln -sf "$NCCL_PKG/lib/libnccl.so.2" /tmp/nh/lib/libnccl.so
B=$D/build
T0=$(date +%s)
( cd nccl-tests && make -C src -j16 BUILDDIR="$B" NCCL_HOME=/tmp/nh CUDA_HOME="$CUDA_HOME" \
    NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" \
    "$B/all_reduce_perf" "$B/all_gather_perf" "$B/reduce_scatter_perf" "$B/alltoall_perf" "$B/sendrecv_perf" ) \
  > "$OUT/build.log" 2>&1
RC=$?
echo "build exit $RC in $(( $(date +%s) - T0 )) s" | tee -a "$OUT/build.log"
if [ $RC -ne 0 ]; then tail -40 "$OUT/build.log"; exit 1; fi
export LD_LIBRARY_PATH="$NCCL_PKG/lib:$LD_LIBRARY_PATH"
export PYTHONPATH="$D/lib"
T0=$(date +%s)
timeout 270 python3 -m servelab.measure.nccl_tests --bin-dir "$B" -g 1 --out /tmp/sweep --repeats 2 \
  --collectives all_reduce,all_gather,reduce_scatter,alltoall,sendrecv --sweep-collectives all_reduce,sendrecv \
  --sweep NCCL_ALGO=Ring,Tree --sweep NCCL_PROTO=Simple,LL128 --timeout 60 > "$OUT/runner.log" 2>&1
echo "runner exit $? in $(( $(date +%s) - T0 )) s" | tee -a "$OUT/runner.log"
tail -5 "$OUT/runner.log"
if [ ! -s /tmp/sweep/runs.jsonl ]; then      # the runner could not start: the baseline as a plain loop
  mkdir -p /tmp/sweep/fallback
  for c in all_reduce all_gather reduce_scatter alltoall sendrecv; do
    timeout 60 "$B/${c}_perf" -b 8K -e 64M -f 2 -g 1 > "/tmp/sweep/fallback/$c.log" 2>&1
  done
fi
tar czf "$OUT/sweep.tgz" -C /tmp sweep
ls -la "$OUT"
