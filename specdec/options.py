"""How the speculative decoder decodes: one options object, checked once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from draftsmith.specdec.cache import CACHE_KINDS
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.pacing import PaceSettings
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.tree import TreeShape


@dataclass(frozen=True)
class DecodeOptions:
    """Settings of one speculative decoding run (``decoder.speculative_generate``).

    gamma: draft tokens per round, at most.
    sampling: temperature, top-k and top-p, applied alike to the target's and the draft's logits.
    draft_greedy: the draft proposes its argmax (q one-hot) even when sampling.
    confidence_threshold: dynamic gamma; a sequence stops drafting in a round after a token whose
        draft probability ``max q`` is below it (in [0, 1]; None drafts gamma tokens).
    cache_kind: ``slot``, ``dynamic`` or ``static``; None picks the device's default.
    verify_widths: run a verification over q tokens as one over ``verify_widths[q] >= q`` tokens,
        the extra inputs padding after the real ones (some CPU BLAS libraries are slower for 2-3
        rows than for 4; ``verify.tune_verify_widths`` measures it). Exact either way.
    draft_options: the draft's own decode options, by name, as its kind declares and checks them
        (``distill.drafts.kind.DecodeOption``; ``draftsmith eval --draft-option KEY=VALUE``); the
        draft's decoding pair reads them.
    tree: draft a token tree of this shape each round instead of a chain (``tree_drafting``); then
        ``gamma`` and ``verify_widths`` are not used (the tree's depth takes gamma's place), and
        only batch 1 with a standalone draft LM is supported.
    pace: stop drafting for a sequence while drafting does not pay for it (its acceptance, the
        draft's and the verification's measured cost against a plain target step), trying again
        now and then (``pacing``); exact either way. Chains only (a tree always drafts).
    pace_settings: how pacing decides (``pacing.PaceSettings``: its prior, decay, probe interval
        and back-off); read only with ``pace``.
    exact_pauses: with ``pace``, a round where no sequence drafts steps the target as a
        verification would (two rows for one sequence in 16-bit dtypes, ``stream``), so that greedy
        output is the row-exact target's bit for bit (the default). Off, such a round is the target's
        plain one-row step, as fast as the target alone (the two-row step measured 1.5 % slower on a
        native-bfloat16 Xeon, 5 % on an EPYC), but a paced answer then mixes one-row and two-row
        steps, whose logits differ in the last bit in 16-bit dtypes: a near-tie can be decided as
        neither plain decoding nor the row-exact target decides it. Only one-sequence batches and 16-bit dtypes differ;
        unpaced rounds are row-exact.
    guesses: with ``pace`` and ``exact_pauses``, rounds may also verify lookup guesses (``lookup``: the
        tokens that followed the sequence's latest n-gram earlier in its prompt or answer), for
        drafters that take them (``takes_guesses``): a paused round after ``x_n``, a lookup round in
        place of the draft where the last two tokens or more repeat, a drafting round after the
        draft's chain. Where they are the target's tokens the round emits them too. Exact either way
        (plain one-row pauses take none). None (the default): each round verifies the number of
        guesses that emits the most tokens per second by the costs the pacer measures in the call
        (a verification forward's seconds for each number of rows, ``pacing``), and the share of
        them the target has kept: many where a row costs little beside a step, none where it costs
        much. True: every guess found, whatever it costs; False: none.
    guess_tokens: the most lookup tokens a round verifies with ``guesses`` (each costs a row of the
        verification).
    compile: run the decoding steps of both models as compiled graphs over static caches
        (``compiled``; CUDA graphs on CUDA); None compiles on CUDA and decodes eager elsewhere.
        Token trees always decode eager; a draft with its own decoding pair may too.
    """

    gamma: int = 4
    sampling: SamplingParams = SamplingParams()
    draft_greedy: bool = False
    confidence_threshold: float | None = None
    cache_kind: str | None = None
    verify_widths: Mapping[int, int] = field(default_factory=dict)
    draft_options: Mapping[str, object] = field(default_factory=dict)
    tree: TreeShape | None = None
    pace: bool = False
    pace_settings: PaceSettings = PaceSettings()
    exact_pauses: bool = True
    guesses: bool | None = None
    guess_tokens: int = 3
    compile: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1:
            raise DraftsmithError(f"gamma must be an integer >= 1, got {self.gamma!r}")
        if isinstance(self.guess_tokens, bool) or not isinstance(self.guess_tokens, int) or self.guess_tokens < 1:
            raise DraftsmithError(f"guess_tokens must be an integer >= 1, got {self.guess_tokens!r}")
        if self.confidence_threshold is not None and not 0 <= self.confidence_threshold <= 1:
            raise DraftsmithError(f"confidence threshold must be in [0, 1], got {self.confidence_threshold}")
        if self.cache_kind is not None and self.cache_kind not in CACHE_KINDS:
            raise DraftsmithError(f"unknown cache kind {self.cache_kind!r}; choose one of {', '.join(CACHE_KINDS)}")
        if not isinstance(self.pace_settings, PaceSettings):
            raise DraftsmithError(f"pace_settings must be a PaceSettings, got {self.pace_settings!r}")
        if self.tree is not None and not isinstance(self.tree, TreeShape):
            raise DraftsmithError(f"tree must be a TreeShape (e.g. TreeShape.parse('3,2,1,1')), got {self.tree!r}")
        if self.compile and self.tree is not None:
            raise DraftsmithError("token trees decode eager; leave out compile (--no-compile) with a tree")
        for tokens, width in self.verify_widths.items():
            if not 1 <= tokens <= width:
                raise DraftsmithError(f"verify widths map q >= 1 tokens to a width >= q, got {tokens}: {width}")
