"""Quantised serving weights: fp8 dense matrices (dense_fp8.py) and NVFP4 ones (dense_nvfp4.py)."""
