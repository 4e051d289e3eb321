"""leakbench benchmarks: ``python -m benchmarks [name ...] [--quick]`` prints one table per benchmark."""
