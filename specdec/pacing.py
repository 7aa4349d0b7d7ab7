"""Pacing: a sequence stops drafting while drafting does not pay for it, and tries again now and then;
and a round verifies lookup guesses only where the rows they add pay for themselves.

A round with drafting emits ``tau = (1 - a^(g+1)) / (1 - a)`` tokens on average for per-position
acceptance ``a`` (Leviathan et al. 2023, Theorem 3.8) and costs the draft's forwards plus one
verification over ``g + 1`` tokens; a round without drafting is a plain target step that emits one
token. Drafting pays while it emits more tokens per second than the plain round. Where the draft
seldom agrees with the target (a language its head barely holds, a kind of text it never saw), the
speculative decoder would otherwise run slower than the target alone.

The pacer estimates each term from what the decoder sees in the call being decoded: ``a`` per
sequence from its accepted counts (slowly decayed, so that it follows the text, and started from a
prior centred on the draft's own probability of its tokens, so that a few rejections by chance do
not pause a draft that pays and a draft unsure of everything it proposes is paused at once), and
the times as moving averages of the round loop's own clock laps: the seconds from one verification
to the next in rounds that drafted (the draft's forwards and the loop's bookkeeping) and in rounds
that did not (the bookkeeping), and the seconds of a verification forward for each number of input
rows it carried (``Pacer.forward``). A paused sequence proposes nothing (budget 0): its round steps
the target on ``[x_n]`` alone (row-exact, as a verification steps it, unless
``DecodeOptions.exact_pauses`` is off) and emits the target's token, which is exact for greedy and
sampled decoding alike (there is no draft token to accept or reject). Every ``probe_every`` paused
rounds it drafts one round again, so a sequence whose text turns predictable resumes. The drafter
reads the tokens of the paused rounds when it next drafts, as it reads x_n in any round.

Lookup guesses (``DecodeOptions.guesses``, ``lookup``): a round may verify up to ``guess_tokens``
tokens copied from the sequence itself: in a paused round after ``x_n``, instead of a draft where the
sequence's last two tokens or more repeat earlier text (a lookup round), or after a drafted chain. A
guess costs a row of the verification forward, and what a row costs is the machine's: on one CPU a
verification of two rows costs what one row does, on another 1.4 of it. So the pacer prices guesses
from the forwards it timed: ``k`` guesses after ``r`` rows cost ``forward(r + k) - forward(r)``
(widths never timed are interpolated between timed ones, or extrapolated along the two widest), and
gain the tokens the target keeps of them, learned per sequence from every round's continuation
against the tokens then committed after it (verified or not: the target's tokens are the same
either way), per position, decayed as the acceptance counts are. A round verifies the number of
guesses (0 included) that emits the most tokens per second, so rows that cost little carry guesses
even where few are kept, and rows that cost much carry them only where the text repeats itself
(``DecodeOptions.guesses=True`` verifies every guess found, ``False`` none). A paused round's guesses
also weigh in whether drafting pays: where the text repeats itself more often than the draft agrees
with the target, the guesses win.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from draftsmith.specdec.errors import DraftsmithError


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a chain round of ``gamma`` proposals emits at per-position acceptance ``alpha``."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


@dataclass
class Average:
    """An exponential moving average; None until the first sample."""

    weight: float = 0.3  # of the newest sample
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample


@dataclass(frozen=True)
class PaceSettings:
    """How a ``Pacer`` decides (``DecodeOptions.pace_settings``).

    probe_every: paused rounds between two drafting rounds of a paused sequence. decay: the weight a
    round's counts keep per later drafting round of the same sequence (close to 1: a few unlucky
    rounds of a draft that usually pays do not pause it). prior: (accepted, rejected) counts every
    sequence starts from, so that its estimate is a guess of 1/3 that its own rounds overrule: a
    draft that never agrees is paused once its rejections pull the estimate below the break-even
    acceptance (three rounds at c = 0.13, gamma 1). margin: before a plain step has been timed, how
    clearly drafting must pay (with the step taken as costly as a verification) to go on without
    timing one. In float32 on a CPU a verification of two tokens costs 1.3-1.4 one-row steps (an
    AVX-512 EPYC), so at 1 a draft of acceptance 0.3 looked as if it paid, no step was ever timed
    and nothing paused (the quickstart's draft: 0.80 of the target's speed; 0.96 at 1.5, which has
    a sequence time one plain step unless its draft clearly pays); in bfloat16, where the step and
    a verification cost about the same, 1.5 measured as 1 did (1.15 and 1.16). backoff: each probe in
    a row after which drafting still does not pay multiplies the paused rounds before the next by
    this (1: every ``probe_every`` rounds), up to ``probe_max``. probe_budget: the share of a paused
    sequence's time its probes may lose: a probe is a drafting round the sequence would have spent
    faster paused, and what it loses (``probe_loss``) is large for a draft whose step costs much
    (an early-exit draft runs the target's own lower layers), so the paused rounds before a probe
    are at least its loss over ``probe_budget`` times a paused round's seconds, past ``probe_max`` if
    need be (0: the back-off alone). A probe of a draft near break-even loses little and comes as
    often as the back-off lets it; one of a draft far from paying comes seldom, so it costs at most
    that share.
    confidence: once a sequence has drafted and its drafter reports how sure it was (the draft's
    probability of each drafted token, ``Proposal.confidence``), the prior is this many counts split
    as the draft's mean probability of the tokens verification judged (decayed as the counts are);
    0 keeps the fixed ``prior``. A trained draft's probability of its token tracks its acceptance, and
    arrives with the first proposal, where 0/1 outcomes need several rounds to tell 0.07 from 0.3.
    guess_misses: the rounds without a kept guess a sequence's guess gain starts from (``guess_gain``),
    so that a lucky first guess or two on a short answer do not pause a draft for guesses that seldom pay.
    remember: a call's pacer starts from what the pacers of earlier calls with the same draft and
    target learned (``PaceMemory``): the round timings, and how often the target kept the tokens the
    draft was sure of. Off by default: a call that remembers a draft that does not pay may never
    draft, and a measurement (eval's c, eval-run) needs drafting rounds in every call it times.

    The defaults were chosen by replaying the pacer over greedy agreement traces of a trained draft on
    held-out prompts and over synthetic ones of fixed acceptance (``benchmarks/pacing.py``): the
    decayed counts alone (decay 0.7, three warm-up rounds) paused a draft of acceptance 0.29 in 70 %
    of its rounds, after runs of rejections that such a draft has by chance. The back-off (4, 8, 16,
    then every 32 paused rounds) left every category of the quickstart draft's replay as it was and
    raised the one whose draft never agrees (translation: 0.965 to 0.975 of the target's speed).
    """

    probe_every: int = 4
    decay: float = 0.97
    prior: tuple[float, float] = (0.5, 1.0)
    confidence: float = 6.0
    margin: float = 1.5
    backoff: float = 2.0
    probe_max: int = 32
    probe_budget: float = 0.02
    guess_misses: float = 1.0
    remember: bool = False

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.probe_every, bool) or not isinstance(self.probe_every, int) or self.probe_every < 1:
            problems.append(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        if not 0 < self.decay <= 1:
            problems.append(f"decay must be in (0, 1], got {self.decay}")
        if len(self.prior) != 2 or min(self.prior) < 0:
            problems.append(f"prior must be two counts >= 0 (accepted, rejected), got {self.prior!r}")
        if self.confidence < 0:
            problems.append(f"confidence must be a count >= 0 (0: the fixed prior), got {self.confidence}")
        if self.margin < 1:
            problems.append(f"margin must be >= 1, got {self.margin}")
        if self.backoff < 1:
            problems.append(f"backoff must be >= 1 (1: no back-off), got {self.backoff}")
        if not 0 <= self.probe_budget < 1:
            problems.append(f"probe_budget must be a share in [0, 1), got {self.probe_budget}")
        if self.guess_misses < 0:
            problems.append(f"guess_misses must be a count >= 0, got {self.guess_misses}")
        if self.probe_max < self.probe_every:
            problems.append(f"probe_max ({self.probe_max}) must be at least probe_every ({self.probe_every})")
        if problems:
            raise DraftsmithError("pace settings: " + "; ".join(problems))


@dataclass
class GuessGain:
    """How many of a round's lookup-guess tokens the target keeps: per position j, the decayed count
    of rounds whose first j guesses were all the target's tokens (``hits[j - 1]``), over the decayed
    count of rounds that looked a continuation up (``seen``)."""

    hits: list[float]
    seen: float = 0.0

    @classmethod
    def empty(cls, most: int) -> GuessGain:
        return cls([0.0] * most)

    def record(self, kept: int, decay: float) -> None:
        """A round whose first ``kept`` guesses were the target's tokens."""
        self.hits = [decay * hit + (kept > j) for j, hit in enumerate(self.hits)]
        self.seen = decay * self.seen + 1.0

    def tokens(self, guesses: int, misses: float) -> float:
        """Guess tokens the target keeps on average of the first ``guesses`` of a round, with
        ``misses`` phantom rounds that kept none (0 until a round is recorded)."""
        seen = self.seen + misses
        return sum(self.hits[:guesses]) / seen if seen else 0.0


@dataclass
class Timings:
    """A pacer's clock laps (``Pacer.draft_s``, ``idle_s``, ``forward_s``), kept where a later call's
    pacer of the same batch size finds them."""

    draft_s: Average = field(default_factory=Average)
    idle_s: Average = field(default_factory=Average)
    forward_s: dict[int, Average] = field(default_factory=dict)


CALIBRATED_AFTER = 32  # judged draft tokens before the draft's confidence is scaled by what was kept


@dataclass
class PaceMemory:
    """What the pacers of earlier decoding calls of one draft and target learned, which the next call's
    pacer starts from instead of nothing (``PaceSettings.remember``).

    A call's pacer otherwise spends its first rounds timing a plain step and a drafting round before it
    can compare them, and takes the draft's probability of its tokens for their acceptance until a
    sequence's own rounds overrule it. On a short answer those rounds are a large share of it, and a
    draft sure of tokens the target does not keep (a topic it saw little of) drafts on at a loss.
    Remembered: the timings per batch size (a pacer shares them, so every round of every call adds to
    them), and the draft's summed probability of the tokens verification judged (``sure``) against the
    count of those the target kept (``kept``): the ratio scales a sequence's confidence prior once
    ``CALIBRATED_AFTER`` tokens were judged. Text-specific estimates (a sequence's acceptance, its
    lookup-guess gains) start afresh: the next call's text is another."""

    timings: dict[int, Timings] = field(default_factory=dict)
    sure: float = 0.0
    kept: float = 0.0
    judged: int = 0

    def calibration(self) -> float:
        """How the target's kept share of the draft's judged tokens compares with the draft's summed
        probability of them (1 until ``CALIBRATED_AFTER`` were judged)."""
        return self.kept / self.sure if self.judged >= CALIBRATED_AFTER and self.sure > 0 else 1.0

    def record(self, sure: list[float], kept: int) -> None:
        """A sequence's judged tokens in one round: the draft's probability of each, ``kept`` of them kept."""
        self.sure += sum(sure)
        self.kept += min(kept, len(sure))
        self.judged += len(sure)


# draft -> target -> the decoding settings that change a round's costs -> what their calls learned;
# a memory goes with its models
_MEMORIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def memory_of(draft: torch.nn.Module, target: torch.nn.Module, settings: Hashable) -> PaceMemory:
    """The ``PaceMemory`` of the calls that decode ``target`` with ``draft`` under ``settings`` (what
    changes a round's costs: gamma, compilation, the draft's options, the dtype), new on the first."""
    by_target = _MEMORIES.setdefault(draft, weakref.WeakKeyDictionary())
    return by_target.setdefault(target, {}).setdefault(settings, PaceMemory())


def forget() -> None:
    """Drop every ``PaceMemory``: the next call of every pair starts knowing nothing."""
    _MEMORIES.clear()


@dataclass
class Pacer:
    """Which sequences of one decoding call draft in the next round, and how many lookup guesses each
    round verifies: ``gamma`` draft tokens per drafting round, ``batch_size`` sequences, deciding as
    ``settings`` say; ``guess_tokens``: the most guess tokens a round verifies (0: none);
    ``forced``: verify every guess found, whatever the rows cost (``DecodeOptions.guesses=True``);
    ``memory``: what earlier calls of the same pair learned, which this pacer starts from and adds to."""

    gamma: int
    batch_size: int
    settings: PaceSettings = PaceSettings()
    guess_tokens: int = 0
    forced: bool = False
    memory: PaceMemory | None = None
    accepted: list[float] = field(init=False)  # decayed accepted draft tokens, per sequence
    rejected: list[float] = field(init=False)  # decayed rejections, per sequence
    paused_for: list[int] = field(init=False)  # paused rounds in a row, per sequence
    probes: list[int] = field(init=False)  # probe rounds in a row after which drafting still did not pay
    sure: list[float] = field(init=False)  # decayed sum of the draft's probability of its verified tokens
    judged: list[float] = field(init=False)  # decayed count of those tokens
    gains: list[GuessGain] = field(init=False)  # per sequence: every round's continuation
    strong_gains: list[GuessGain] = field(init=False)  # per sequence: continuations of a repeat of 2 tokens or more
    # per sequence: (committed tokens, continuation, strong) of rounds whose continuation is not yet settled
    pending: list[list[tuple[int, list[int], bool]]] = field(init=False)
    resuming: bool = field(init=False, default=False)  # a sequence drafts this round after paused rounds
    draft_s: Average = field(default_factory=Average)  # seconds to the verification, in rounds that drafted
    idle_s: Average = field(default_factory=Average)  # the same, in rounds where no sequence drafted
    forward_s: dict[int, Average] = field(default_factory=dict)  # a verification forward's seconds, by its rows

    def __post_init__(self) -> None:
        self.accepted = [0.0] * self.batch_size
        self.rejected = [0.0] * self.batch_size
        self.paused_for = [0] * self.batch_size
        self.probes = [0] * self.batch_size
        self.sure = [0.0] * self.batch_size
        self.judged = [0.0] * self.batch_size
        self.gains = [GuessGain.empty(self.guess_tokens) for _ in range(self.batch_size)]
        self.strong_gains = [GuessGain.empty(self.guess_tokens) for _ in range(self.batch_size)]
        self.pending = [[] for _ in range(self.batch_size)]
        if self.memory is not None:
            kept = self.memory.timings.setdefault(self.batch_size, Timings())
            self.draft_s, self.idle_s, self.forward_s = kept.draft_s, kept.idle_s, kept.forward_s

    def prior(self, seq: int) -> tuple[float, float]:
        """The (accepted, rejected) counts ``seq``'s estimate starts from: the fixed prior, or with
        ``settings.confidence`` and once the draft has drafted for it, that many counts split as the
        draft's mean probability of its verified tokens."""
        weight = self.settings.confidence
        if weight == 0 or self.judged[seq] == 0:
            return self.settings.prior
        sure = self.sure[seq] / self.judged[seq]
        if self.memory is not None:
            sure = min(1.0, sure * self.memory.calibration())
        return weight * sure, weight * (1 - sure)

    def alpha(self, seq: int) -> float:
        """The per-position acceptance estimated for sequence ``seq``: accepted / (accepted +
        rejections), its decayed counts added to the prior's."""
        prior = self.prior(seq)
        accepted = self.accepted[seq] + prior[0]
        seen = accepted + self.rejected[seq] + prior[1]
        return accepted / seen if seen else 1.0

    def guess_gain(self, seq: int, guesses: int | None = None, strong: bool = False) -> float:
        """The lookup-guess tokens the target keeps on average of ``seq``'s first ``guesses`` (all by
        default) guesses of a round; ``strong``: of continuations that follow a repeat of two tokens or
        more. ``guess_misses`` phantom rounds kept none."""
        gains = self.strong_gains if strong else self.gains
        return gains[seq].tokens(self.guess_tokens if guesses is None else guesses, self.settings.guess_misses)

    def forward(self, rows: int) -> float | None:
        """Seconds of a verification forward over ``rows`` inputs: the timed average, else interpolated
        between the nearest timed widths, else extrapolated along the two nearest below (never
        falling), else the nearest timed width's; None before any forward was timed."""
        timed = {width: average.value for width, average in self.forward_s.items() if average.value is not None}
        if rows in timed or not timed:
            return timed.get(rows)
        below, above = sorted(w for w in timed if w < rows), sorted(w for w in timed if w > rows)
        if below and above:
            low, high = below[-1], above[0]
            return timed[low] + (timed[high] - timed[low]) * (rows - low) / (high - low)
        if len(below) >= 2:
            low, high = below[-2:]
            return timed[high] + max(timed[high] - timed[low], 0.0) * (rows - high) / (high - low)
        return timed[below[-1]] if below else timed[above[0]]

    def best_guesses(
        self, gain: GuessGain, tokens: float, weight: float, spent: float, rows: int, most: int
    ) -> tuple[int, float | None]:
        """(guesses, tokens per second) of the round that emits the most per second, among rounds that
        verify 0 to ``most`` guesses after ``rows`` inputs: ``tokens`` plus ``weight`` times the guess
        tokens kept (``gain``), for ``spent`` seconds plus the forward's. Before any forward was timed,
        none; ``forced``: every guess."""
        base = self.forward(rows)
        if base is None:
            return (max(most, 0) if self.forced else 0, None)
        best = (0, tokens / (spent + base))
        misses = self.settings.guess_misses
        for k in range(1, most + 1):
            rate = (tokens + weight * gain.tokens(k, misses)) / (spent + self.forward(rows + k))
            if self.forced or rate > best[1]:
                best = (k, rate)
        return best

    def paused_rate(self, seq: int) -> float | None:
        """Tokens per second of a round in which ``seq`` does not draft (its best number of guesses)."""
        return self.best_guesses(self.gains[seq], 1.0, 1.0, self.idle_s.value or 0.0, 1, self.guess_tokens)[1]

    def drafting_rate(self, seq: int) -> float | None:
        """Tokens per second of a round in which ``seq`` drafts gamma tokens (its guesses after the
        chain, which depend on the chain, left out)."""
        verify = self.forward(self.gamma + 1)
        if self.draft_s.value is None or verify is None:
            return None
        return expected_tokens(self.alpha(seq), self.gamma) / (self.draft_s.value + verify)

    def drafting_pays(self, seq: int) -> bool:
        """Whether a drafting round is expected to emit tokens faster than a round without drafting (a
        plain step, plus its lookup guesses where they pay), for ``seq``."""
        drafting, paused = self.drafting_rate(seq), self.paused_rate(seq)
        if drafting is None or paused is None:
            return True
        if self.forward_s.get(1, Average()).value is None:
            # No one-row forward timed yet: it is taken as costly as the nearest wider one, drafting's
            # best case, so a sequence it clearly pays for even then drafts on; any other takes a
            # plain round, which times the step it is compared with.
            return drafting > self.settings.margin * paused
        return drafting > paused

    def paused_guesses(self, seq: int, found: int) -> int:
        """Guess tokens (of ``found``) a round in which ``seq`` does not draft verifies after ``x_n``:
        none until a one-row forward was timed (the round times it), then the number that pays best."""
        if not self.forced and self.forward_s.get(1, Average()).value is None:
            return 0
        return self.best_guesses(self.gains[seq], 1.0, 1.0, self.idle_s.value or 0.0, 1, found)[0]

    def lookup_guesses(self, seq: int, found: int) -> int:
        """Guess tokens (of ``found``, a continuation of a repeat of two tokens or more) a lookup round
        for ``seq`` verifies instead of drafting; 0 where drafting emits faster."""
        guesses, rate = self.best_guesses(self.strong_gains[seq], 1.0, 1.0, self.idle_s.value or 0.0, 1, found)
        drafting = self.drafting_rate(seq)
        if self.forced or guesses == 0 or rate is None or drafting is None:
            return guesses
        return guesses if rate > drafting else 0

    def chain_guesses(self, seq: int, drafted: int, found: int) -> int:
        """Guess tokens (of ``found``) a drafting round for ``seq`` verifies after its ``drafted``-token
        chain; a guess there counts only where the whole chain is kept."""
        alpha = self.alpha(seq)
        tokens = expected_tokens(alpha, drafted)
        spent = self.draft_s.value or 0.0
        return self.best_guesses(self.strong_gains[seq], tokens, alpha**drafted, spent, 1 + drafted, found)[0]

    def note(self, seq: int, committed: int, continuation: list[int], strong: bool) -> None:
        """A round of ``seq`` started after ``committed`` tokens with this lookup ``continuation``
        (verified or not); ``settle`` compares it with the tokens committed after it."""
        self.pending[seq].append((committed, continuation, strong))

    def settle(self, seq: int, sequence: list[int], finished: bool) -> None:
        """Record how many tokens of each noted continuation of ``seq`` the target kept, once
        ``sequence`` (its committed tokens) reaches past it or ends."""
        waiting = []
        for committed, continuation, strong in self.pending[seq]:
            after = sequence[committed : committed + len(continuation)]
            if len(after) < len(continuation) and not finished:
                waiting.append((committed, continuation, strong))
                continue
            kept = 0
            while kept < len(after) and after[kept] == continuation[kept]:
                kept += 1
            self.record_guess(seq, kept, strong)
        self.pending[seq] = waiting

    def record_guess(self, seq: int, kept: int, strong: bool) -> None:
        """A round's continuation for ``seq`` of which the target kept the first ``kept`` tokens."""
        self.gains[seq].record(kept, self.settings.decay)
        if strong:
            self.strong_gains[seq].record(kept, self.settings.decay)

    def probe_loss(self, seq: int) -> float:
        """Seconds a drafting round of ``seq`` is expected to lose against spending its tokens in paused
        rounds: its seconds less its expected tokens at the paused rate (0 where it pays, or before
        both kinds of round are timed)."""
        drafting, paused = self.drafting_rate(seq), self.paused_rate(seq)
        if drafting is None or paused is None or drafting >= paused:
            return 0.0
        tokens = expected_tokens(self.alpha(seq), self.gamma)
        return tokens / drafting - tokens / paused

    def probe_interval(self, seq: int) -> int:
        """Paused rounds before ``seq``'s next probe: ``probe_every``, times ``backoff`` for each probe
        in a row that left drafting not paying, at most ``probe_max``; and at least as many as keep
        the probe's loss within ``probe_budget`` of the paused rounds' time."""
        every, most = self.settings.probe_every, self.settings.probe_max
        interval = min(round(every * self.settings.backoff ** self.probes[seq]), most)
        loss, forward = self.probe_loss(seq), self.forward(1)
        if loss and self.settings.probe_budget and forward:
            paused_round = (self.idle_s.value or 0.0) + forward
            interval = max(interval, math.ceil(loss / (self.settings.probe_budget * paused_round)))
        return interval

    def drafts(self, live: list[int]) -> list[bool]:
        """For each sequence of ``live`` (one per batch row), whether it drafts in the next round."""
        decisions, self.resuming = [], False
        for seq in live:
            pays = self.drafting_pays(seq)
            probe = not pays and self.paused_for[seq] >= self.probe_interval(seq)
            self.probes[seq] = 0 if pays else self.probes[seq] + probe  # a probe that leads to a pause counts
            drafts = pays or probe
            self.resuming |= drafts and self.paused_for[seq] > 0
            self.paused_for[seq] = 0 if drafts else self.paused_for[seq] + 1
            decisions.append(drafts)
        return decisions

    def record(
        self,
        live: list[int],
        proposed: torch.Tensor,
        accepted: torch.Tensor,
        draft_s: float,
        verify_s: float,
        rows: int,
        confidence: torch.Tensor | None = None,
    ) -> None:
        """What a round did: draft tokens proposed and accepted per row (B,), the draft's probability
        of each drafted token (B, G) when the drafter gave it, the round's seconds up to its
        verification and of its verification forward, and the rows that forward carried (its width).
        draft_s runs from the end of the previous round's verification, so it holds that round's
        bookkeeping too (accepting, committing, the pacer's own decisions): a round without drafts is
        timed over the same span as a drafting round, and not by its forward alone, which would leave
        the per-round work only drafting rounds amortize out of the comparison."""
        self.forward_s.setdefault(rows, Average()).add(verify_s)
        if int(proposed.sum()) == 0:
            self.idle_s.add(draft_s)
            return
        # A round where a sequence drafts again after paused rounds also feeds the drafter those
        # rounds' tokens: it may lower the estimate of a drafting round, never raise it.
        self.draft_s.add(min(draft_s, self.draft_s.value) if self.resuming and self.draft_s.value else draft_s)
        sure = confidence.tolist() if confidence is not None else None
        decay = self.settings.decay
        for row, (seq, offered, kept) in enumerate(zip(live, proposed.tolist(), accepted.tolist(), strict=True)):
            if offered == 0:
                continue
            self.accepted[seq] = decay * self.accepted[seq] + kept
            self.rejected[seq] = decay * self.rejected[seq] + (1 if kept < offered else 0)
            if sure is not None:  # the tokens verification judged: the accepted ones and the first rejected
                judged = sure[row][: min(kept + 1, offered)]
                self.sure[seq] = decay * self.sure[seq] + sum(judged)
                self.judged[seq] = decay * self.judged[seq] + len(judged)
                if self.memory is not None:
                    self.memory.record(judged, kept)
