"""Talking to a vLLM server over HTTP with the standard library: completions and speculative counters.

Completions go to the OpenAI-compatible ``/v1/completions`` with the prompt as token ids (so the
prompt is exactly what the bundled decoder sees, chat template included) and ``return_token_ids``,
so the answer comes back as token ids, not as text to re-tokenize. A batch is that many requests in
flight at once (vLLM batches them continuously); batch size 1 sends them one after another. The
answer keeps the token that stopped it (an EOS id or one of ``stop_token_ids``), as the bundled
decoder's answers do. ``prompt_logprobs=k`` also returns, at every prompt position, the ``k`` most
likely tokens and their log-probabilities (the server must allow ``k``: ``--max-logprobs``).

Acceptance comes from the engine's own counters on ``/metrics`` (Prometheus text):
``vllm:spec_decode_num_drafts_total`` (verification rounds), ``..._num_draft_tokens_total``
(tokens proposed, gamma per round), ``..._num_accepted_tokens_total`` and
``..._num_accepted_tokens_per_pos_total{position="i"}``. They only grow; a measurement reads them
before and after and keeps the difference. A server without a draft exports none of them (all zero).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.vllm_server import Server, http_get

_SPEC_PREFIX = "vllm:spec_decode_"


@dataclass
class Completion:
    """One request's answer: the new token ids (prompt excluded) and the request's wall time."""

    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS or stop token) or "length" (max_tokens reached)
    seconds: float
    # With prompt_logprobs=k: per prompt position after the first, (token ids, log-probs), most likely first
    prompt_logprobs: list[tuple[list[int], list[float]]] | None = None


@dataclass
class SpecCounters:
    """The engine's cumulative speculative-decoding counters (or the difference of two readings)."""

    drafts: int = 0  # verification rounds (one per sequence and step that drafted)
    draft_tokens: int = 0  # tokens proposed (gamma per round)
    accepted: int = 0  # proposed tokens the target kept
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that kept position i

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        return self._combine(before, -1)

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (width - len(other.accepted_per_position))
        return SpecCounters(
            drafts=self.drafts + sign * other.drafts,
            draft_tokens=self.draft_tokens + sign * other.draft_tokens,
            accepted=self.accepted + sign * other.accepted,
            accepted_per_position=[a + sign * b for a, b in zip(mine, theirs, strict=True)],
        )

    @property
    def acceptance_rate(self) -> float | None:
        """alpha = accepted / proposed draft tokens; None when nothing was proposed."""
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """tau = tokens emitted per verification: the accepted drafts plus the target's own token."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """[i]: the share of rounds whose draft token i was accepted (so all of 0..i were)."""
        return [n / self.drafts for n in self.accepted_per_position] if self.drafts else []


def _post_json(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise DraftsmithError(f"the vLLM server refused the request to {url} ({err.code}): {detail}") from err
    except OSError as err:
        raise DraftsmithError(f"the vLLM server at {url} did not answer ({err}); is it still running?") from err


def complete(
    server: Server,
    prompt: list[int] | str,
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    seed: int | None = None,
    timeout: float = 600.0,
    stop_token_ids: list[int] | None = None,
    prompt_logprobs: int | None = None,
) -> Completion:
    """Generate up to ``max_tokens`` tokens after ``prompt`` (token ids, or text the server tokenizes).

    Greedy when ``sampling.temperature == 0``; generation stops at the model's EOS ids as in the
    bundled decoder, and at ``stop_token_ids`` (kept in the answer). seed: a per-request seed for
    sampling (None: the server's random state). prompt_logprobs: also return the top-k
    log-probabilities of every prompt position (``Completion.prompt_logprobs``).
    """
    body = {
        "model": server.model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # 0 disables top-k in vLLM as in draftsmith
        "return_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    if stop_token_ids:
        body["stop_token_ids"] = list(stop_token_ids)
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    start = time.perf_counter()
    answer = _post_json(f"{server.url}/v1/completions", body, timeout)
    seconds = time.perf_counter() - start
    choice = answer["choices"][0]
    return Completion(
        token_ids=list(choice["token_ids"]),
        finish_reason=choice["finish_reason"],
        seconds=seconds,
        prompt_logprobs=None if prompt_logprobs is None else top_logprobs(choice["prompt_logprobs"], prompt_logprobs),
    )


def top_logprobs(positions: list[dict | None], k: int) -> list[tuple[list[int], list[float]]]:
    """The ``k`` most likely tokens per prompt position, most likely first, from vLLM's ``prompt_logprobs``.

    vLLM gives each position a dict {token id (text): {"logprob", "rank", ...}} holding the top k and
    also the prompt's own token (whatever its rank); the first position, which nothing predicts, is
    None and left out.
    """
    tops = []
    for entries in positions[1:]:
        ranked = sorted((entry["rank"], int(token)) for token, entry in entries.items() if entry["rank"] <= k)
        tops.append(([token for _, token in ranked], [entries[str(token)]["logprob"] for _, token in ranked]))
    return tops


def served_model(server: Server) -> dict:
    """What the server says of its model (``/v1/models``): its id, root folder and ``max_model_len``."""
    try:
        return json.loads(http_get(f"{server.url}/v1/models"))["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as err:
        raise DraftsmithError(f"could not read {server.url}/v1/models ({err}); is the server still running?") from err


def engine_version(server: Server) -> str:
    """The vLLM version the server runs (``/version``)."""
    try:
        return json.loads(http_get(f"{server.url}/version"))["version"]
    except (OSError, ValueError, KeyError) as err:
        raise DraftsmithError(f"could not read {server.url}/version ({err}); is it a vLLM server?") from err


def complete_batch(
    server: Server,
    prompts: list[list[int]] | list[str],
    max_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    batch_size: int = 1,
    seed: int | None = None,
    timeout: float = 600.0,
) -> tuple[list[Completion], float]:
    """Complete every prompt with up to ``batch_size`` requests in flight; (answers in prompt order, wall s).

    seed: with sampling, prompt i gets the seed ``seed + i``, so a rerun draws the same tokens.
    """
    if batch_size < 1:
        raise DraftsmithError(f"batch size must be >= 1, got {batch_size}")

    def one(index: int) -> Completion:
        request_seed = None if seed is None else seed + index
        return complete(server, prompts[index], max_tokens, sampling, request_seed, timeout)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=batch_size) as pool:
        answers = list(pool.map(one, range(len(prompts))))
    return answers, time.perf_counter() - start


def parse_spec_counters(metrics_text: str) -> SpecCounters:
    """The speculative counters in a ``/metrics`` page, summed over engines."""
    counters = SpecCounters()
    per_position: dict[int, int] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(_SPEC_PREFIX):
            continue
        name_and_labels, value = line.rsplit(" ", 1)
        name, _, labels = name_and_labels.partition("{")
        count = round(float(value))
        if name == "vllm:spec_decode_num_drafts_total":
            counters.drafts += count
        elif name == "vllm:spec_decode_num_draft_tokens_total":
            counters.draft_tokens += count
        elif name == "vllm:spec_decode_num_accepted_tokens_total":
            counters.accepted += count
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            position = int(labels.split('position="', 1)[1].split('"', 1)[0])
            per_position[position] = per_position.get(position, 0) + count
    if per_position:
        counters.accepted_per_position = [per_position.get(i, 0) for i in range(max(per_position) + 1)]
    return counters


def read_spec_counters(server: Server) -> SpecCounters:
    """The server's speculative counters now (all zero for a server without a draft)."""
    try:
        text = http_get(f"{server.url}/metrics").decode()
    except OSError as err:
        raise DraftsmithError(f"could not read {server.url}/metrics ({err}); is the server still running?") from err
    return parse_spec_counters(text)
