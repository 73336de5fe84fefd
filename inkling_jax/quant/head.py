"""The model as a server runs it with its LM head in fp8."""

from __future__ import annotations

from inkling_jax.nn.model import InklingModel
from inkling_jax.quant import dense_fp8
from inkling_jax.quant.form import ServingForm, take_parts


class Fp8HeadModel(ServingForm, InklingModel):
    """`InklingModel` whose LM head is `head`, an `Fp8Linear` [vocab, hidden] (the largest matrix a decode step
    reads), in place of `unembed`."""

    def __init__(self, model: InklingModel, head: dense_fp8.Fp8Linear):
        take_parts(self, model, replaced=("unembed", "head"))
        self.head = head

    @classmethod
    def quantize(cls, model: InklingModel) -> Fp8HeadModel:
        if isinstance(model, cls):
            return model
        return cls(model, dense_fp8.Fp8Linear(*dense_fp8.quantize(model.unembed[...])))

    def _head(self, x):
        return self.head(x)
