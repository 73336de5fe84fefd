"""Serving Inkling: `python -m serve.app` (the OpenAI-compatible server) and `serve.offline.generate` (the same
engine without HTTP).

A request goes down and its tokens come back up three packages: `http` turns a request into prompt ids and
`SamplingParams`, and the engine's outputs into its response; `engine` schedules the sequences over cache slots
and pages and applies each step's `Sample`s; `runner` runs the scheduled steps on the device.
"""
