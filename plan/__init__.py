"""Memory plans: what a model takes on each device of a mesh, serving or training, from shapes alone
(`python -m plan`, docs/scale.md)."""
