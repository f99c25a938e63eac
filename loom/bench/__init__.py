"""Benchmarks: roofline analysis, datasets, latency, throughput and serving benches (`loom bench`, `loom analyze`)."""
