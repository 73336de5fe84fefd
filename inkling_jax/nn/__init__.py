"""The model as modules: `InklingModel` (model.py) built from decoder layers (decoder.py) of attention
(attention.py), the dense MLP (mlp.py) or the MoE (moe.py, moe_dispatch.py), ShortConv and norms (layers.py); the
media towers (towers.py), the MTP head (mtp.py), the decode cache (cache.py), and the calls into the kernels
(kernels.py), with the batch-invariant arithmetic and attention they run under `Backend.batch_invariant`
(invariant.py, invariant_attention.py)."""
