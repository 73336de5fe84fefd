"""The kernel benchmarks: `python -m benchmarks.kernels` prints the kernels' targets in one table (`table`); the
cases it measures are in `attention`, `decode` and `shortconv`."""
