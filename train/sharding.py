"""The frozen target's forward as the teacher runs it, and its sharding over the processes of a launch.

A live teacher under N processes would otherwise be held whole by every process. With FSDP2 (torch's
``fully_shard``) each process holds 1/N of every decoder layer and of the root tensors (embeddings,
final norm, head); a layer's whole weights exist only while it runs, gathered from the others.
Because a gather is a collective, every process must run the teacher the same number of times: one
forward per micro-batch in training, one per held-out batch (accelerate's held-out loader gives each
process the same number of batches).

FSDP2 gathers a module's tensors around its ``forward``. The teacher reads its head outside the
decoder's forward (at the loss rows only, chunked, over a cut vocabulary, see ``distill.vocab_cut``),
so the whole computation is one module, ``TeacherForward``, whose own tensors are the target's root
tensors: its forward runs the decoder and applies ``read`` to the result while the head is gathered.
Unsharded (one process), it is the same call.

accelerate shards only what it ``prepare``s, and on CPUs (gloo) it gives a distributed run DDP
whatever its FSDP settings say; ``fully_shard`` itself runs on CPU with gloo, so the teacher is
sharded with it directly, on GPUs and CPUs alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import PreTrainedModel

from draftsmith.distill import vocab_cut
from draftsmith.specdec.partial_model import PARTIAL, load_whole

Read = Callable[[PreTrainedModel, vocab_cut.TargetRows], Any]


class TeacherForward(nn.Module):
    """``forward(batch, rows, layers, read)``: the target's decoder over a batch (input_ids, attention_mask
    (B, T)), gathered at the loss rows ``rows`` (M,) with the hidden states of ``layers``, then
    ``read(target, rows)``, whatever the caller computes with the target's head there."""

    def __init__(self, target: PreTrainedModel):
        super().__init__()
        self.target = target

    def forward(self, batch: dict, rows: torch.Tensor, layers: tuple[int, ...], read: Read) -> Any:
        return read(self.target, vocab_cut.target_rows(self.target, batch, rows, layers))

    @property
    def sharded(self) -> bool:
        return isinstance(self, FSDPModule)


def shard_teacher(target: PreTrainedModel) -> TeacherForward:
    """``target`` sharded over the processes of the default process group (FSDP2), in its forward.

    Each decoder layer is read from the checkpoint (when the target was loaded in parts) and sharded in
    turn, so a process never holds more than its shards and one whole layer; the root tensors last.
    The parameters reshard after every forward (the root's too: a frozen teacher runs no backward that
    would reuse them)."""
    partial = PARTIAL.get(target)
    for layer in target.get_decoder().layers:
        if partial is not None:
            partial.load([layer], None)
        fully_shard(layer, reshard_after_forward=True)
    load_whole(target)
    forward = TeacherForward(target)
    fully_shard(forward, reshard_after_forward=True)
    return forward
