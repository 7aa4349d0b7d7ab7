"""A vLLM KV connector that writes each request's prompt hidden states to a file named by its tokens.

This module runs inside a vLLM server (its own environment, with vLLM's torch), never inside
draftsmith: it imports only vLLM, torch and the standard library. ``draftsmith data --engine vllm
--hidden-layers`` copies it beside the server's output folder, puts that folder on the server's
``PYTHONPATH`` and names it in ``--kv-transfer-config`` (``kv_connector_module_path``), as vLLM's
``KVConnectorFactory`` loads a connector from outside its own registry.

It is vLLM 0.32's ``ExampleHiddenStatesConnector`` (used with the ``extract_hidden_states``
speculative method) with two changes:

- each request's file is ``{shared_storage_path}/{prompt_file_name(prompt token ids)}``, so the
  client finds the file of a prompt it sent without reading any other (vLLM adds a random suffix to
  request ids, and the completions response does not name the file unless asked);
- where the KV cache lives in host memory (vLLM's CPU backend) the states are copied synchronously,
  without the pinned buffer and CUDA stream the parent uses: ``pin_memory=True`` needs an
  accelerator and stops the CPU engine at the first request. On an accelerator the parent's
  asynchronous copy runs unchanged.

A file holds ``hidden_states`` (L, layers, H) in the server's dtype, the states entering the aux
layers in sorted order at the prompt's L positions, and ``token_ids`` (L,); its ``.lock`` companion
is held exclusively until the file is whole (a reader takes a shared lock first).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.v1.core.sched.output import SchedulerOutput


def prompt_file_name(token_ids: list[int]) -> str:
    """The file of a prompt's states: a digest of its token ids (draftsmith computes the same name)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32] + ".safetensors"


class HostCopyDone:
    """A copy made synchronously in host memory: stands where the parent keeps a CUDA event, which its
    ``get_finished`` polls (``query``) and its writer thread waits on (``synchronize``)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


HOST_COPY_DONE = HostCopyDone()


def cache_slots(block_ids: list[int], block_size: int) -> torch.Tensor:
    """The KV-cache slots of a request's blocks, in order: (len(block_ids) * block_size,)."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()


class DraftsmithHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with files named by prompt and a host-memory copy on CPUs."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The parent's metadata, each new request's file named by its prompt's token ids instead of its id."""
        meta = super().build_connector_meta(scheduler_output)
        for request in scheduler_output.scheduled_new_reqs:
            if request.prompt_token_ids is None:  # prompt embeddings: no tokens to name it by
                continue
            filename = os.path.join(self._storage_path, prompt_file_name(request.prompt_token_ids))
            self._request_filenames[request.req_id] = filename
            meta.new_req_filenames[request.req_id] = filename
        return meta

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Copy a finished request's states out of the KV cache and hand the file write to the writer threads."""
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)  # an accelerator: pinned buffer, copy stream and event
            return
        if not self._is_tp_rank_zero:  # rank 0 holds every layer's full states; the others write nothing
            return
        slots = cache_slots(pending.block_ids, self._block_size)
        # Advanced indexing copies: the blocks may be freed once get_finished reports the request.
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])  # (L, layers, H)
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:  # wait_for_save made none (as the parent falls back)
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, HOST_COPY_DONE, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = HOST_COPY_DONE
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
