"""Distillation losses between a draft (student, q) and the target (teacher, p), per token.

Every loss maps logits ``(B, T, V)`` to per-token values ``(B, T)``; the trainer adds the valid
ones and divides by the *global* count of valid tokens (over gradient accumulation and
processes), so that every token weighs the same whatever the batch split.

Why these: speculative decoding accepts a draft token with expected probability
``alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)`` (Leviathan et al. 2023), so TVD is directly
``1 - alpha``. DistillSpec (Zhou et al. 2023) compares forward KL, reverse KL, JSD and TVD for
this purpose; the expected-accepted-length loss optimizes the number of tokens a round keeps.
Temperatures are applied to both sides' logits before the softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("forward_kl", "reverse_kl", "jsd", "tvd", "accepted_length")


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.log_softmax(logits.float() / temperature, dim=-1)


def forward_kl(student_logits, teacher_logits, temperature: float = 1.0) -> torch.Tensor:
    """KL(p || q) per token: (B, T, V), (B, T, V) -> (B, T). Mode-covering."""
    log_q, log_p = _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(student_logits, teacher_logits, temperature: float = 1.0) -> torch.Tensor:
    """KL(q || p) per token: (B, T, V), (B, T, V) -> (B, T). Mode-seeking."""
    log_q, log_p = _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def jsd(student_logits, teacher_logits, beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence per token: (B, T, V) x2 -> (B, T).

    ``beta KL(p || m) + (1 - beta) KL(q || m)`` with ``m = beta p + (1 - beta) q`` (Agarwal et al.
    2024, GKD). Needs ``0 < beta < 1``; it tends to forward KL as beta -> 0 after rescaling.
    """
    if not 0 < beta < 1:
        raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
    log_q, log_p = _log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return beta * kl_pm + (1 - beta) * kl_qm


def tvd(student_logits, teacher_logits, temperature: float = 1.0) -> torch.Tensor:
    """Total variation ``0.5 sum_x |p(x) - q(x)|`` per token = ``1 - alpha``: (B, T, V) x2 -> (B, T)."""
    q = _log_probs(student_logits, temperature).exp()
    p = _log_probs(teacher_logits, temperature).exp()
    return 0.5 * (p - q).abs().sum(-1)


def acceptance_probability(student_logits, teacher_logits, temperature: float = 1.0) -> torch.Tensor:
    """``alpha = sum_x min(p(x), q(x))`` per token: (B, T, V) x2 -> (B, T)."""
    q = _log_probs(student_logits, temperature).exp()
    p = _log_probs(teacher_logits, temperature).exp()
    return torch.minimum(p, q).sum(-1)


def accepted_length(
    student_logits, teacher_logits, mask: torch.Tensor, gamma: int = 4, temperature: float = 1.0
) -> torch.Tensor:
    """Negative expected accepted tokens of a round drafted from each position, over gamma: (B, T).

    With per-position acceptance ``alpha_t`` (independent approximation), a round that drafts
    positions ``t .. t+gamma-1`` keeps ``sum_{k=1..gamma} prod_{j<k} alpha_{t+j}`` tokens in
    expectation. The loss is minus that over gamma, so it lies in [-1, 0]; a window stops at the
    first masked position. mask (B, T) bool.
    """
    alpha = acceptance_probability(student_logits, teacher_logits, temperature)  # (B, T)
    return expected_accepted(alpha, mask, gamma)


def expected_accepted(alpha: torch.Tensor, mask: torch.Tensor, gamma: int) -> torch.Tensor:
    """``accepted_length`` from per-position acceptance ``alpha`` (B, T) and mask (B, T): (B, T) in [-1, 0]."""
    alpha = alpha * mask
    run = torch.ones_like(alpha)
    expected = torch.zeros_like(alpha)
    for k in range(gamma):
        shifted = F.pad(alpha[:, k:], (0, k))  # alpha_{t+k}, 0 past the end
        run = run * shifted
        expected = expected + run
    return -expected / gamma


def cross_entropy(student_logits, labels: torch.Tensor) -> torch.Tensor:
    """Hard-label cross-entropy per token: (B, T, V), (B, T) -> (B, T); labels < 0 give 0."""
    flat = F.cross_entropy(student_logits.float().flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
    return flat.view(labels.shape) * (labels >= 0)


def densify_topk(indices: torch.Tensor, logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Teacher logits from a sparse top-k cache: (B, T, K) ids and log-probs -> (B, T, V) log-probs.

    The top-k tokens keep their probabilities; the mass left over is spread evenly over the other
    tokens, so that every divergence (reverse KL included) stays finite.
    """
    probs = logprobs.float().exp()
    rest = (1 - probs.sum(-1, keepdim=True)).clamp(min=1e-9)
    others = vocab_size - indices.shape[-1]
    dense = (rest / max(others, 1)).expand(*indices.shape[:-1], vocab_size).clone()
    dense.scatter_(-1, indices.long(), probs)
    return dense.log()


def token_losses(
    name: str,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    gamma: int = 4,
) -> torch.Tensor:
    """The named distillation loss per token (B, T), zero where ``mask`` is False."""
    if name == "forward_kl":
        losses = forward_kl(student_logits, teacher_logits, temperature)
    elif name == "reverse_kl":
        losses = reverse_kl(student_logits, teacher_logits, temperature)
    elif name == "jsd":
        losses = jsd(student_logits, teacher_logits, jsd_beta, temperature)
    elif name == "tvd":
        losses = tvd(student_logits, teacher_logits, temperature)
    elif name == "accepted_length":
        losses = accepted_length(student_logits, teacher_logits, mask, gamma, temperature)
    else:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    return losses * mask


def subset_token_losses(
    name: str,
    student_logits: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    gamma: int = 4,
) -> torch.Tensor:
    """The named loss per token (B, T) for a draft whose head is cut to a token subset S.

    student_logits (B, T, N): the draft's logits over S; its distribution ``q`` is their softmax
    (at ``temperature``), zero outside S, which is exactly what the cut draft decodes with.
    teacher_log_probs (B, T, N): ``log p(x)`` for x in S, the target's log-probs at the loss
    temperature normalized over the *full* vocabulary, so ``p(S) = sum_S p <= 1``.

    TVD, reverse KL, JSD and accepted_length are the full-vocabulary divergences between ``p`` and
    that ``q``: the tokens outside S (where q = 0) add terms in ``p(S^c) = 1 - p(S)`` alone, constant
    for the draft, kept so that the values are the true ones (TVD is ``1 - sum_S min(p, q)``, the
    cut draft's own rejection rate). Forward KL(p || q) is infinite whenever ``p(S^c) > 0``, so it is
    taken against the teacher conditioned on S, ``p_S = p / p(S)``: its minimizer ``q = p_S`` also
    minimizes the others. Zero where ``mask`` is False.
    """
    if name == "accepted_length":
        alpha = row_acceptance(student_logits, teacher_log_probs, temperature)  # (B, T)
        losses = expected_accepted(alpha, mask, gamma)
    elif name in LOSSES:
        losses = row_losses(name, student_logits, teacher_log_probs, temperature, jsd_beta)  # (B, T)
    else:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    return losses * mask


# The lean path: the same losses at the M loss rows only (the positions where the mask is True, in
# row-major order), over the columns the draft's head computes (its full vocabulary V, or the N tokens
# of a cut head). The heads are applied at those rows only (``vocab_cut.loss_rows_head``), so nothing
# of size (B, T, V) is built and prompt or padding positions cost no head, softmax or loss.


def row_losses(
    name: str,
    student_logits: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
) -> torch.Tensor:
    """forward_kl, reverse_kl, jsd or tvd at the loss rows: (M, n), (M, n) -> (M,) (or over any
    leading shape: (B, T, n) -> (B, T), as ``subset_token_losses`` takes them).

    student_logits: the draft's logits over its n columns; q is their softmax at ``temperature``.
    teacher_log_probs: ``log p`` at ``temperature`` on the same columns, normalized over the target's
    full vocabulary, so that ``p`` may sum to less than 1 over the columns (a cut head): the mass
    outside enters TVD and JSD as a constant (``subset_token_losses`` says why). Forward KL
    renormalizes ``p`` over the columns (it is infinite otherwise, and with all V columns the
    renormalization changes nothing), so for it the teacher's values may be off by a per-row constant:
    the kept logits at temperature need no full-vocabulary normalizer.
    """
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (M, n)
    log_p = teacher_log_probs.float()
    if name == "forward_kl":
        log_p_cols = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
        return (log_p_cols.exp() * (log_p_cols - log_q)).sum(-1)
    p, q = log_p.exp(), log_q.exp()
    if name == "reverse_kl":
        return (q * (log_q - log_p)).sum(-1)
    outside = (1 - p.sum(-1)).clamp(min=0)  # (M,): p's mass outside the columns, 0 for a full head
    if name == "tvd":
        return 0.5 * ((p - q).abs().sum(-1) + outside)
    if name == "jsd":
        if not 0 < jsd_beta < 1:
            raise ValueError(f"jsd beta must be in (0, 1), got {jsd_beta}")
        log_m = torch.logaddexp(log_p + math.log(jsd_beta), log_q + math.log(1 - jsd_beta))
        inside = jsd_beta * (p * (log_p - log_m)).sum(-1) + (1 - jsd_beta) * (q * (log_q - log_m)).sum(-1)
        return inside + jsd_beta * outside * -math.log(jsd_beta)  # outside the columns m = beta p
    raise ValueError(f"unknown row loss {name!r}; choose one of forward_kl, reverse_kl, jsd, tvd")


@dataclass
class TopkTeacher:
    """The teacher at M rows as a top-k store gives it, over a head's ``width`` columns (its full
    vocabulary, or the N tokens of a cut head), without a dense (M, width) tensor.

    columns (M, k): the column of each top-k token, ``width`` for a token the head has no column for;
    log_probs (M, k): their log p at the loss temperature; log_other (M, 1): log p of each token outside
    the top k (the rest of the mass spread evenly). Both normalized over the target's full vocabulary,
    so ``dense()`` is exactly what a dense teacher would hold."""

    columns: torch.Tensor
    log_probs: torch.Tensor
    log_other: torch.Tensor
    width: int

    def index_select(self, dim: int, rows: torch.Tensor) -> TopkTeacher:
        """The teacher at rows ``rows`` (R,) (dim 0 only, as a tensor's ``index_select``)."""
        if dim != 0:
            raise ValueError("a top-k teacher is indexed by rows (dim 0)")
        parts = (self.columns, self.log_probs, self.log_other)
        return TopkTeacher(*(part.index_select(0, rows) for part in parts), self.width)

    def dense(self) -> torch.Tensor:
        """(M, width) log p on every column."""
        out = self.log_other.expand(-1, self.width + 1).clone()  # the last column collects the tokens kept out
        return out.scatter_(1, self.columns, self.log_probs)[:, : self.width]


def topk_forward_kl(student_logits: torch.Tensor, teacher: TopkTeacher, temperature: float = 1.0) -> torch.Tensor:
    """``row_losses``' forward KL against a top-k teacher: (M, n), TopkTeacher -> (M,), the same values
    without building the teacher densely.

    Over the n columns (renormalized, as ``row_losses`` does), p is p_i on the top-k tokens with a
    column and one value u on each of the s other columns, so
    ``KL = sum_i p_i log p_i + s u log u - sum_i p_i log q_i - u (sum_all log q - sum_i log q_i)``,
    where ``sum_all log q = sum(z) / T - n logsumexp(z / T)``: the student's logits enter through a
    logsumexp, a row sum and a gather of k columns (its gradient, ``(q - p) / T``, is formed once)."""
    z = student_logits.float()
    if temperature != 1:
        z = z / temperature
    width = teacher.width
    inside = teacher.columns < width  # (M, k)
    spread = (width - inside.sum(-1, keepdim=True)).float()  # (M, 1): columns outside the top k
    top = teacher.log_probs.float().masked_fill(~inside, float("-inf"))
    log_norm = torch.logsumexp(torch.cat([top, teacher.log_other.float() + spread.log()], -1), -1, keepdim=True)
    log_p, log_u = top - log_norm, teacher.log_other.float() - log_norm  # (M, k), (M, 1): over the columns
    p, u = log_p.exp(), log_u.exp()  # p is 0 at the tokens without a column
    neg_entropy = (p * log_p.masked_fill(~inside, 0)).sum(-1) + (spread * u * log_u)[:, 0]
    lse = torch.logsumexp(z, -1, keepdim=True)  # (M, 1)
    log_q_top = (z.gather(1, teacher.columns.clamp(max=width - 1)) - lse) * inside  # (M, k)
    log_q_rest = z.sum(-1, keepdim=True) - width * lse - log_q_top.sum(-1, keepdim=True)  # (M, 1)
    return neg_entropy - (p * log_q_top).sum(-1) - (u * log_q_rest)[:, 0]


def row_acceptance(student_logits: torch.Tensor, teacher_log_probs: torch.Tensor, temperature: float = 1.0):
    """``alpha = sum_x min(p(x), q(x))`` at the loss rows: (M, n), (M, n) -> (M,) (any leading shape).

    Over the columns only: where the draft has no column its q is 0, so min(p, q) adds nothing there.
    ``teacher_log_probs`` normalized over the full vocabulary, as for ``row_losses``."""
    q = F.softmax(student_logits.float() / temperature, dim=-1)
    return torch.minimum(teacher_log_probs.float().exp(), q).sum(-1)


def rows_accepted_length(alpha: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, gamma: int) -> torch.Tensor:
    """``accepted_length`` at the loss rows from their acceptance: alpha (M,), mask (B, T), rows (M,) -> (M,).

    A window runs over consecutive positions, so the rows' alpha go back to their places in (B, T)
    (0 elsewhere, as ``expected_accepted`` masks them anyway), and the result is read at the rows."""
    placed = torch.zeros(mask.numel(), dtype=alpha.dtype, device=alpha.device).index_put((rows,), alpha)
    return expected_accepted(placed.view(mask.shape), mask, gamma).flatten().index_select(0, rows)


def row_token_losses(
    name: str,
    student_logits: torch.Tensor,
    teacher_log_probs: torch.Tensor | TopkTeacher,
    mask: torch.Tensor,
    rows: torch.Tensor,
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    gamma: int = 4,
) -> torch.Tensor:
    """The named loss at the loss rows (M,): ``token_losses`` (full head) or ``subset_token_losses``
    (cut head) read at the rows ``rows`` (M,) = the flat indices of ``mask`` (B, T), from the heads'
    values there: student logits (M, n) and teacher log-probs (M, n) (see ``row_losses``), or a top-k
    teacher (forward KL is then taken sparsely, the others on its dense form)."""
    if isinstance(teacher_log_probs, TopkTeacher):
        if name == "forward_kl":
            return topk_forward_kl(student_logits, teacher_log_probs, temperature)
        teacher_log_probs = teacher_log_probs.dense()
    if name == "accepted_length":
        alpha = row_acceptance(student_logits, teacher_log_probs, temperature)
        return rows_accepted_length(alpha, mask, rows, gamma)
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    return row_losses(name, student_logits, teacher_log_probs, temperature, jsd_beta)


def row_cross_entropy(student_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hard-label cross-entropy at the loss rows: (M, n), (M,) -> (M,); labels < 0 give 0."""
    losses = F.cross_entropy(student_logits.float(), labels.clamp(min=0), reduction="none")
    return losses * (labels >= 0)
