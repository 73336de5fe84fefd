"""What no step program of a sharded engine may do: gather a KV pool onto every device (the replicated pool, its
new K/V pinned whole by `pin_heads`, or a split one), or rewrite one from gathered rows."""


def kv_pool_gathers(runner) -> dict:
    """(rows, tokens, full sampler) -> the all-gathers in that compiled step program whose result has a KV page
    pool's leading dimensions (pages x page size, flat or not); only the programs that have any."""
    pages, page_size = runner.num_pages, runner.config.page_size
    pool_shapes = (f"[{pages * page_size},", f"[{pages},{page_size},")
    found = {}
    for key, program in runner._steps.items():
        gathers = [line for line in program.as_text().splitlines() if "all-gather" in line and "=" in line]
        pooled = [g for g in gathers if any(s in g.split("=")[1].split("(")[0] for s in pool_shapes)]
        if pooled:
            found[key] = pooled
    return found
