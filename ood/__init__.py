"""Out-of-distribution benches, each its own command: BFCL V4 memory and web search
(`python -m ood.memory`), τ²-bench (`python -m ood.tau`); docs/ood.md."""
