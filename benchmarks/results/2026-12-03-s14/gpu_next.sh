#!/bin/bash
# Prepared in session 14 for the next device session (not run yet): the two prepared probes, then the test
# files this session did not run compiled. Each part fits one device call (~5-9 minutes); run as
#   bash benchmarks/results/2026-12-03-s14/gpu_next.sh select|xla|tests
export PYTHONPATH=$PWD
R=benchmarks/results/2026-12-03-s14
case "$1" in
  select) timeout 560 python3 $R/probe_select_configs.py $OUT/select_configs.jsonl 1,16,64,256 2>&1 | grep -v -i warn | tail -70 ;;
  xla) timeout 560 python3 $R/probe_xla_options.py $OUT/xla_options.jsonl 2>&1 | grep -v -i warn | tail -30 ;;
  tests) timeout 560 python3 -m pytest -q -n 8 tests/test_pruned.py tests/test_kernel_full_vocab.py \
           tests/test_kernel_select.py tests/test_kernel_latent.py tests/test_head.py tests/test_rounding.py \
           tests/test_module.py tests/test_parity_torch.py tests/test_errors.py > $OUT/gpu_tests_c.log 2>&1
         tail -3 $OUT/gpu_tests_c.log ;;
  *) echo "usage: gpu_next.sh select|xla|tests" >&2; exit 2 ;;
esac
