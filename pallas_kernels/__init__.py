"""Pallas kernels, one folder per kernel (kernel, jnp reference, tuned sizes, tests).

Every public entry is a `jax.jit` with its launch settings static: a program that calls a kernel at every layer
then traces and lowers it once per shape, not once per call (Mosaic GPU lowers every call of a kernel apart).
"""
