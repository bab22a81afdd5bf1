"""nbdist benchmarks: dispatch latency, training throughput and cold start against baselines.

Run all three with ``python -m benchmarks`` (or ``benchmarks/run_all.sh``); see README.md.
"""
