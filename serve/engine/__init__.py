"""The engine: a thread that admits requests, schedules their sequences over cache slots and pages (continuous
batching with a prefix cache), and applies the sampled tokens."""
