"""Quality filters and de-duplication for prompts a model wrote itself.

Filters (``PromptFilter.reject``) say why a prompt is dropped: ``unfinished`` (the writer ran out of
tokens before ending its turn), ``too_short`` / ``too_long`` (in words), ``repetitive`` (the same
word 3-gram again and again, the usual failure of a small model sampling freely), and
``not_a_request`` (neither a question nor an instruction: no ``?``, and its first word is not one
that opens a request, such as *write*, *explain*, *how*, *I*).

De-duplication (``Deduplicator``) drops exact duplicates after normalization (case, punctuation and
whitespace ignored) and near duplicates: texts whose sets of word 3-grams have a Jaccard similarity
of at least ``threshold``. Candidates are found with MinHash and locality-sensitive hashing (Broder
1997; Leskovec, Rajaraman and Ullman, *Mining of Massive Datasets*, ch. 3): ``num_perm`` hash
functions make a signature, split into ``bands``; two texts sharing one band are compared by their
exact Jaccard similarity, so the hashing only decides which pairs get compared.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from draftsmith.specdec.errors import DraftsmithError

_REQUEST_WORDS = """
write explain describe how what why when where which who whom whose is are can could would should do does did will
give list tell help create make generate summarize summarise translate compare find solve calculate compute implement
fix suggest recommend provide show rewrite edit draft compose design plan please i i'm im my we need want let define
prove convert classify analyze analyse outline
"""
REQUEST_WORDS = frozenset(_REQUEST_WORDS.split())  # a request without a question mark opens with one of these
_WORD = re.compile(r"[\w']+")
_PRIME = (1 << 61) - 1  # a Mersenne prime above every 32-bit shingle hash


def words(text: str) -> list[str]:
    """Lower-cased words (letters, digits, apostrophes) of ``text``."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class PromptFilter:
    """Length and quality limits for a written prompt; ``reject`` names the first one it fails."""

    min_words: int = 3
    max_words: int = 300
    max_repeated_ngrams: float = 0.3  # the most a prompt's word 3-grams may be repeats of earlier ones
    require_request: bool = True  # must read as a question or an instruction

    def __post_init__(self) -> None:
        if not 0 < self.min_words <= self.max_words:
            raise DraftsmithError(
                f"prompt word limits must satisfy 0 < min <= max, got {self.min_words}, {self.max_words}"
            )
        if not 0 <= self.max_repeated_ngrams <= 1:
            raise DraftsmithError(f"max_repeated_ngrams must be in [0, 1], got {self.max_repeated_ngrams}")

    def reject(self, text: str, finished: bool) -> str | None:
        """Why ``text`` is dropped, or None when it is kept. finished: the writer ended its turn itself."""
        if not finished:
            return "unfinished"
        tokens = words(text)
        if len(tokens) < self.min_words:
            return "too_short"
        if len(tokens) > self.max_words:
            return "too_long"
        grams = list(zip(tokens, tokens[1:], tokens[2:], strict=False))
        if grams and 1 - len(set(grams)) / len(grams) > self.max_repeated_ngrams:
            return "repetitive"
        if self.require_request and "?" not in text and tokens[0] not in REQUEST_WORDS:
            return "not_a_request"
        return None


def normalized(text: str) -> str:
    """The text as compared for exact duplicates: lower case, words only, single spaces."""
    return " ".join(words(text))


def shingles(text: str, size: int = 3) -> frozenset[str]:
    """Word ``size``-grams of the normalized text (the whole text when it is shorter)."""
    tokens = words(text)
    if len(tokens) <= size:
        return frozenset([" ".join(tokens)])
    return frozenset(" ".join(tokens[i : i + size]) for i in range(len(tokens) - size + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class Deduplicator:
    """Keeps the first of every group of exact or near-duplicate texts, incrementally.

    threshold: the word 3-gram Jaccard similarity from which two texts count as near duplicates.
    num_perm, bands: MinHash signature length and LSH bands (``num_perm`` a multiple of ``bands``);
    a pair at similarity s becomes a candidate with probability ``1 - (1 - s^r)^bands``,
    r = num_perm / bands (0.5 at s = 0.5 and > 0.999 at s = 0.8 for the defaults).
    """

    def __init__(self, threshold: float = 0.7, num_perm: int = 64, bands: int = 16, seed: int = 0):
        if num_perm % bands:
            raise ValueError(f"num_perm ({num_perm}) must be a multiple of bands ({bands})")
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 1 << 31, size=(num_perm, 1), dtype=np.uint64)
        self.b = rng.integers(0, 1 << 31, size=(num_perm, 1), dtype=np.uint64)
        self.threshold, self.bands = threshold, bands
        self.exact: set[str] = set()
        self.kept: list[frozenset[str]] = []
        self.buckets: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]
        self.dropped = Counter()  # "exact" / "near" -> how many texts were dropped as duplicates

    def signature(self, grams: frozenset[str]) -> np.ndarray:
        """MinHash signature (num_perm,) of a shingle set: per hash function, the least hashed shingle."""
        hashed = np.array(
            [int.from_bytes(hashlib.blake2b(g.encode(), digest_size=4).digest(), "little") for g in grams],
            dtype=np.uint64,
        )[None, :]
        return ((self.a * hashed + self.b) % np.uint64(_PRIME)).min(axis=1)  # a*x + b < 2^64: no overflow

    def add(self, text: str) -> bool:
        """Keep ``text`` unless it duplicates a kept one; return whether it was kept."""
        key = normalized(text)
        if key in self.exact:
            self.dropped["exact"] += 1
            return False
        grams = shingles(text)
        bands = np.split(self.signature(grams), self.bands)
        candidates = {
            i for band, bucket in zip(bands, self.buckets, strict=True) for i in bucket.get(band.tobytes(), [])
        }
        if any(jaccard(grams, self.kept[i]) >= self.threshold for i in candidates):
            self.dropped["near"] += 1
            return False
        self.exact.add(key)
        for band, bucket in zip(bands, self.buckets, strict=True):
            bucket.setdefault(band.tobytes(), []).append(len(self.kept))
        self.kept.append(grams)
        return True
