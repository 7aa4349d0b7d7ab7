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
same module, parameters and state dict) where a timing on the model's own weights says it pays, shape
by shape (a CPU's matrix-vector kernel may serve one shape well and another badly, and the column
form's copies weigh more beside a small product); other models, devices and dtypes keep torch's
``linear``. A single row is multiplied as two equal
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
_TIMED_BYTES = 512 * 2**20  # time at most this much of a model's weights a pass (every shape at least once)
_CACHED_BYTES = 8 * 2**20  # weights this small stay in the CPU's caches: nothing to gain
_decided: weakref.WeakKeyDictionary[nn.Module, frozenset[tuple[int, int]]] = weakref.WeakKeyDictionary()


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
    """The distinct weights of ``model``'s linear layers, in the order a forward reads them."""
    weights: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weights.setdefault(module.weight.data_ptr(), module.weight.detach())
    return list(weights.values())


def _time_pass(
    weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], columns: bool
) -> dict[tuple[int, int], float]:
    """Seconds of a one-row product with each of ``weights`` in turn, in one form, summed by weight shape."""
    spent: dict[tuple[int, int], float] = {}
    for weight in weights:
        x = inputs[weight.shape[1]]
        start = time.perf_counter()
        if columns:
            column_linear(x, weight)
        else:
            F.linear(x, weight)
        shape = (weight.shape[0], weight.shape[1])
        spent[shape] = spent.get(shape, 0.0) + time.perf_counter() - start
    return spent


@torch.inference_mode()
def column_shapes(model: nn.Module, repeats: int = 7) -> frozenset[tuple[int, int]]:
    """The weight shapes whose one-row products over ``model``'s linear weights run at most ``PAYS`` of
    ``linear``'s time in the column form. A pass multiplies by every weight in the order a forward
    reads them (up to ``_TIMED_BYTES``, each shape at least once), so each product finds the caches
    as a decoding step leaves them, and each product is timed on its own, summed by shape; the two
    forms' passes alternate, and each shape's fastest of ``repeats`` passes in each form is compared
    (the fastest pass is the one another process disturbed least). A form is chosen per shape: a
    CPU's matrix-vector kernel may be slow for the head and fine for a small projection, where the
    column form's extra copies would cost more than they save.

    Only float32 weights on a CPU are timed (elsewhere torch's kernels serve few rows well), and
    only where they outgrow the CPU's caches (a test-sized model gains nothing).
    """
    weights = [w for w in _linear_weights(model) if w.device.type == "cpu" and w.dtype == torch.float32]
    if sum(w.numel() * w.element_size() for w in weights) < _CACHED_BYTES:
        return frozenset()
    timed, size, shapes = [], 0, set()
    for weight in weights:
        if size < _TIMED_BYTES or tuple(weight.shape) not in shapes:
            timed.append(weight)
            shapes.add(tuple(weight.shape))
            size += weight.numel() * weight.element_size()
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in timed}
    _time_pass(timed, inputs, columns=True)  # warm-up: the first pass also faults the pages in
    _time_pass(timed, inputs, columns=False)
    rows_s: dict[tuple[int, int], float] = {}
    columns_s: dict[tuple[int, int], float] = {}
    for _ in range(repeats):
        for fastest, columns in ((rows_s, False), (columns_s, True)):
            for shape, seconds in _time_pass(timed, inputs, columns).items():
                fastest[shape] = min(seconds, fastest.get(shape, seconds))
    return frozenset(shape for shape, seconds in rows_s.items() if columns_s[shape] <= PAYS * seconds)


def use_column_products(model: nn.Module, columns: bool | None = None) -> bool:
    """Run ``model``'s linear layers in the column form or with torch's ``linear``; returns whether any
    layer takes the column form.

    columns: ``None`` keeps a choice made before for this model and otherwise times both forms for
    each weight shape (``column_shapes``); ``True``/``False`` choose for every layer. The choice holds
    for the model object.
    """
    if columns is None and model in _decided:
        return bool(_decided[model])
    linears = [m for m in model.modules() if type(m) in (nn.Linear, ColumnLinear)]  # subclasses keep their forward
    if columns is None:
        shapes = column_shapes(model)
    else:
        shapes = frozenset((m.weight.shape[0], m.weight.shape[1]) for m in linears) if columns else frozenset()
    for module in linears:
        module.__class__ = ColumnLinear if (module.weight.shape[0], module.weight.shape[1]) in shapes else nn.Linear
    _decided[model] = shapes
    return bool(shapes)


def uses_column_products(model: nn.Module) -> bool:
    """Whether ``use_column_products`` switched any of ``model``'s layers to the column form."""
    return bool(_decided.get(model))


def column_form_shapes(model: nn.Module) -> frozenset[tuple[int, int]]:
    """The weight shapes (out, in) whose layers ``use_column_products`` switched to the column form."""
    return _decided.get(model, frozenset())
