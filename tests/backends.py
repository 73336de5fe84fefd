"""The backend that tests' engines and their references share: every kernel's jnp reference, and every expert on
every token (the MoE's exact reference), so an engine's numbers can be compared with the model's own forward."""

from inkling_jax import Backend

REFERENCE = Backend.parse("reference,moe=dense")
