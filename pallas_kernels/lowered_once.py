"""Mosaic GPU kernels lowered for CUDA once per process, not once per program that holds them.

Jitting a kernel's entry makes it one function per shape within a program, but every program that holds it lowers
it again, and Mosaic GPU's lowering (its layout inference above all) takes 0.5-1 s of Python per kernel: a
server's warm-up builds tens of programs (decode steps of several row counts, prefill chunks, mixed steps) whose
MoE and W4A16 kernels are mostly the same few. `lowered_once` wraps a kernel launcher so that, compiled, its first
call at a given key exports it (`jax.export`: the lowered StableHLO with the kernel's custom call) and every call
at that key, in any later program, calls the export, which is merged into that program's module as lowered.

The key is what `jax.jit` would key the launcher on with every non-array argument static: the argument tree, the
arrays' shapes and dtypes, and the other leaves by value (functions by identity, `functools.partial` by its
function and arguments). A launcher must therefore be a function of that alone, as a jitted one must be.
Interpreted kernels, launchers called with unhashable static leaves and in-kernel profiling (which writes files
at each call) take the launcher directly.
"""

import functools
import threading

import jax
import numpy as np
from jax import export

from pallas_kernels import mgpu

# The Mosaic GPU custom call is among jax.export's stable targets; named so that a jax that drops it from that
# list still exports (the export lives only as long as this process, so its serialised form need not be stable).
_CHECKS = (export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),)


def _static_key(leaf):
    """A hashable stand-in for a non-array leaf, equal only for leaves that make the same kernel."""
    if isinstance(leaf, functools.partial):
        return ("partial", _static_key(leaf.func), tuple(_static_key(a) for a in leaf.args),
                tuple(sorted((name, _static_key(v)) for name, v in leaf.keywords.items())))
    hash(leaf)  # TypeError for an unhashable leaf
    return type(leaf), leaf


class LoweredOnce:
    """`launch(*args, interpret=..., **kwargs)` with its compiled form exported once per key (module doc)."""

    def __init__(self, launch):
        self.launch = launch
        self.exports: dict = {}
        self._lock = threading.Lock()
        functools.update_wrapper(self, launch)

    def __call__(self, *args, interpret: bool, **kwargs):
        if interpret or mgpu.profile_dir():
            return self.launch(*args, interpret=interpret, **kwargs)
        leaves, tree = jax.tree.flatten((args, kwargs))
        is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]
        try:
            statics = tuple(None if array else _static_key(leaf) for leaf, array in zip(leaves, is_array))
        except TypeError:
            return self.launch(*args, interpret=interpret, **kwargs)
        arrays = [leaf for leaf, array in zip(leaves, is_array) if array]
        specs = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype, weak_type=getattr(jax.typeof(a), "weak_type", False))
                      for a in arrays)
        key = (tree, statics, tuple((s.shape, s.dtype, s.weak_type) for s in specs))
        with self._lock:
            exported = self.exports.get(key)
            if exported is None:
                exported = self.exports[key] = self._export(leaves, is_array, tree, specs)
        return exported.call(*arrays)

    def _export(self, leaves, is_array, tree, specs):
        def on_arrays(*arrays):
            it = iter(arrays)
            args, kwargs = jax.tree.unflatten(tree, [next(it) if array else leaf
                                                     for leaf, array in zip(leaves, is_array)])
            return self.launch(*args, interpret=False, **kwargs)
        return export.export(jax.jit(on_arrays), platforms=("cuda",), disabled_checks=_CHECKS)(*specs)


def lowered_once(launch) -> LoweredOnce:
    """Decorates a Mosaic GPU kernel launcher taking `interpret` as a keyword (module doc)."""
    return LoweredOnce(launch)
