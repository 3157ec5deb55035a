"""Out-of-distribution benches of evaluate.py --suite: BFCL V4 memory and web search (memory.py),
τ²-bench (tau.py). Each is one evaluate(args, error) that evaluate.py calls."""
