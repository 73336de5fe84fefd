"""Sharding: meshes (mesh.py), the one table of logical-axis rules (rules.py), placing a model on a mesh
(placement.py), the vocabulary-split embedding lookup (vocab.py), kernels run per device (kernel_sharding.py) and
the MoE over a mesh (expert_parallel.py)."""
