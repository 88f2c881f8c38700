"""Starting beamsplit servers as processes on this host (the demo, the tests, the benchmarks)."""
