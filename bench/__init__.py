"""Benchmarks of ledgerbox: every performance claim measured side by side in one run."""
