"""`inkling-bench-serving`: a load generator for any OpenAI-compatible server, with the flags and metric names of
vLLM's serving benchmark, so that its figures compare with those users measure against vLLM or SGLang.

`datasets` builds the prompts, `arrivals` when each is sent, `client` streams one request and times its chunks,
`report` turns the timings into the metrics, `cli` is the command.
"""
