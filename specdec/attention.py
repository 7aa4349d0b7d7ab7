"""Row-exact attention: a verification forward computes, bit for bit, what single-token steps compute.

Greedy speculative output is identical to the target's own only if the target's logits for a
position do not depend on how many tokens were fed with it. Matrix products keep rows apart (a
row's result does not change with the batch of rows around it), but attention does not: a
verification forward over ``q`` tokens reduces each query over ``past + q`` keys with a causal
mask, where a single-token step reduces over exactly ``past + 1`` keys, and the kernels sum in a
different order. In float32 the difference sits in the last bits and almost never matters; in
bfloat16 it flips near-tied argmaxes often enough to change a third of greedy answers.

``exact`` attention (registered as ``draftsmith_exact``) runs each query row of a decoding forward
as its own single-query attention over exactly the keys that row may see, the same call on the same
data as a single-token step (which goes through the same function). A token tree's forward
(``stream.ModelStream.forward_tree``) passes ``exact_keys``, the key slots each row may see (the
context, then its ancestors, then itself, in slot order): each row attends over those keys
gathered in that order, the very keys a one-token step along the row's path reads. Everything else (prefill,
padded batches, masks that are not a plain causal prefix, a static cache) goes to ``sdpa``
unchanged. A single query runs with its heads packed by key/value group, one small dense attention
per group with no mask: on CPU that is also the fastest single-query kernel (in bfloat16 4.5x
faster than ``sdpa``'s grouped-query path, ``benchmarks/cpu_kernels.py``), so the extra cost of a
verification forward is small.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

EXACT = "draftsmith_exact"
MAX_ROWS = 32  # longer forwards (prompts, catch-up blocks) are not verification; sdpa takes them
_UNSUPPORTED = ("softcap", "sliding_window", "s_aux", "position_bias", "dropout")  # sdpa handles these


def _plain_causal_prefix(mask: torch.Tensor | None) -> bool:
    """True when ``mask`` is the causal mask of ``q`` new tokens after ``kv - q`` live keys.

    The mask ``sdpa_mask`` builds for one unpadded sequence is exactly that when its last query sees
    the last key; a static cache (keys over the whole capacity, future slots masked) fails the test.
    """
    return mask is not None and mask.dtype == torch.bool and mask.shape[0] == 1 and bool(mask[0, 0, -1, -1])


def one_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Attention of one query position over all of ``key``: (1, H, 1, D) x (1, Hkv, L, D) -> (1, 1, H, D).

    Query head h reads key/value head h // (H / Hkv), as ``repeat_kv`` would arrange it.
    """
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, scale=scaling)
    return out.reshape(batch, 1, heads, dim)


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``sdpa`` attention, except that a decoding forward of a few tokens runs one query row at a time.

    ``exact_rows`` (a forward keyword): only the first that many query rows are real; the rest are
    padding whose output is thrown away, so their attention is not computed (zeros).
    ``exact_keys`` (a forward keyword): one (K_i,) tensor of key slots per query row (a token tree).
    """
    rows_needed = kwargs.pop("exact_rows", None)
    keys_per_row = kwargs.pop("exact_keys", None)
    batch, heads, q, _ = query.shape
    kv = key.shape[2]
    plain = batch == 1 and heads % key.shape[1] == 0 and not any(kwargs.get(k) for k in _UNSUPPORTED)
    scaling = kwargs.get("scaling")
    if plain and q == 1 and attention_mask is None:
        return one_query_attention(query, key, value, scaling), None
    if plain and keys_per_row is not None:
        rows = [
            one_query_attention(query[:, :, i : i + 1], key[:, :, slots], value[:, :, slots], scaling)
            for i, slots in enumerate(keys_per_row)
        ]
        return torch.cat(rows, dim=1), None
    if not plain or q == 1 or q > MAX_ROWS or kv <= q or not _plain_causal_prefix(attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    past = kv - q
    real = q if rows_needed is None else rows_needed
    rows = [
        one_query_attention(query[:, :, i : i + 1], key[:, :, : past + i + 1], value[:, :, : past + i + 1], scaling)
        for i in range(real)
    ]
    if real < q:
        rows.append(query.new_zeros(batch, q - real, heads, value.shape[-1]))
    return torch.cat(rows, dim=1), None


AttentionInterface.register(EXACT, exact_attention)
AttentionMaskInterface.register(EXACT, sdpa_mask)


def use_exact_attention(model: torch.nn.Module) -> None:
    """Switch a model that uses ``sdpa`` to row-exact attention (identical results for single tokens).

    ``model``: a ``transformers`` model, or a wrapper whose ``config`` is its inner model's.
    """
    if model.config._attn_implementation != "sdpa":
        return
    if isinstance(model, PreTrainedModel):
        model.set_attn_implementation(EXACT)
    else:
        model.config._attn_implementation = EXACT
