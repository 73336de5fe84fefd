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
at each call) take the launcher directly. The export is made as the launcher is traced, not when the program is
lowered: tracing a compiled kernel (`jax.make_jaxpr`, `jax.eval_shape`) lowers it, and so does a program that
later drops the kernel's result.

With jax's persistent compilation cache on (`jax_compilation_cache_dir`, the server's `--compilation-cache`), the
exports are kept there too (`mosaic-exports/`), so that the next process skips the lowering as it skips XLA's
compiles. On disk the key is text: the launcher's name, the argument tree, the static leaves written out (numbers,
strings, dtypes, enums, frozen dataclasses field by field, tuples, partials, and by name the module-level functions
of this package, jax and numpy), the shapes, and what else a kernel is built from: the sources of `pallas_kernels`,
jax's version and the GPU (its SM count). A call whose static leaves cannot be written so (a closure, say) keeps
its export in memory only.
"""

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import pathlib
import tempfile
import threading

import jax
import jaxlib
import numpy as np
from jax import export

from pallas_kernels import mgpu

log = logging.getLogger(__name__)
DISK_FOLDER = "mosaic-exports"

# The Mosaic GPU custom call is among jax.export's stable targets; named so that a jax that drops it from that
# list still exports (an export is read back only by the same jax version: its key on disk holds the version).
_CHECKS = (export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),)


def _static_key(leaf):
    """A hashable stand-in for a non-array leaf, equal only for leaves that make the same kernel."""
    if isinstance(leaf, functools.partial):
        return ("partial", _static_key(leaf.func), tuple(_static_key(a) for a in leaf.args),
                tuple(sorted((name, _static_key(v)) for name, v in leaf.keywords.items())))
    hash(leaf)  # TypeError for an unhashable leaf
    return type(leaf), leaf


class _NotWritable(Exception):
    pass


def _text(leaf) -> str:
    """A static leaf written out in full (raises _NotWritable where that is not sure)."""
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return f"{type(leaf).__name__}:{leaf!r}"
    if isinstance(leaf, enum.Enum):
        return f"{_name(type(leaf))}.{leaf.name}"
    if isinstance(leaf, (np.dtype, type)):
        try:
            dtype = np.dtype(leaf)
        except TypeError:
            raise _NotWritable(leaf) from None
        if dtype.kind == "O":  # any other class reads as numpy's object dtype
            raise _NotWritable(leaf)
        return f"dtype:{dtype.name}"
    if isinstance(leaf, functools.partial):
        keywords = ",".join(f"{k}={_text(v)}" for k, v in sorted(leaf.keywords.items()))
        return f"partial({_text(leaf.func)};{','.join(map(_text, leaf.args))};{keywords})"
    if isinstance(leaf, tuple):
        return "(" + ",".join(map(_text, leaf)) + ")"
    if dataclasses.is_dataclass(leaf) and type(leaf).__dataclass_params__.frozen:
        fields = ",".join(f"{f.name}={_text(getattr(leaf, f.name))}" for f in dataclasses.fields(leaf))
        return f"{_name(type(leaf))}({fields})"
    if callable(leaf) and getattr(leaf, "__module__", "").split(".")[0] in _VERSIONED_CODE:
        return f"fn:{_name(leaf)}"
    raise _NotWritable(leaf)


# A function passed to a launcher is named on disk only from code the key versions: this package (its sources are
# hashed), jax and numpy (their versions).
_VERSIONED_CODE = ("pallas_kernels", "jax", "numpy")


def _name(obj) -> str:
    qualname = getattr(obj, "__qualname__", "<unnamed>")
    if "<" in qualname:  # a closure or a lambda: its name does not say what it computes
        raise _NotWritable(obj)
    return f"{obj.__module__}.{qualname}"


@functools.cache
def _built_from() -> str:
    """What a kernel is made of besides its launcher's arguments: jax, the GPU and this package's sources."""
    digest = hashlib.sha256()
    device = jax.devices()[0]
    digest.update(f"jax {jax.__version__} jaxlib {jaxlib.__version__} {device.device_kind} "
                  f"sms {mgpu.num_sms(False)}".encode())
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_root() -> str | None:
    """jax's persistent compilation cache folder, if one is set."""
    return jax.config.jax_compilation_cache_dir


def _disk_path(launch, tree, leaves, is_array, specs) -> pathlib.Path | None:
    """Where the export of this call is kept across processes; None without a compilation cache or where the
    call's static leaves cannot be written out."""
    root = cache_root()
    if not root:
        return None
    try:
        statics = [_text(leaf) for leaf, array in zip(leaves, is_array) if not array]
    except _NotWritable:
        return None
    shapes = [f"{s.shape}:{np.dtype(s.dtype).name}:{s.weak_type}" for s in specs]
    key = "\n".join([_built_from(), _name(launch), str(tree), *statics, *shapes])
    return pathlib.Path(root) / DISK_FOLDER / f"{launch.__name__}-{hashlib.sha256(key.encode()).hexdigest()[:40]}"


def _load(path: pathlib.Path):
    try:
        return export.deserialize(bytearray(path.read_bytes()))
    except FileNotFoundError:
        return None
    except Exception as err:  # a torn or foreign file: lowered again and rewritten
        log.warning("kernel export %s unreadable (%s): lowering the kernel again", path, err)
        return None


def _store(path: pathlib.Path, exported) -> None:
    """Written whole or not at all (a temporary file renamed over the name); a cache that cannot be written is
    only a slower next start."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}", delete=False) as tmp:
            tmp.write(exported.serialize())
        os.replace(tmp.name, path)
    except (OSError, ImportError) as err:  # ImportError: jax.export's serialisation needs flatbuffers
        log.warning("kernel export %s not written: %s", path, err)
        if tmp is not None and os.path.exists(tmp.name):
            os.remove(tmp.name)


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
        specs = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype,
                                           weak_type=getattr(jax.typeof(a), "weak_type", False)) for a in arrays)
        key = (tree, statics, tuple((s.shape, s.dtype, s.weak_type) for s in specs))
        with self._lock:
            exported = self.exports.get(key)
            if exported is None:
                path = _disk_path(self.launch, tree, leaves, is_array, specs)
                exported = path and _load(path)
                if exported is None:
                    exported = self._export(leaves, is_array, tree, specs)
                    if path:
                        _store(path, exported)
                self.exports[key] = exported
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
