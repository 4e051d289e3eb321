"""Peer benchmarks: other libraries run next to leakbench on the same model and images (see bench_peers)."""
