"""Multi-LoRA serving: adapters read strictly (`adapters`), held in device slots, host memory and on disk (`slots`),
and added per row of a step (`linear` for dense projections, `experts` for the MoE's experts, `view`)."""
