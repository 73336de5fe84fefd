"""Checkpoints: the strict safetensors reader and writer (safetensors_io.py), the hub layout and loading
(loading.py, hub_source.py, slabs.py; serving_load.py: quantising as the weights arrive), the NVFP4 release
format (nvfp4.py), the converted orbax directory (orbax_io.py, and chunks.py: its chunk files and their
checksums), the `inkling-convert` CLI (convert.py, to_orbax.py, to_hub.py, verify.py, streaming.py), and
destination.py: how every writer takes its output directory."""
