"""Quality filters and exact / near-duplicate removal for self-written prompts."""

import pytest

from draftsmith.distill.prompt_filters import Deduplicator, PromptFilter, jaccard, normalized, shingles
from draftsmith.specdec.errors import DraftsmithError


def test_dedup_drops_exact_and_near_duplicates_and_keeps_distinct_prompts():
    texts = [
        "How do I reverse a list in Python?",
        "how do I reverse a list in PYTHON",  # exact after normalization (case, punctuation)
        "How do I   reverse a list, in Python?!",  # exact after normalization (spaces, punctuation)
        "Write a short poem about the sea at night and the stars above it.",
        "Write a short poem about the sea at night and the stars above us.",  # near: one word differs
        "How do I reverse a linked list in C without recursion?",  # shares words, but another question
        "What is the capital of France?",
        "Explain how photosynthesis works in plants.",
        "Summarize the following paragraph about the history of Rome in three sentences.",
        "Summarize the following paragraph about the history of Rome in three sentences, please.",  # near
    ]
    dedup = Deduplicator()
    kept = [text for text in texts if dedup.add(text)]
    assert kept == [texts[0], texts[3], texts[5], texts[6], texts[7], texts[8]]
    assert dedup.dropped == {"exact": 2, "near": 2}


def test_near_duplicate_threshold_is_the_word_trigram_jaccard():
    a = "Write a short poem about the sea at night and the stars above it."
    b = "Write a short poem about the sea at night and the stars above us."
    similarity = jaccard(shingles(a), shingles(b))
    assert similarity == pytest.approx(11 / 13)  # 12 trigrams each, 11 shared
    strict = Deduplicator(threshold=0.9)
    strict.add(a)
    assert strict.add(b)  # 0.85 < 0.9: kept
    loose = Deduplicator(threshold=0.8)
    loose.add(a)
    assert not loose.add(b)


def test_many_distinct_prompts_are_all_kept():
    dedup = Deduplicator()
    texts = [f"What is {a} times {b}, and how would you check the result by hand?" for a in range(30) for b in (7, 9)]
    # Two numbers change in a 14-word question: trigram overlap stays below the 0.7 threshold.
    assert sum(dedup.add(t) for t in texts) == len(texts)


def test_normalized_text_ignores_case_punctuation_and_spacing():
    assert normalized("  Hello,   WORLD!! It's me. ") == "hello world it's me"


@pytest.mark.parametrize(
    ("text", "finished", "reason"),
    [
        ("How do I sort a dictionary by value in Python?", True, None),
        ("Write a haiku about autumn leaves.", True, None),
        ("I need help planning a trip to Japan.", True, None),
        ("How do I sort a dictionary by value in", False, "unfinished"),
        ("Why?", True, "too_short"),
        ("Hello there", True, "too_short"),
        ("the cat and the dog " * 3, True, "repetitive"),
        ("The weather was nice yesterday and we went for a walk.", True, "not_a_request"),
        ("It is important to be prepared for the unexpected.", True, "not_a_request"),
        ("The weather was nice yesterday, was it not?", True, None),  # a question mark makes it a question
    ],
)
def test_filters_name_why_a_prompt_is_dropped(text, finished, reason):
    assert PromptFilter().reject(text, finished) == reason


def test_filter_limits_are_configurable_and_checked():
    long = "Please explain " + "very " * 20 + "clearly."
    assert PromptFilter(max_words=10).reject(long, True) == "too_long"
    assert PromptFilter(max_repeated_ngrams=1.0).reject(long, True) is None
    assert PromptFilter(require_request=False).reject("The sky is blue today.", True) is None
    with pytest.raises(DraftsmithError, match="word limits"):
        PromptFilter(min_words=5, max_words=2)
