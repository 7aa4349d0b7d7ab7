"""Pacing: a sequence stops drafting while drafting does not pay for it, and tries again now and then.

A round with drafting emits ``tau = (1 - a^(g+1)) / (1 - a)`` tokens on average for per-position
acceptance ``a`` (Leviathan et al. 2023, Theorem 3.8) and costs the draft's forwards plus one
verification over ``g + 1`` tokens; a round without drafting is a plain target step that emits one
token. Drafting pays while ``tau * t_step > t_draft + t_verify``. Where the draft seldom agrees with
the target (a language its head barely holds, a kind of text it never saw), the speculative decoder
would otherwise run slower than the target alone.

The pacer estimates each term from what the decoder sees in the call being decoded: ``a`` per
sequence from its accepted counts (slowly decayed, so that it follows the text, and started from a
prior centred on the draft's own probability of its tokens, so that a few rejections by chance do
not pause a draft that pays and a draft unsure of everything it proposes is paused at once), and
the three times as moving averages of the round loop's own clock laps. A paused sequence proposes
nothing (budget 0): its round steps the target on ``[x_n]`` alone (row-exact, as a verification
steps it, unless ``DecodeOptions.exact_pauses`` is off) and emits the target's token, which is exact for greedy and
sampled decoding alike (there is no draft token to accept or reject). Every ``probe_every`` paused
rounds it drafts one round again, so a sequence whose text turns predictable resumes. The drafter
reads the tokens of the paused rounds when it next drafts, as it reads x_n in any round.

With lookup guesses (``DecodeOptions.guesses``, ``lookup``) a paused round also verifies up to
``guess_tokens`` tokens copied from the sequence itself and emits ``1 + h`` tokens on average, ``h``
the guess tokens the target kept per round (measured in every round, drafting or not, against the
tokens the round emitted, so it is known before the sequence is ever paused); a drafting round
verifies such a copy after its chain, which counts where the whole chain was accepted. Drafting then
pays while ``(tau + a^g h) * t_step > (1 + h) * (t_draft + t_verify)``: where the text repeats
itself more often than the draft agrees with the target, the guesses win.
"""

from __future__ import annotations

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
    this (1: every ``probe_every`` rounds), up to ``probe_max``.
    confidence: once a sequence has drafted and its drafter reports how sure it was (the draft's
    probability of each drafted token, ``Proposal.confidence``), the prior is this many counts split
    as the draft's mean probability of the tokens verification judged (decayed as the counts are);
    0 keeps the fixed ``prior``. A trained draft's probability of its token tracks its acceptance, and
    arrives with the first proposal, where 0/1 outcomes need several rounds to tell 0.07 from 0.3.
    guess_misses: the rounds without a kept guess a sequence's guess gain starts from (``guess_gain``),
    so that a lucky first guess or two on a short answer do not pause a draft for guesses that seldom pay.

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
    guess_misses: float = 1.0

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
        if self.guess_misses < 0:
            problems.append(f"guess_misses must be a count >= 0, got {self.guess_misses}")
        if self.probe_max < self.probe_every:
            problems.append(f"probe_max ({self.probe_max}) must be at least probe_every ({self.probe_every})")
        if problems:
            raise DraftsmithError("pace settings: " + "; ".join(problems))


@dataclass
class Pacer:
    """Which sequences of one decoding call draft in the next round: ``gamma`` draft tokens per
    drafting round, ``batch_size`` sequences, deciding as ``settings`` say."""

    gamma: int
    batch_size: int
    settings: PaceSettings = PaceSettings()
    accepted: list[float] = field(init=False)  # decayed accepted draft tokens, per sequence
    rejected: list[float] = field(init=False)  # decayed rejections, per sequence
    paused_for: list[int] = field(init=False)  # paused rounds in a row, per sequence
    probes: list[int] = field(init=False)  # probe rounds in a row after which drafting still did not pay
    sure: list[float] = field(init=False)  # decayed sum of the draft's probability of its verified tokens
    judged: list[float] = field(init=False)  # decayed count of those tokens
    guess_hits: list[float] = field(init=False)  # decayed lookup-guess tokens the target would keep, per round
    guess_seen: list[float] = field(init=False)  # decayed rounds with room for a guess
    resuming: bool = field(init=False, default=False)  # a sequence drafts this round after paused rounds
    draft_s: Average = field(default_factory=Average)  # seconds of drafting, per drafting round
    verify_s: Average = field(default_factory=Average)  # seconds of a verification with drafts
    step_s: Average = field(default_factory=Average)  # seconds of a verification of [x_n] alone

    def __post_init__(self) -> None:
        self.accepted = [0.0] * self.batch_size
        self.rejected = [0.0] * self.batch_size
        self.paused_for = [0] * self.batch_size
        self.probes = [0] * self.batch_size
        self.sure = [0.0] * self.batch_size
        self.judged = [0.0] * self.batch_size
        self.guess_hits = [0.0] * self.batch_size
        self.guess_seen = [0.0] * self.batch_size

    def prior(self, seq: int) -> tuple[float, float]:
        """The (accepted, rejected) counts ``seq``'s estimate starts from: the fixed prior, or with
        ``settings.confidence`` and once the draft has drafted for it, that many counts split as the
        draft's mean probability of its verified tokens."""
        weight = self.settings.confidence
        if weight == 0 or self.judged[seq] == 0:
            return self.settings.prior
        sure = self.sure[seq] / self.judged[seq]
        return weight * sure, weight * (1 - sure)

    def alpha(self, seq: int) -> float:
        """The per-position acceptance estimated for sequence ``seq``: accepted / (accepted +
        rejections), its decayed counts added to the prior's."""
        prior = self.prior(seq)
        accepted = self.accepted[seq] + prior[0]
        seen = accepted + self.rejected[seq] + prior[1]
        return accepted / seen if seen else 1.0

    def guess_gain(self, seq: int) -> float:
        """The lookup-guess tokens a round of ``seq`` gains on average (kept by the target), with
        ``guess_misses`` phantom rounds that gained none (0 until guesses are recorded)."""
        seen = self.guess_seen[seq] + self.settings.guess_misses
        return self.guess_hits[seq] / seen if seen else 0.0

    def drafting_pays(self, seq: int) -> bool:
        """Whether a drafting round is expected to emit tokens faster than a paused round (a plain
        step, plus its lookup guesses where guesses are recorded), for ``seq``."""
        if self.draft_s.value is None or self.verify_s.value is None:
            return True
        gain, alpha = self.guess_gain(seq), self.alpha(seq)
        drafting = self.draft_s.value + self.verify_s.value
        # a drafting round's guesses follow its chain: they count where every draft token was kept
        tokens = (expected_tokens(alpha, self.gamma) + alpha**self.gamma * gain) / (1.0 + gain)
        if self.step_s.value is None:
            # No plain step timed yet. A step costs at most a verification over more tokens, so with
            # t_step = t_verify drafting looks its best: a sequence it clearly pays for even then
            # drafts on; any other takes a plain round, which times the step it is compared with.
            return tokens * self.verify_s.value > self.settings.margin * drafting
        return tokens * self.step_s.value > drafting

    def record_guesses(self, live: list[int], gained: list[int | None]) -> None:
        """How many of each sequence's lookup-guess tokens this round were (or would have been) the
        target's (None: no room for a guess), decayed as the acceptance counts are."""
        decay = self.settings.decay
        for seq, kept in zip(live, gained, strict=True):
            if kept is not None:
                self.guess_hits[seq] = decay * self.guess_hits[seq] + kept
                self.guess_seen[seq] = decay * self.guess_seen[seq] + 1.0

    def probe_interval(self, seq: int) -> int:
        """Paused rounds before ``seq``'s next probe: ``probe_every``, times ``backoff`` for each probe
        in a row that left drafting not paying, at most ``probe_max``."""
        every, most = self.settings.probe_every, self.settings.probe_max
        return min(round(every * self.settings.backoff ** self.probes[seq]), most)

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
        confidence: torch.Tensor | None = None,
    ) -> None:
        """What a round did: tokens proposed and accepted per row (B,), the draft's probability of
        each drafted token (B, G) when the drafter gave it, and the round's draft and verification
        seconds. draft_s runs from the end of the previous round's verification, so it holds that
        round's bookkeeping too (accepting, committing, the pacer's own decisions): a plain round is
        timed as draft_s + verify_s, the same span a drafting round is, and not by its forward alone,
        which would leave the per-round work only drafting rounds amortize out of the comparison."""
        if int(proposed.sum()) == 0:
            self.step_s.add(draft_s + verify_s)
            return
        # A round where a sequence drafts again after paused rounds also feeds the drafter those
        # rounds' tokens: it may lower the estimate of a drafting round, never raise it.
        self.draft_s.add(min(draft_s, self.draft_s.value) if self.resuming and self.draft_s.value else draft_s)
        self.verify_s.add(verify_s)
        sure = confidence.tolist() if confidence is not None else None
        for row, (seq, offered, kept) in enumerate(zip(live, proposed.tolist(), accepted.tolist(), strict=True)):
            if offered == 0:
                continue
            decay = self.settings.decay
            self.accepted[seq] = decay * self.accepted[seq] + kept
            self.rejected[seq] = decay * self.rejected[seq] + (1 if kept < offered else 0)
            if sure is not None:  # the tokens verification judged: the accepted ones and the first rejected
                judged = sure[row][: min(kept + 1, offered)]
                self.sure[seq] = decay * self.sure[seq] + sum(judged)
                self.judged[seq] = decay * self.judged[seq] + len(judged)
