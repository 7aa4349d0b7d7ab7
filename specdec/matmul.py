"""Few-row matrix products as ``weight @ rows^T``, where that reads the weights faster.

A decoding forward multiplies 1 to a few dozen rows by every weight matrix, so its cost is reading
the weights. On CPUs torch computes ``linear(x, W)`` for one float32 row as a matrix-vector product
and for a few rows as ``x @ W^T``; on the 2-core AMD EPYC this was measured on, both read the
weights at about half the memory bandwidth that the same product written ``W @ x^T`` reaches (MKL's
GEMM with the weight as its left operand and two or more right-hand columns). There a one-token
float32 step of the default target took 38.7 ms one way and 22.6 ms the other, and a
two-token verification forward cost 1.64 of those steps one way and 1.10 the other
(``benchmarks/matmul_forms.py``).

``use_column_products`` switches a model's ``nn.Linear`` layers to that form (``ColumnLinear``: the
same module, parameters and state dict) where a timing on the model's own weights says it pays;
other models, devices and dtypes keep torch's ``linear``. A single row is multiplied as two equal
columns, because one column takes the slow matrix-vector kernel again; longer inputs (prompts,
training batches) keep ``linear``. Like torch's own float32 kernels, the column form sums a row's
products in an order that may depend on how many rows came with it; in float32 that stays in the
last bits (greedy output is checked against the target's as before), and 16-bit dtypes, where the
decoder needs rows kept apart exactly, keep ``linear``.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 32  # a decoding forward's rows; longer inputs are prompts or training batches
PAYS = 0.9  # switch where the column form takes at most this share of linear's time
_TIMED_BYTES = 256 * 2**20  # time at most this much of a model's weights
_CACHED_BYTES = 8 * 2**20  # weights this small stay in the CPU's caches: nothing to gain
_decided: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``weight @ x^T`` for up to ``MAX_ROWS`` rows.

    x: (..., K); weight: (N, K); returns (..., N). Weights other than float32 on a CPU take ``linear``.
    """
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    count = rows.shape[0]
    if count > MAX_ROWS or count == 0 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return F.linear(x, weight, bias)
    columns = rows.contiguous() if count > 1 else torch.cat([rows, rows])  # one column takes the GEMV kernel
    out = torch.mm(weight, columns.t()).t()[:count].contiguous()  # (M, N) in the layout linear gives
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class ColumnLinear(nn.Linear):
    """An ``nn.Linear`` whose few-row products run as ``column_linear``; ``use_column_products``
    switches a layer's class to it, so parameters, hooks, copies and state dicts are the layer's own."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return column_linear(input, self.weight, self.bias)


def _linear_weights(model: nn.Module) -> list[torch.Tensor]:
    weights: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weights.setdefault(module.weight.data_ptr(), module.weight.detach())
    return list(weights.values())


def _time_pass(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], columns: bool) -> float:
    start = time.perf_counter()
    for weight in weights:
        x = inputs[weight.shape[1]]
        if columns:
            column_linear(x, weight)
        else:
            F.linear(x, weight)
    return time.perf_counter() - start


@torch.inference_mode()
def column_products_pay(model: nn.Module, repeats: int = 7) -> bool:
    """Whether one-row products over ``model``'s linear weights run at most ``PAYS`` of ``linear``'s
    time in the column form: both timed over the same weights, interleaved, the fastest of ``repeats``
    passes each (the fastest pass is the one another process disturbed least).

    Only float32 weights on a CPU are timed (elsewhere torch's kernels serve few rows well), and
    only where they outgrow the CPU's caches (a test-sized model gains nothing).
    """
    weights = [w for w in _linear_weights(model) if w.device.type == "cpu" and w.dtype == torch.float32]
    if sum(w.numel() * w.element_size() for w in weights) < _CACHED_BYTES:
        return False
    timed, size = [], 0
    for weight in sorted(weights, key=lambda w: -w.numel()):
        if size >= _TIMED_BYTES:
            break
        timed.append(weight)
        size += weight.numel() * weight.element_size()
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in timed}
    _time_pass(timed, inputs, columns=True)  # warm-up: the first pass also faults the pages in
    _time_pass(timed, inputs, columns=False)
    rows_s, columns_s = [], []
    for _ in range(repeats):
        rows_s.append(_time_pass(timed, inputs, columns=False))
        columns_s.append(_time_pass(timed, inputs, columns=True))
    return min(columns_s) <= PAYS * min(rows_s)


def use_column_products(model: nn.Module, columns: bool | None = None) -> bool:
    """Run ``model``'s linear layers in the column form or with torch's ``linear``; returns which.

    columns: ``None`` keeps a choice made before for this model and otherwise times both forms
    (``column_products_pay``); ``True``/``False`` choose. The choice holds for the model object.
    """
    if columns is None:
        if model in _decided:
            return _decided[model]
        columns = column_products_pay(model)
    for module in model.modules():
        if type(module) in (nn.Linear, ColumnLinear):  # subclasses of nn.Linear keep their own forward
            module.__class__ = ColumnLinear if columns else nn.Linear
    _decided[model] = columns
    return columns


def uses_column_products(model: nn.Module) -> bool:
    """Whether ``use_column_products`` switched ``model`` to the column form."""
    return _decided.get(model, False)
