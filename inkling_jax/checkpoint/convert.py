"""inkling-convert: hub safetensors (BF16 or NVFP4) -> an orbax checkpoint that restores onto a device mesh,
and back (`--to hf`).

    python -m inkling_jax.checkpoint.convert --src HF_DIR --dst OUT_DIR [--dtype bfloat16|float32] \
        [--mesh fsdp=8,tensor=8]
    python -m inkling_jax.checkpoint.convert --src OUT_DIR --dst HF_DIR --to hf
    model = inkling_jax.load_pretrained(OUT_DIR, mesh=inkling_jax.parallel.mesh.make_mesh("fsdp=8,tensor=8"))

The output holds exactly the model's parameter tree (orbax, one zarr array per parameter, chunked by the
shards of --mesh), config.json, the tokenizer and other side files, and a manifest (inkling-convert.json:
source file sha256s, dtype, tree with checksums, mesh). Tensors stream through in slabs with several reads in
flight; host memory stays near twice the slab budget (2 slabs per worker; freed slabs are reused) whatever the
checkpoint's size or its largest tensor. The output is built in a hidden sibling directory, synced, and
renamed into place at the end only if --dst still does not exist (`destination.taken`): a failed or interrupted
run leaves nothing that looks like a checkpoint, and deletes nothing it did not write. --overwrite replaces only
an earlier output of this tool. Errors are one line naming the file and the tensor; exit code 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from inkling_jax.checkpoint import orbax_io, to_hub, to_orbax
from inkling_jax.checkpoint.destination import taken
from inkling_jax.checkpoint.safetensors_io import CheckpointError
from inkling_jax.checkpoint.to_orbax import ConversionError, Tuning, one_line
from inkling_jax.checkpoint.verify import verify_hub, verify_orbax
from inkling_jax.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inkling-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True,
                        help="source directory: a hub checkpoint (*.safetensors, index, config.json) for --to orbax, "
                             "a directory this tool wrote for --to hf")
    parser.add_argument("--dst", required=True,
                        help="output directory: must not exist, unless --overwrite; neither inside --src nor "
                             "containing it")
    parser.add_argument("--to", choices=["orbax", "hf"], default="orbax",
                        help="orbax (default): hub -> orbax checkpoint; hf: converted directory -> hub layout "
                             "(interleaved gate/up, original names, index)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="dtype of the written weights (ShortConv taps and router bias/scale stay float32). "
                             "Default: the source's (NVFP4 experts dequantise to it); with --to hf, the original "
                             "files' dtypes")
    parser.add_argument("--mesh", default=None,
                        help="the mesh the checkpoint will be restored on, e.g. fsdp=8,tensor=8,expert=8 (axes: "
                             "data, fsdp, tensor, expert): chunks follow its shards so each process reads only what "
                             "its devices hold. Default: no sharding (chunks of at most 32 MB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --dst that is an earlier output of this tool holding nothing "
                             "else (only once done)")
    parser.add_argument("--verify", action="store_true",
                        help="before the output is moved into place, read it back: tensor counts, shapes and "
                             "checksums always; logits of source and output on a few tokens when two copies of "
                             "the model fit in host memory; with --to hf, file sha256s against the source's")
    parser.add_argument("--workers", type=int, default=Tuning.workers,
                        help="conversion threads (default: the CPU count, at least 4 and at most 16: %(default)s)")
    parser.add_argument("--readers", type=int, default=Tuning.readers,
                        help="source files read at once (default %(default)s)")
    parser.add_argument("--slab-mb", type=float, default=Tuning.slab_bytes / 2**20,
                        help="host memory per slab in flight; at most about (2 x workers + readers) slabs are "
                             "held at once (default %(default)s)")
    parser.add_argument("--chunk-mb", type=float, default=Tuning.chunk_bytes / 2**20,
                        help="largest zarr chunk written, after splitting by the --mesh shards (default %(default)s)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="--to hf: shard size when the original layout cannot be kept (default %(default)s)")
    parser.add_argument("--reads", choices=["auto", "direct", "buffered"], default="auto",
                        help="read the source with O_DIRECT (less CPU) or through the page cache (faster on "
                             "some disks); auto: direct on hosts of at most 4 CPUs (default %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> list[str]:
    """Convert as `args` says; returns the report lines. Raises on any error, leaving no output behind."""
    src, dst = os.path.abspath(args.src), os.path.abspath(args.dst)
    if args.to == "hf" and not orbax_io.is_converted(src):
        raise CheckpointError(f"{src}: not a directory this tool wrote (no {orbax_io.MANIFEST}); --to hf reads those")
    if args.to == "orbax" and orbax_io.is_converted(src):
        raise CheckpointError(f"{src}: already converted (it has {orbax_io.MANIFEST}); use --to hf to export it")
    direct_reads = {"auto": Tuning.direct_reads, "direct": True, "buffered": False}[args.reads]
    tuning = Tuning.sized(workers=args.workers, readers=args.readers, slab_bytes=int(args.slab_mb * 2**20),
                          chunk_bytes=int(args.chunk_mb * 2**20), direct_reads=direct_reads)
    start = time.perf_counter()
    with taken(dst, src=src, overwrite=args.overwrite, marker={"direction": args.to}) as work:
        lines = (_to_orbax if args.to == "orbax" else _to_hf)(src, work, args, tuning)
    return lines + [f"wrote {dst} in {time.perf_counter() - start:.1f} s"]


def _to_orbax(src: str, tmp: str, args, tuning: Tuning) -> list[str]:
    manifest = to_orbax.convert(src, tmp, dtype=args.dtype, mesh=args.mesh, tuning=tuning, progress=not args.quiet)
    source = manifest["source"]
    lines = [f"{manifest['num_params']} parameters in {manifest['dtype']} from {len(source['files'])} files"
             + (" (NVFP4 experts dequantised)" if source["quantization"] else "")]
    if source["skipped_tensors"]:
        lines.append(f"skipped {len(source['skipped_tensors'])} tensors the model does not use, e.g. "
                     f"{source['skipped_tensors'][0]}")
    return lines + (verify_orbax(tmp, src) if args.verify else [])


def _to_hf(src: str, tmp: str, args, tuning: Tuning) -> list[str]:
    summary = to_hub.export(src, tmp, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 1e9),
                            tuning=tuning, progress=not args.quiet)
    lines = [f"{len(summary['crc32'])} tensors in {len(summary['files'])} files"
             + (" (the source's own layout)" if summary["exact"] else "")]
    return lines + (verify_hub(tmp, src, summary) if args.verify else [])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lines = run(args)
    except (CheckpointError, ConfigError, ConversionError, OSError, ValueError) as e:
        print(f"inkling-convert: error: {one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - anything else (a library's error) still gets one line
        print(f"inkling-convert: error: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
