"""What to run on a lent GPU: ``bench/gpu/check.sh`` (overlapkit's CUDA paths, PASS/FAIL per item,
``bench.gpu.check``) and ``bench/gpu/overlap.sh`` (the overlap benchmarks on two NCCL ranks
sharing the GPU under CUDA MPS)."""
