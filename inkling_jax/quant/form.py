"""What the serving module types share: a base class that marks them (training refuses them by it), and how
one is made from a module it replaces."""

from flax import nnx


class ServingForm(nnx.Module):
    """Base of the module types that hold weights the way a server runs them (fused, fp8 or NVFP4): forward
    only. Each holds one weight form; its type says which."""


def take_parts(form: nnx.Module, module: nnx.Module, replaced: tuple[str, ...]) -> None:
    """Give `form` every attribute of `module` (the same submodules, Variables and settings) except those named
    in `replaced`, which `form` holds in its own way. For a module the caller owns (`serving_view` copies the
    model first), so the two never share parts with a model someone else holds."""
    for name, value in vars(module).items():
        if not name.startswith("_") and name not in replaced:
            setattr(form, name, value)
