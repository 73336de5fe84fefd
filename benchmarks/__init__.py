"""The benchmarks users run: one module per area, each `python -m benchmarks.<name> --help`.

model, serving, training, kernels, moe and conversion measure; timing holds what they share (the timer, the
ceilings measured in the same run, the stamp of date, device and versions). docs/performance.md holds the
current figures and the command of each."""
