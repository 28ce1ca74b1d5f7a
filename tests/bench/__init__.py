"""The benchmarks' code (``benchmarks/``) at tiny sizes: its arithmetic, subjects and scripts."""
