"""The speculative decoder and the target-only baseline, batched, on the same cache code.

One round (SPEC.md section 2; Leviathan et al. 2023, Chen et al. 2023):

1. draft   the draft extends each live sequence by up to gamma tokens, one forward per token;
2. verify  the target scores ``[x_n, d_1 .. d_g]`` for every sequence in ONE forward;
3. accept  left to right, stopping at the first rejection (``sampling.accept_*``);
4. correct one token from the target (residual at the rejection, or the bonus after all g);
5. rollback both caches forget the rejected positions; nothing before them is recomputed.

Batching design: padded slots with per-sequence positions. All sequences of a batch write the
same cache slots in each forward, but each keeps its own logical positions (``position_ids``) and
its own set of live slots (``cache.SlotTracker``). Prompts are left-padded; after a ragged round a
sequence that accepted fewer tokens than another keeps masked holes where its rejected tokens were.
This keeps every forward a single dense batched call (no per-sequence re-alignment copies of the
cache), at the price of attention over a few masked slots. Finished sequences leave the batch
(their rows are dropped from the caches), so they stop consuming compute. With batch size 1 there
is never a hole, the mask is a plain causal one, and the model takes its fastest path.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import PreTrainedModel

from draftsmith.specdec.attention import use_exact_attention
from draftsmith.specdec.cache import SlotTracker, default_cache_kind, make_cache, select_batch
from draftsmith.specdec.sampling import SamplingParams, accept_greedy, accept_sampled, process_logits, sample


@dataclass
class DecodeStats:
    """Counters and timings of one ``generate`` call (all sequences of the batch together)."""

    batch_size: int = 0
    new_tokens: int = 0  # tokens returned, over all sequences (prefill-produced first tokens included)
    round_tokens: int = 0  # tokens emitted by rounds (the prefill-produced first tokens excluded)
    seq_rounds: int = 0  # rounds summed over sequences (a batched round of 3 live sequences counts 3)
    rounds: int = 0  # batched rounds = target forwards after the prefill
    proposed: int = 0  # draft tokens offered for verification
    accepted: int = 0  # draft tokens the target kept
    target_forwards: int = 0  # including the prefill
    draft_forwards: int = 0  # including the prefill
    seq_proposed: list[int] = field(default_factory=list)  # per prompt, in input order
    seq_accepted: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0  # target forwards after the prefill (single-token steps for the baseline)
    other_time: float = 0.0  # acceptance, sampling, bookkeeping
    total_time: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """alpha = accepted / proposed draft tokens; None when nothing was proposed."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """tau = tokens emitted by rounds / rounds, per sequence; 1.0 for plain decoding."""
        return self.round_tokens / self.seq_rounds if self.seq_rounds else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "tokens_per_s": self.tokens_per_s,
        }


class _Clock:
    """Wall-clock timer that waits for the device, so GPU time is charged to the right phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = self.now()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self) -> float:
        now = self.now()
        elapsed, self.last = now - self.last, now
        return elapsed


class _Stream:
    """A model plus its cache and slot bookkeeping for one batch.

    Every stream's model gets row-exact attention (``specdec.attention``; also the fastest
    single-query path). ``row_exact``: the model's logits must not depend on how many tokens a
    forward carries (the target's, in a low-precision dtype). Matrix products are row-exact from two
    rows up, but the one-row (GEMV) kernels sum in another order, so a one-token forward of one
    sequence is run as two rows, the second a padding input that is dropped again.
    """

    def __init__(self, model: PreTrainedModel, batch_size: int, capacity: int, cache_kind: str, row_exact=False):
        self.model = model
        self.device = model.device
        self.cache = make_cache(cache_kind, model.config, capacity + 1)
        self.tracker = SlotTracker(batch_size, capacity + 1, self.device)
        self.pad_single = row_exact and batch_size == 1 and needs_row_padding(model)
        self._pad_valid = torch.tensor([[True, False]], device=self.device)
        use_exact_attention(model)
        _standard_strides_into_head(model)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``tokens`` (B, Q) (padding where ``valid`` is False) and return logits (B, K, V)."""
        if self.pad_single and tokens.shape == (1, 1):
            logits = self._forward(tokens.repeat(1, 2), self._pad_valid, 0, {"exact_rows": 1})
            self.tracker.drop_last_slot()  # the padding slot
            self.cache.crop(-1)
            return logits[:, :1]
        return self._forward(tokens, valid, logits_to_keep, {})

    def _forward(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int, extra: dict) -> torch.Tensor:
        holes_before = self.tracker.holes
        positions = self.tracker.reserve(valid)
        kv_length, _ = self.cache.get_mask_sizes(tokens.shape[1], 0)
        mask = self.tracker.attention_mask(tokens.shape[1], kv_length, self.model.dtype)
        if mask is not None and not holes_before and valid.shape[0] == 1 and bool(valid[0].long().diff().le(0).all()):
            # One sequence whose only padding trails its real inputs (a padded verification): the
            # real rows never look past themselves, so the plain causal mask is right for them.
            mask = None
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **extra,
        )
        return out.logits

    def rollback(self, keep: torch.Tensor) -> None:
        """Keep the first ``keep[b]`` tokens of each sequence in the cache (B,)."""
        dropped = self.tracker.rollback(keep)
        if dropped:
            self.cache.crop(-dropped)

    def select(self, indices: torch.Tensor) -> None:
        select_batch(self.cache, indices)
        self.tracker.select(indices)


def _standard_strides_into_head(model: PreTrainedModel) -> None:
    """Give the LM head its input with standard strides.

    ``logits_to_keep`` hands the head a slice of the hidden states, e.g. shape (1, 1, H) with a
    batch stride of Q*H. For such an input torch's bfloat16 CPU matmul takes a batched path that
    copies the whole weight first: 40 ms instead of 2 ms for a 49k-token head (benchmarks/cpu_kernels.py).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "_draftsmith_strides", False):
        return
    head.register_forward_pre_hook(
        lambda _module, args: (args[0].clone(memory_format=torch.contiguous_format), *args[1:])
    )
    head._draftsmith_strides = True


def needs_row_padding(model: PreTrainedModel) -> bool:
    """Whether one-token forwards of ``model`` go through two rows (see ``_Stream``): in 16-bit dtypes,
    where the last-bit differences of one-row kernels flip near-tied argmaxes. In float32 they do
    not in practice, and on CPUs whose float32 BLAS is slow for two rows the padding would cost."""
    return model.dtype in (torch.bfloat16, torch.float16)


def _left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L_max) token ids and validity mask, prompts right-aligned."""
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        valid[row, width - len(prompt) :] = True
    return tokens.to(device), valid.to(device)


def _choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from (B, V) logits."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(process_logits(logits, params), generator)


def propose(
    logits: torch.Tensor,
    sampling: SamplingParams,
    draft_greedy: bool,
    confidence_threshold: float | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One draft step from draft logits (B, V): (token (B,), q (B, V) or None, confident (B,) bool or None).

    q is the processed distribution the token was drawn from, None when the draft chose its argmax
    (q is then one-hot). ``confident`` is whether ``max q`` reaches the threshold (dynamic gamma).
    """
    if sampling.greedy or draft_greedy:
        token, q = logits.argmax(-1), None
    else:
        q = process_logits(logits, sampling)
        token = sample(q, generator)
    if confidence_threshold is None:
        return token, q, None
    judged = q
    if judged is None:  # confidence is judged on the processed distribution, as when sampling
        judged = logits.float().softmax(-1) if sampling.greedy else process_logits(logits, sampling)
    return token, q, judged.max(-1).values >= confidence_threshold


def accept(
    drafted: torch.Tensor,
    draft_probs: list[torch.Tensor],
    target_logits: torch.Tensor,
    n_proposed: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3-4 of a round: (n_accepted (B,), next token (B,)) by the greedy or the sampling rule.

    drafted (B, G); draft_probs: the q of each step, empty when the draft chose greedily.
    """
    if sampling.greedy:
        return accept_greedy(drafted, target_logits, n_proposed)
    q = torch.stack(draft_probs, 1) if draft_probs else None
    return accept_sampled(drafted, q, process_logits(target_logits, sampling), n_proposed, generator)


def _check_prompts(prompts: list[list[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise ValueError("no prompts to decode")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


class _Outputs:
    """Generated tokens per sequence, with EOS and length limits applied."""

    def __init__(self, batch_size: int, max_new_tokens: int, eos_ids: set[int]):
        self.tokens: list[list[int]] = [[] for _ in range(batch_size)]
        self.done = [False] * batch_size
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids

    def remaining(self, seq: int) -> int:
        return self.max_new_tokens - len(self.tokens[seq])

    def emit(self, seq: int, new: list[int]) -> int:
        """Append ``new``, cut after the first EOS and at the length limit; return how many were kept."""
        new = new[: self.remaining(seq)]
        for i, tok in enumerate(new):
            if tok in self.eos_ids:
                new = new[: i + 1]
                self.done[seq] = True
                break
        self.tokens[seq].extend(new)
        if self.remaining(seq) == 0:
            self.done[seq] = True
        return len(new)


@torch.inference_mode()
def target_generate(
    target: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    eos_ids: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    cache_kind: str | None = None,
) -> tuple[list[list[int]], DecodeStats]:
    """Plain KV-cached autoregressive decoding: the baseline every speedup is measured against."""
    _check_prompts(prompts, max_new_tokens)
    device = target.device
    cache_kind = cache_kind or default_cache_kind(device)
    batch = len(prompts)
    stats = DecodeStats(batch_size=batch)
    clock = _Clock(device)
    start = clock.last
    out = _Outputs(batch, max_new_tokens, set(eos_ids))
    live = list(range(batch))  # original index of each row still in the batch

    tokens, valid = _left_pad(prompts, device)
    stream = _Stream(target, batch, tokens.shape[1] + max_new_tokens + 1, cache_kind, row_exact=True)
    logits = stream.forward(tokens, valid, logits_to_keep=1)[:, -1]
    stats.target_forwards += 1
    stats.prefill_time += clock.lap()
    while True:
        chosen = _choose(logits, sampling, generator).tolist()
        for row, seq in enumerate(live):
            stats.new_tokens += out.emit(seq, [chosen[row]])
        stats.other_time += clock.lap()
        keep_rows = [row for row, seq in enumerate(live) if not out.done[seq]]
        if not keep_rows:
            break
        if len(keep_rows) < len(live):
            stream.select(torch.tensor(keep_rows, device=device))
            live = [live[row] for row in keep_rows]
        step = torch.tensor([[out.tokens[seq][-1]] for seq in live], device=device)
        logits = stream.forward(step, torch.ones_like(step, dtype=torch.bool))[:, -1]
        stats.target_forwards += 1
        stats.rounds += 1
        stats.seq_rounds += len(live)
        stats.round_tokens += len(live)
        stats.verify_time += clock.lap()
    stats.total_time = clock.now() - start
    return out.tokens, stats


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    gamma: int = 4,
    sampling: SamplingParams = SamplingParams(),
    eos_ids: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    cache_kind: str | None = None,
    draft_greedy: bool = False,
    confidence_threshold: float | None = None,
    verify_widths: dict[int, int] | None = None,
) -> tuple[list[list[int]], DecodeStats]:
    """Speculative decoding of ``prompts`` (token id lists): output is exactly the target's.

    gamma: draft tokens per round (at most). draft_greedy: the draft proposes its argmax (q one-hot)
    even when sampling. verify_widths: run a verification over q tokens as one over
    ``verify_widths[q]`` >= q, the extra inputs masked padding after the real ones (some CPU BLAS
    libraries are slower for 2-3 rows than for 4; ``tune_verify_widths`` measures it).
    confidence_threshold: dynamic gamma; a sequence stops drafting in a round
    after a token whose draft probability ``max q`` is below it.

    A target on ``sdpa`` attention is switched to its row-exact variant (``specdec.attention``), so
    a verification forward gives the same logits as single-token steps, bit for bit, in any dtype.
    """
    _check_prompts(prompts, max_new_tokens)
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    device = target.device
    cache_kind = cache_kind or default_cache_kind(device)
    batch = len(prompts)
    stats = DecodeStats(batch_size=batch, seq_proposed=[0] * batch, seq_accepted=[0] * batch)
    clock = _Clock(device)
    start = clock.last
    out = _Outputs(batch, max_new_tokens, set(eos_ids))
    live = list(range(batch))
    prompt_len = [len(p) for p in prompts]

    # Prefill. Holes from ragged rounds may add up to gamma slots per round for batch > 1.
    tokens, valid = _left_pad(prompts, device)
    extra = max_new_tokens + gamma + 2 if batch == 1 else (max_new_tokens + 1) * (gamma + 1) + 2
    target_stream = _Stream(target, batch, tokens.shape[1] + extra, cache_kind, row_exact=True)
    draft_stream = _Stream(draft, batch, tokens.shape[1] + extra, cache_kind)
    first = _choose(target_stream.forward(tokens, valid, logits_to_keep=1)[:, -1], sampling, generator)
    stats.target_forwards += 1
    draft_stream.forward(tokens, valid, logits_to_keep=1)
    stats.draft_forwards += 1
    for row, tok in enumerate(first.tolist()):
        stats.new_tokens += out.emit(row, [tok])
    # Tokens committed but not yet in each model's cache: the target always lags by one (x_n);
    # the draft by one, or by two after a fully accepted round (it never saw d_gamma).
    draft_pending = [[out.tokens[seq][-1]] for seq in live]
    stats.prefill_time += clock.lap()

    while True:
        keep_rows = [row for row, seq in enumerate(live) if not out.done[seq]]
        if not keep_rows:
            break
        if len(keep_rows) < len(live):
            index = torch.tensor(keep_rows, device=device)
            target_stream.select(index)
            draft_stream.select(index)
            live = [live[row] for row in keep_rows]
            draft_pending = [draft_pending[row] for row in keep_rows]
        n_live = len(live)
        # Never draft past max_new_tokens: a round emits at most n_proposed + 1 tokens.
        budget = torch.tensor([min(gamma, out.remaining(seq) - 1) for seq in live], device=device)

        # 1. Draft.
        drafted, draft_probs, n_proposed = _draft(
            draft_stream, draft_pending, budget, sampling, draft_greedy, confidence_threshold, generator
        )
        stats.draft_forwards += len(drafted)
        stats.draft_time += clock.lap()

        # 2. Verify: one target forward over [x_n, d_1 .. d_g] for every sequence.
        g = len(drafted)
        last = torch.tensor([[out.tokens[seq][-1]] for seq in live], device=device)
        d = torch.stack(drafted, 1) if g else torch.zeros(n_live, 0, dtype=torch.long, device=device)
        width = (verify_widths or {}).get(g + 1, g + 1)
        verify_in = torch.nn.functional.pad(torch.cat([last, d], 1), (0, width - g - 1))  # (B, width)
        # Padding sits after the real inputs: no real query attends to it, and rollback drops it.
        verify_valid = torch.arange(width, device=device)[None, :] <= n_proposed[:, None]
        target_logits = target_stream.forward(verify_in, verify_valid)[:, : g + 1]  # (B, g+1, V)
        stats.target_forwards += 1
        stats.verify_time += clock.lap()

        # 3-4. Accept and correct.
        n_accepted, next_token = accept(d, draft_probs, target_logits, n_proposed, sampling, generator)

        # 5. Emit, then roll both caches back to what each must hold.
        n_acc, n_prop, nxt, d_list = n_accepted.tolist(), n_proposed.tolist(), next_token.tolist(), d.tolist()
        keep_target, keep_draft = [], []
        for row, seq in enumerate(live):
            emitted = d_list[row][: n_acc[row]] + [nxt[row]]
            kept = out.emit(seq, emitted)
            stats.new_tokens += kept
            stats.round_tokens += kept
            stats.proposed += n_prop[row]
            stats.accepted += n_acc[row]
            stats.seq_proposed[seq] += n_prop[row]
            stats.seq_accepted[seq] += n_acc[row]
            committed = prompt_len[seq] + len(out.tokens[seq])
            all_accepted = n_prop[row] > 0 and n_acc[row] == n_prop[row]
            draft_pending[row] = [d_list[row][n_acc[row] - 1], nxt[row]] if all_accepted else [nxt[row]]
            keep_target.append(committed - 1)
            keep_draft.append(committed - len(draft_pending[row]))
        target_stream.rollback(torch.tensor(keep_target, device=device))
        draft_stream.rollback(torch.tensor(keep_draft, device=device))
        stats.rounds += 1
        stats.seq_rounds += n_live
        stats.other_time += clock.lap()

    stats.total_time = clock.now() - start
    return out.tokens, stats


@torch.inference_mode()
def tune_verify_widths(model: PreTrainedModel, max_tokens: int, context: int = 128, reps: int = 5) -> dict[int, int]:
    """For each verification size q <= max_tokens, the width w >= q (up to max_tokens + 4) whose forward
    is fastest on this machine, timed on a ``context``-token cache. Sizes where padding does not pay
    are left out (the decoder then runs q as is)."""
    device = model.device
    clock = _Clock(device)
    stream = _Stream(model, 1, context + max_tokens + 8, default_cache_kind(device))
    prompt = torch.arange(1, context + 1, device=device)[None] % model.config.vocab_size
    stream.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), logits_to_keep=1)
    cost = {}
    for width in range(1, max_tokens + 5):
        x = torch.ones(1, width, dtype=torch.long, device=device)
        times = []
        for _ in range(reps):
            clock.lap()
            stream.forward(x, torch.ones_like(x, dtype=torch.bool))
            times.append(clock.lap())
            stream.rollback(torch.tensor([context], device=device))
        cost[width] = sorted(times)[reps // 2]
    widths = {}
    for q in range(1, max_tokens + 1):
        best = min(range(q, max_tokens + 5), key=cost.get)
        if cost[best] < 0.9 * cost[q]:  # only where it clearly pays
            widths[q] = best
    return widths


def _draft(
    stream: _Stream,
    pending: list[list[int]],
    budget: torch.Tensor,
    sampling: SamplingParams,
    draft_greedy: bool,
    confidence_threshold: float | None,
    generator: torch.Generator | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Run the draft autoregressively for up to ``budget[b]`` tokens per sequence.

    Returns the drafted tokens (a list of (B,) per step), the processed draft distributions q they
    were drawn from (a list of (B, V), empty when greedy), and how many tokens each sequence
    proposed (B,). Sequences that stop early keep feeding padding so the batch stays dense.
    """
    device = budget.device
    batch = len(pending)
    width = max(len(p) for p in pending)
    step_in = torch.zeros(batch, width, dtype=torch.long)
    step_valid = torch.zeros(batch, width, dtype=torch.bool)
    for row, toks in enumerate(pending):
        step_in[row, width - len(toks) :] = torch.tensor(toks)
        step_valid[row, width - len(toks) :] = budget[row].item() > 0
    step_in, step_valid = step_in.to(device), step_valid.to(device)
    active = budget > 0
    n_proposed = torch.zeros(batch, dtype=torch.long, device=device)
    drafted: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    for i in range(int(budget.max())):
        logits = stream.forward(step_in, step_valid, logits_to_keep=1)[:, -1]  # (B, V)
        token, q, confident = propose(logits, sampling, draft_greedy, confidence_threshold, generator)
        if q is not None:
            probs.append(q)
        drafted.append(token)
        n_proposed += active.long()
        if confident is not None:
            active &= confident
        active &= budget > i + 1
        if not bool(active.any()):
            break
        # The last drafted token is fed only if another one is to be drafted after it.
        step_in, step_valid = token[:, None], active[:, None]
    return drafted, probs, n_proposed
