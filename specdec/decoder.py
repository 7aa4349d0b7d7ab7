"""The speculative decoder and the target-only baseline, batched, on the same cache code.

One round (Leviathan et al. 2023, Chen et al. 2023), the steps of ``speculative_generate``:

1. draft   the drafter extends each live sequence by up to gamma tokens (``drafters``);
2. verify  the target scores ``[x_n, d_1 .. d_g]`` of every sequence in ONE forward (``verify``);
3. accept  left to right, stopping at the first rejection, plus one token from the target: the
           correction at the rejection, or the bonus after all g (``verify.accept``);
4. commit  emit those tokens, then roll both caches back to the committed prefix: the positions
           of rejected tokens are forgotten, nothing before them is recomputed.

The loop knows drafters and verifiers only by their calls (``drafters.Drafter``,
``verify.Verifier``): a standalone draft LM, a draft made of the target's own first layers that
shares its cache, a head that reads the target's hidden states, all run in the same loop. What the
target's forward produced reaches the drafter once per round (``Drafter.observe``), after
acceptance and before rollback.

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

from dataclasses import asdict, dataclass, field

import torch
from transformers import PreTrainedModel

from draftsmith.specdec.cache import default_cache_kind
from draftsmith.specdec.clock import Clock
from draftsmith.specdec.compiled import make_stream, resolve_compile
from draftsmith.specdec.drafters import Drafter, LMDrafter, PairedDraft, Proposal
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.lookup import STRONG_NGRAM, lookup_continuation, with_guesses
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.pacing import PaceMemory, Pacer, memory_of
from draftsmith.specdec.sampling import choose_token
from draftsmith.specdec.stream import ModelStream, decoding_threads, left_pad
from draftsmith.specdec.tree_drafting import accept_tree, kept_rows
from draftsmith.specdec.verify import TargetVerifier, Verifier, accept, verification_inputs


@dataclass
class DecodeStats:
    """Counters and timings of one ``generate`` call (all sequences of the batch together)."""

    batch_size: int = 0
    new_tokens: int = 0  # tokens returned, over all sequences (prefill-produced first tokens included)
    round_tokens: int = 0  # tokens emitted by rounds (the prefill-produced first tokens excluded)
    seq_rounds: int = 0  # rounds summed over sequences (a batched round of 3 live sequences counts 3)
    rounds: int = 0  # batched rounds = target forwards after the prefill
    proposed: int = 0  # draft tokens offered for verification
    accepted: int = 0  # draft tokens the target kept (tree: length of the accepted path)
    tree_nodes: int = 0  # tree mode: draft nodes verified, over all rounds (equals proposed)
    target_forwards: int = 0  # including the prefill
    draft_forwards: int = 0  # including the prefill
    paused: int = 0  # sequence rounds without drafting, where drafting did not pay (``DecodeOptions.pace``)
    guesses: int = 0  # lookup-guess tokens verified (``DecodeOptions.guesses``; not in proposed)
    guesses_accepted: int = 0  # of those, the ones the target kept (not in accepted)
    lookup_rounds: int = 0  # sequence rounds that verified a lookup continuation instead of drafting
    # (proposed, accepted) of every sequence round that drafted a chain, in order (per-position acceptance)
    round_counts: list[tuple[int, int]] = field(default_factory=list)
    seq_proposed: list[int] = field(default_factory=list)  # per prompt, in input order
    seq_accepted: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0  # rounds in which some sequence drafted (c: per draft step)
    # rounds in which no sequence drafted (paused by pacing, or no room left for a draft): a drafter
    # catching up, or the target's own lower layers for a draft sharing them; no draft step, so not in c
    paused_draft_time: float = 0.0
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
    def nodes_per_round(self) -> float | None:
        """Tree mode: draft nodes verified per round; None otherwise."""
        return self.tree_nodes / self.seq_rounds if self.tree_nodes and self.seq_rounds else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "nodes_per_round": self.nodes_per_round,
            "tokens_per_s": self.tokens_per_s,
        }


def _check_prompts(prompts: list[list[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise DraftsmithError("no prompts to decode")
    if any(len(p) == 0 for p in prompts):
        raise DraftsmithError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


class Outputs:
    """Each sequence's committed tokens (prompt, then generated), with EOS and length limits applied."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int] | frozenset[int]):
        self.sequences = [list(p) for p in prompts]
        self.prompt_lengths = [len(p) for p in prompts]
        self.done = [False] * len(prompts)
        self.max_new_tokens = max_new_tokens
        self.eos_ids = frozenset(eos_ids)

    @property
    def tokens(self) -> list[list[int]]:
        """The generated tokens of each sequence."""
        return [seq[n:] for seq, n in zip(self.sequences, self.prompt_lengths, strict=True)]

    def remaining(self, seq: int) -> int:
        return self.max_new_tokens - (len(self.sequences[seq]) - self.prompt_lengths[seq])

    def emit(self, seq: int, new: list[int]) -> int:
        """Append ``new``, cut after the first EOS and at the length limit; return how many were kept."""
        new = new[: self.remaining(seq)]
        for i, tok in enumerate(new):
            if tok in self.eos_ids:
                new = new[: i + 1]
                self.done[seq] = True
                break
        self.sequences[seq].extend(new)
        if self.remaining(seq) == 0:
            self.done[seq] = True
        return len(new)


def _drop_finished(
    out: Outputs, live: list[int], models: list[Drafter | Verifier | ModelStream], device: torch.device
) -> list[int]:
    """The sequences of ``live`` (one per batch row) still decoding; finished rows leave ``models``."""
    rows = [row for row, seq in enumerate(live) if not out.done[seq]]
    if rows and len(rows) < len(live):
        index = torch.tensor(rows, device=device)
        for model in models:
            model.select(index)
    return [live[row] for row in rows]


@torch.inference_mode()
def target_generate(
    target: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    options: DecodeOptions = DecodeOptions(),
    eos_ids: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    row_exact: bool = False,
) -> tuple[list[list[int]], DecodeStats]:
    """Plain KV-cached autoregressive decoding: the baseline every speedup is measured against.

    options: what plain decoding shares with the speculative run it is compared with: its
        ``sampling``, ``cache_kind`` and ``compile`` (single-token steps as compiled graphs,
        ``compiled``); the drafting settings are not read.
    row_exact: compute each step as the speculative decoder's forwards compute it (``stream``: one
        sequence's one-token step as two rows in 16-bit dtypes), so that the output is the one it
        reproduces bit for bit. Off, a step of one sequence runs one row, the fastest plain decoding
        and the one a user of the target alone gets: what a speedup is timed against. The two differ
        only in 16-bit dtypes, and there only where a near-tie meets the last bit of a product.
    """
    _check_prompts(prompts, max_new_tokens)
    device, batch = target.device, len(prompts)
    clock = Clock(device)
    stats = DecodeStats(batch_size=batch)
    out = Outputs(prompts, max_new_tokens, eos_ids)
    tokens, valid = left_pad(prompts, device)
    capacity = tokens.shape[1] + max_new_tokens + 1
    kind = options.cache_kind or default_cache_kind(device)
    compiled = resolve_compile(options.compile, target)
    stream = make_stream(target, batch, capacity, kind, role="target", compiled=compiled, row_exact=row_exact)
    with decoding_threads(target):
        logits = stream.forward(tokens, valid, logits_to_keep=1)[:, -1]
        stats.target_forwards += 1
        stats.prefill_time += clock.lap()
        live = list(range(batch))  # the sequence in each row of the batch
        while True:
            for row, token in enumerate(choose_token(logits, options.sampling, generator).tolist()):
                stats.new_tokens += out.emit(live[row], [token])
            stats.other_time += clock.lap()
            live = _drop_finished(out, live, [stream], device)
            if not live:
                break
            step = torch.tensor([[out.sequences[seq][-1]] for seq in live], device=device)
            logits = stream.forward(step, torch.ones_like(step, dtype=torch.bool))[:, -1]
            stats.target_forwards += 1
            stats.rounds += 1
            stats.seq_rounds += len(live)
            stats.round_tokens += len(live)
            stats.verify_time += clock.lap()
    stats.total_time = clock.total()
    return out.tokens, stats


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    draft: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    options: DecodeOptions = DecodeOptions(),
    eos_ids: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> tuple[list[list[int]], DecodeStats]:
    """Speculative decoding of ``prompts`` (token id lists): the output is exactly the target's.

    draft: a causal LM over the target's vocabulary (decoded by ``drafters.LMDrafter``), or a
    ``drafters.PairedDraft``, which builds its own (verifier, drafter) pair (a draft sharing the
    target's cache, a head reading its hidden states). The target is switched to row-exact
    attention (``specdec.attention``), so a verification forward gives the logits of single-token
    steps, bit for bit, in any dtype. With ``options.compile`` (by default on CUDA) both models'
    decoding steps run compiled (``compiled``) where the pair allows it; the round loop is the same.
    """
    _check_prompts(prompts, max_new_tokens)
    device, batch = target.device, len(prompts)
    clock = Clock(device)
    stats = DecodeStats(batch_size=batch, seq_proposed=[0] * batch, seq_accepted=[0] * batch)
    out = Outputs(prompts, max_new_tokens, eos_ids)
    verifier, drafter = decoding_pair(target, draft, prompts, max_new_tokens, options)
    with decoding_threads(target):
        # Prefill: both models read the prompts; the target's logits after them give the first tokens.
        tokens, valid = left_pad(prompts, device)
        reusable = drafter.prefill(tokens, valid)
        prefilled = verifier.prefill(tokens, valid, reusable)
        first = choose_token(prefilled.logits[:, -1], options.sampling, generator)
        drafter.observe(prefilled, valid)
        for seq, token in enumerate(first.tolist()):
            stats.new_tokens += out.emit(seq, [token])
        stats.target_forwards, stats.draft_forwards = 1, 1
        stats.prefill_time += clock.lap()

        live = list(range(batch))  # the sequence in each row of the models' batches
        guessing = verifies_guesses(drafter, options)
        pacer = None
        if options.pace and options.tree is None:
            most = options.guess_tokens if guessing else 0
            memory = remembered(target, draft, options) if options.pace_settings.remember else None
            pacer = Pacer(options.gamma, batch, options.pace_settings, most, options.guesses is True, memory)
        progress = Progress(out, stats, clock, generator, device, pacer, guessing)
        while live := _drop_finished(out, live, [verifier, drafter], device):
            if options.tree is not None:  # the same four steps over a token tree (tree_drafting)
                _tree_round(progress, verifier, drafter, options)
                continue
            _chain_round(progress, live, verifier, drafter, options)
    stats.total_time = clock.total()
    return out.tokens, stats


def remembered(target: PreTrainedModel, draft: torch.nn.Module, options: DecodeOptions) -> PaceMemory:
    """What the pacers of earlier calls decoding ``target`` with ``draft`` learned, under the options
    that change a round's costs."""
    costs = (options.gamma, options.guess_tokens, options.exact_pauses, options.compile, str(target.dtype))
    return memory_of(draft, target, (*costs, repr(sorted(options.draft_options.items()))))


@dataclass
class Progress:
    """What every round of one decoding call updates or reads: the outputs, the counters, the clock,
    the random generator of sampling, the device the target decodes on, and the pacer that pauses
    drafting where it does not pay (None: every sequence drafts every round)."""

    out: Outputs
    stats: DecodeStats
    clock: Clock
    generator: torch.Generator | None
    device: torch.device
    pacer: Pacer | None = None
    guessing: bool = False  # rounds verify lookup guesses (``takes_guesses``)


def verifies_guesses(drafter: Drafter, options: DecodeOptions) -> bool:
    """Whether paced rounds may verify lookup guesses (``lookup``): unless ``options.guesses`` is
    False, with row-exact pauses, for a drafter that takes them. How many a round verifies is the
    pacer's choice from the costs it measures (``pacing``), or every guess found with ``guesses=True``."""
    wanted = options.guesses is not False
    return wanted and options.pace and options.exact_pauses and getattr(drafter, "takes_guesses", False)


def _chain_round(
    progress: Progress, live: list[int], verifier: Verifier, drafter: Drafter, options: DecodeOptions
) -> None:
    """One round for the ``live`` sequences (one per batch row): draft, verify, accept, commit."""
    out, stats, clock, generator = progress.out, progress.stats, progress.clock, progress.generator
    device, pacer = progress.device, progress.pacer
    # 1. Draft: up to gamma tokens each, never past max_new_tokens (a round emits n + 1); nothing
    #    for a sequence the pacer pauses (its round is a plain target step), nor for one whose last
    #    tokens repeat earlier text where verifying their continuation pays better (``lookup``).
    drafts = pacer.drafts(live) if pacer is not None else [True] * len(live)
    stats.paused += drafts.count(False)
    found = instead = None
    if progress.guessing:  # paced chains only (``verifies_guesses``): the pacer weighs the guesses
        found = [_continuation(out, seq, options.guess_tokens) for seq in live]
        still, instead = _start_guesses(pacer, live, drafts, found)
        stats.lookup_rounds += sum(go and not now for go, now in zip(drafts, still, strict=True))
        drafts = still
    budget = [min(options.gamma, out.remaining(seq) - 1) if go else 0 for seq, go in zip(live, drafts, strict=True)]
    budget = torch.tensor(budget, device=device)
    proposal = drafter.propose([out.sequences[seq] for seq in live], budget, options, generator)
    stats.draft_forwards += (steps := proposal.steps)
    drafted = proposal.counts
    if instead is not None:
        proposal = _add_guesses(out, pacer, live, proposal, drafts, instead, options.guess_tokens)
    draft_s = clock.lap()
    if steps:
        stats.draft_time += draft_s
    else:
        stats.paused_draft_time += draft_s

    # 2. Verify: one target forward over [x_n, d_1 .. d_g] for every sequence.
    last = torch.tensor([out.sequences[seq][-1] for seq in live], device=device)
    inputs, valid = verification_inputs(last, proposal)
    verification = verifier.verify(inputs, valid, proposal.reusable)  # logits (B, g+1, V)
    stats.target_forwards += 1
    verify_s = clock.lap()
    stats.verify_time += verify_s

    # 3. Accept a prefix of each proposal, then one token from the target after it.
    n_accepted, next_token = accept(proposal, verification.logits, options.sampling, generator)
    if pacer is not None:
        kept = torch.minimum(n_accepted, drafted)  # the draft's tokens kept; guesses after them are not its
        pacer.record(live, drafted, kept, draft_s, verify_s, inputs.shape[1], proposal.confidence)

    # 4. Commit: the drafter sees what verification produced for the committed rows (x_n and the
    #    accepted drafts); emit, then roll both caches back to the committed tokens except the
    #    newest (the next round's x_n, which no cache has read).
    drafter.observe(verification, torch.arange(inputs.shape[1], device=device)[None, :] <= n_accepted[:, None])
    if found is not None:  # each continuation, to be held against the tokens committed after it
        _note_continuations(out, pacer, live, found)
    _emit_round(out, stats, live, proposal, n_accepted, next_token, drafted)
    if found is not None:
        for seq in live:
            pacer.settle(seq, out.sequences[seq], out.done[seq])
    keep = torch.tensor([len(out.sequences[seq]) - 1 for seq in live], device=device)
    verifier.rollback(keep)
    drafter.rollback(keep)
    stats.other_time += clock.lap()


def _continuation(out: Outputs, seq: int, most: int) -> tuple[list[int], int] | None:
    """The lookup continuation of sequence ``seq``'s committed text, at most ``most`` tokens and never
    past its room, and the length of the repeat it follows (``lookup.lookup_continuation``); None
    where a round has room for no proposal."""
    room = out.remaining(seq) - 1  # a round emits its proposals and one more
    return lookup_continuation(out.sequences[seq], min(most, room)) if room >= 1 else None


def _note_continuations(out: Outputs, pacer: Pacer, live: list[int], found: list[tuple[list[int], int] | None]) -> None:
    """Hand the pacer each row's round-start continuation (``Pacer.note``), verified or not."""
    for seq, start in zip(live, found, strict=True):
        if start is not None:
            pacer.note(seq, len(out.sequences[seq]), start[0], start[1] >= STRONG_NGRAM)


def _start_guesses(
    pacer: Pacer, live: list[int], drafts: list[bool], found: list[tuple[list[int], int] | None]
) -> tuple[list[bool], list[list[int]]]:
    """Per row: whether it drafts after all, and the lookup guesses it verifies in place of a draft:
    a paused row, the first ``Pacer.paused_guesses`` of its continuation ``found``; a drafting row
    whose continuation follows a repeat of ``STRONG_NGRAM`` tokens or more, the first
    ``Pacer.lookup_guesses`` of it instead of drafting (a lookup round), where that pays better."""
    still, instead = [], []
    for seq, go, start in zip(live, drafts, found, strict=True):
        tokens, repeat = start if start is not None else ([], 0)
        if not go:
            guesses = tokens[: pacer.paused_guesses(seq, len(tokens))]
        elif repeat >= STRONG_NGRAM:
            guesses = tokens[: pacer.lookup_guesses(seq, len(tokens))]
        else:
            guesses = []
        still.append(go and not guesses)
        instead.append(guesses)
    return still, instead


def _add_guesses(
    out: Outputs,
    pacer: Pacer,
    live: list[int],
    proposal: Proposal,
    drafts: list[bool],
    instead: list[list[int]],
    most: int,
) -> Proposal:
    """``proposal`` with lookup guesses (``lookup``) after each row's proposed tokens: a row that did
    not draft verifies ``instead``; a drafting row, the continuation of its text and drafted chain
    where that repeats ``STRONG_NGRAM`` tokens or more, as many tokens as ``Pacer.chain_guesses``
    finds paying, at most ``most`` and never past the row's room."""
    counts, drafted = proposal.counts.tolist(), proposal.tokens.tolist()
    added = []
    for row, (seq, go, guesses) in enumerate(zip(live, drafts, instead, strict=True)):
        left = min(most, out.remaining(seq) - 1 - counts[row])
        if not go or left < 1:
            added.append(guesses)
            continue
        after, repeat = lookup_continuation(out.sequences[seq] + drafted[row][: counts[row]], left)
        added.append(after[: pacer.chain_guesses(seq, counts[row], len(after))] if repeat >= STRONG_NGRAM else [])
    return with_guesses(proposal, added)


def decodes_compiled(target: PreTrainedModel, draft: torch.nn.Module, options: DecodeOptions) -> bool:
    """Whether ``speculative_generate`` runs the pair's decoding steps compiled (``compiled``):
    ``options.compile``, or by default on CUDA; never for token trees; a ``PairedDraft`` decides
    for its own pair (refusing ``options.compile`` where it cannot)."""
    if isinstance(draft, PairedDraft):
        return draft.decodes_compiled(target, options)
    return options.tree is None and resolve_compile(options.compile, target)


def decoding_capacity(prompts: list[list[int]], max_new_tokens: int, options: DecodeOptions) -> int:
    """Cache slots a model needs to decode ``prompts`` with ``options``."""
    if options.tree is not None:
        # A round adds x_n and the tree's nodes to the caches before compacting them.
        return max(len(p) for p in prompts) + max_new_tokens + options.tree.max_nodes + 2
    guessed = options.guess_tokens if options.pace and options.guesses is not False else 0
    widest = max([options.gamma + 1 + guessed, *options.verify_widths.values()])
    # A round adds at most `widest` slots; with batch > 1 a ragged round also leaves holes behind.
    extra = max_new_tokens + widest + 1 if len(prompts) == 1 else (max_new_tokens + 1) * widest + 1
    return max(len(p) for p in prompts) + extra


def decoding_pair(
    target: PreTrainedModel,
    draft: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    options: DecodeOptions,
) -> tuple[Verifier, Drafter]:
    """The target's and the draft's sides of the loop, with caches sized for the whole run."""
    if options.tree is not None and len(prompts) > 1:
        raise DraftsmithError(f"tree decoding takes one prompt at a time, got a batch of {len(prompts)}")
    capacity = decoding_capacity(prompts, max_new_tokens, options)
    if isinstance(draft, PairedDraft):
        draft.decodes_compiled(target, options)  # refuses options.compile where the pair cannot compile
        return draft.decoding_pair(target, len(prompts), capacity, options)
    return standalone_pair(target, draft, len(prompts), capacity, options)


def standalone_pair(
    target: PreTrainedModel,
    draft: torch.nn.Module,
    batch_size: int,
    capacity: int,
    options: DecodeOptions,
    feature_layers: tuple[int, ...] = (),
) -> tuple[TargetVerifier, LMDrafter]:
    """The whole target and a standalone draft LM, each on its own cache (``feature_layers``: the
    target layers whose hidden states each verification also returns, for a drafter that reads them)."""
    compiled = options.tree is None and resolve_compile(options.compile, target)
    verifier = TargetVerifier.for_options(target, batch_size, capacity, options, compiled, feature_layers)
    cache_kind = options.cache_kind or default_cache_kind(target.device)
    return verifier, LMDrafter(draft, batch_size, capacity, cache_kind, compiled=compiled)


def _tree_round(progress: Progress, verifier: Verifier, drafter: Drafter, options: DecodeOptions) -> None:
    """One round over a token tree for the one live sequence (0): draft, verify, accept, commit."""
    out, stats, clock, generator = progress.out, progress.stats, progress.clock, progress.generator
    sequence = out.sequences[0]
    # Never past max_new_tokens: a round emits the path plus one token.
    tree = drafter.propose_tree(sequence, options.tree, max_depth=min(options.tree.depth, out.remaining(0) - 1))
    stats.draft_forwards += tree.steps
    stats.draft_time += clock.lap()
    verification = verifier.verify_tree(sequence[-1], tree)  # logits (1, N+1, V)
    stats.target_forwards += 1
    stats.verify_time += clock.lap()
    path, next_token = accept_tree(tree, verification.logits[0], options.sampling, generator)
    drafter.observe(verification, kept_rows(tree, path).to(verification.logits.device))
    verifier.commit_tree(tree, path)
    drafter.commit_tree(tree, path)
    kept = out.emit(0, [tree.tokens[node] for node in path] + [next_token])
    stats.new_tokens += kept
    stats.round_tokens += kept
    nodes = len(tree.tokens)
    stats.proposed, stats.accepted, stats.tree_nodes = (
        stats.proposed + nodes,
        stats.accepted + len(path),
        stats.tree_nodes + nodes,
    )
    stats.seq_proposed[0] += nodes
    stats.seq_accepted[0] += len(path)
    stats.rounds += 1
    stats.seq_rounds += 1
    stats.other_time += clock.lap()


def _emit_round(
    out: Outputs,
    stats: DecodeStats,
    live: list[int],
    proposal: Proposal,
    n_accepted: torch.Tensor,
    next_token: torch.Tensor,
    drafted_counts: torch.Tensor,
) -> None:
    """Emit each sequence's accepted tokens and the target's token after them, and count them.
    ``drafted_counts`` (B,): the tokens the draft proposed; those a row holds beyond them are lookup
    guesses (counted apart: alpha is the draft's)."""
    # one read of the round's numbers into Python (each read waits for the device)
    columns = [n_accepted, proposal.counts, drafted_counts, next_token]
    rows = torch.cat([column[:, None] for column in columns] + [proposal.tokens], 1).tolist()
    for seq, (accepted, offered, proposed, following, *tokens) in zip(live, rows, strict=True):
        kept = out.emit(seq, tokens[:accepted] + [following])
        stats.new_tokens += kept
        stats.round_tokens += kept
        drafts = min(accepted, proposed)
        stats.guesses += offered - proposed
        stats.guesses_accepted += accepted - drafts
        stats.proposed += proposed
        stats.accepted += drafts
        stats.seq_proposed[seq] += proposed
        stats.seq_accepted[seq] += drafts
        if proposed:
            stats.round_counts.append((proposed, drafts))
    stats.rounds += 1
    stats.seq_rounds += len(live)
