"""Benchmarks: measurements, not tests. Each reports ratios measured side by side in one run and names the CPU."""
