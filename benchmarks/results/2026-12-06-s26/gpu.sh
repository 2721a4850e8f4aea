#!/bin/bash
# Session 26's device calls: bash benchmarks/results/2026-12-06-s26/gpu.sh a|b|c
#  a: what the certified mode's scan launches cost where every row certifies (probe_launch.py, std 0.01), then
#     the shipped certified mode at std 0.02 (93-97% of rows certify: exact.Auto's min_blocks);
#  b: the one-launch scan's loop split (SCANKEEP, dispatch.CERTIFIED_SCAN_KEEP) where pruning fails (std 0.06);
#  c: the counted pick (dispatch.CERTIFIED_COUNTED_PICK) at N = 1, 4 where every row certifies and where pruning
#     fails, then the changed kernels' and modes' tests compiled (XPRESS_SLOW=1).
# Session 25 measured a (std 0.02) and b on an H100; its raw files were lost with that try: these are the reruns.
export PYTHONPATH=$PWD
S24=benchmarks/results/2026-12-06-s24
S26=benchmarks/results/2026-12-06-s26
T0=$SECONDS
left() { echo $((${CAP:-585} - (SECONDS - T0))); }  # CAP: seconds this call may take
nvidia-smi --query-gpu=name --format=csv,noheader
case "$1" in
  a) timeout 330 python3 $S26/probe_launch.py $OUT/launch_std0.01.jsonl 1,4,16,64 0.01 2>&1 | grep -v -i warn | tail -5
     echo "launch took $((SECONDS - T0)) s"
     timeout $(left) python3 $S24/probe_cert.py $OUT/cert_std0.02.jsonl 1,4,16 0.02 2>&1 | grep -v -i warn | tail -4
     echo "a took $((SECONDS - T0)) s" ;;
  b) SCANKEEP=1 timeout $(left) python3 $S24/probe_cert.py $OUT/cert_scankeep_std0.06.jsonl 16,64 0.06 2>&1 \
       | grep -v -i warn | tail -4
     echo "b took $((SECONDS - T0)) s" ;;
  c) COUNTED=1 timeout 100 python3 $S26/probe_launch.py $OUT/counted.jsonl 1,4 0.01 2>&1 | grep -v -i warn | tail -2
     COUNTED=1 timeout 60 python3 $S26/probe_launch.py $OUT/counted_std0.06.jsonl 1 0.06 2>&1 | grep -v -i warn | tail -1
     echo "counted took $((SECONDS - T0)) s"
     XPRESS_SLOW=1 timeout $(left) python3 -m pytest -q -n 8 -k "not Interpret and (${TESTS:-counted or one_pick or compiled or active})" -p no:cacheprovider \
       tests/test_kernel_full_vocab.py tests/test_certified.py > $OUT/gpu_tests_c.log 2>&1
     tail -2 $OUT/gpu_tests_c.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_c.log | head -20 ;;
  *) echo "usage: gpu.sh a|b|c" >&2; exit 2 ;;
esac
