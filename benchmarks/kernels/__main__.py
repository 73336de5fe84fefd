from benchmarks.kernels.table import main

main()
