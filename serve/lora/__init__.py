"""Multi-LoRA serving: adapters read strictly (`adapters`), held in device slots and added per row of a step
(`linear`, `view`)."""
