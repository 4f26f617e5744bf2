"""fp32 linear layers for multi-token forwards on CPU: y = x W^T + b computed as (W x^T)^T + b.

Speculative verification runs the target on a few tokens (2 to 32) at once. For that shape torch's
`F.linear` calls an MKL GEMM that, on this 2-core AVX2 machine, makes 2 tokens cost twice one token and
16 tokens three times. With the weight on the left (`torch.mm(W, x^T)`) and the tokens padded with zero
rows to 2, 4, 8, 16 or a multiple of 8 (the shapes MKL serves well; 13 tokens cost twice 16), the
linear layers of Qwen2.5-Coder-1.5B cost, for 1/2/4/8/13/16/32 tokens, 397/436/452/616/618/618/965 ms
instead of 398/783/1596/1223/1196/1190/1315 ms. One token keeps `F.linear`, so one-token decoding is
unchanged. Only the summation order differs, as between any two GEMM kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def padded_rows(n: int) -> int:
    """The number of rows a weight-left product of `n` token rows runs on."""
    return 1 << (n - 1).bit_length() if n <= 16 else -(-n // 8) * 8


class WeightLeftLinear(nn.Linear):
    """An `nn.Linear` (the same parameters, so quantization still finds it) that multiplies weight-first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if n == 1:
            return F.linear(x, self.weight, self.bias)
        rows = F.pad(rows, (0, 0, 0, padded_rows(n) - n))
        y = torch.mm(self.weight, rows.t())[:, :n].t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def use_weight_left_linears(model: nn.Module) -> None:
    """Swap every fp32 CPU `nn.Linear` of `model` for a `WeightLeftLinear` sharing its parameters."""
    for name, linear in list(model.named_modules()):
        if type(linear) is not nn.Linear or linear.weight.dtype != torch.float32 or linear.weight.is_cuda:
            continue
        swapped = WeightLeftLinear(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        swapped.weight, swapped.bias = linear.weight, linear.bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, swapped)
