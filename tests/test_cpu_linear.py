"""Weight-left fp32 linears: the same function as nn.Linear for any number of tokens, the same parameters."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import ARCHS, tiny_model
from speculant.models.cpu_linear import WeightLeftLinear, padded_rows
from speculant.models.quant import Int8DynamicLinear, quantize


def test_padded_rows_are_the_shapes_mkl_serves_well():
    assert [padded_rows(n) for n in (2, 3, 4, 5, 8, 9, 13, 16, 17, 24, 25, 33)] == [2, 4, 4, 8, 8, 16, 16, 16, 24,
                                                                                   24, 32, 40]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (1, 1, 96), (2, 96), (1, 5, 96), (3, 13, 96), (33, 96)])
def test_weight_left_linear_computes_the_linear_layer(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    swapped = WeightLeftLinear(96, 160, bias=bias, device="meta")
    swapped.weight, swapped.bias = linear.weight, linear.bias
    x = torch.randn(*shape)
    y = swapped(x)
    assert y.shape == (*shape[:-1], 160)
    torch.testing.assert_close(y, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_cpu_models_get_weight_left_linears_that_share_their_parameters(arch):
    model = tiny_model(arch, 0)
    linears = [m for m in model.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is WeightLeftLinear for m in linears)
    parameters = list(model.model.parameters())
    assert len({id(p) for p in parameters}) == len(parameters)  # nothing copied, nothing left behind
    if model.model.config.tie_word_embeddings:
        assert model.model.get_output_embeddings().weight is model.model.get_input_embeddings().weight
    quantize(model.model, "int8")  # quantization still finds every linear layer
    assert not any(isinstance(m, nn.Linear) for m in model.model.modules())
    assert any(isinstance(m, Int8DynamicLinear) for m in model.model.modules())
