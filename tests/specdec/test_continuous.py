"""Continuous batching gives each prompt exactly the target's own answer (fp32, CPU).

Greedy rows are compared token for token with ``target_generate`` run on each prompt alone; sampled
rows are compared by a chi-square fit with the target's exact distribution over the first two
tokens, computed here in float64 (temperature, top-k, top-p written out in the test).
"""

import pytest
import torch

from draftsmith.specdec.continuous import Batching, Progress, continuous_generate, stream_generate
from draftsmith.specdec.decoder import target_generate
from draftsmith.specdec.sampling import SamplingParams
from tests.helpers import chi_square_z, tiny_llama

V = 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are latency-bound: on a shared machine, OpenMP's thread barriers cost more than they save."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def attentive_llama(sharpness: float) -> torch.nn.Module:
    """A tiny Llama whose attention is peaked, not near uniform as at random init (queries and keys x8):
    its output then depends on which keys a row sees and at which positions, so a cache that mixes
    rows up, drops a prefix or shifts positions changes the answers."""
    model = tiny_llama(vocab=V, sharpness=sharpness)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def target():
    return attentive_llama(sharpness=8.0)


@pytest.fixture(scope="module")
def prompts():
    """23 prompts of 1 to 11 tokens, in no particular order."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 12, (23,), generator=gen).tolist()
    return [torch.randint(2, V, (n,), generator=gen).tolist() for n in lengths]


def alone(model, prompts, n, **kw):
    return [target_generate(model, [p], n, **kw)[0][0] for p in prompts]


@pytest.mark.parametrize("batch_size", [1, 3, 8, 64])
def test_greedy_rows_equal_each_prompt_decoded_alone(target, prompts, batch_size):
    expected = alone(target, prompts, 20)
    out, stats = continuous_generate(target, prompts, 20, Batching(batch_size=batch_size))
    assert out == expected
    assert stats.new_tokens == 23 * 20
    assert stats.batch_size == min(batch_size, 23)
    if batch_size < 23:
        assert stats.prefills > 1  # finished rows were refilled with queued prompts


@pytest.mark.parametrize("refill_at", [1, 2, 5])
def test_eos_midway_frees_rows_that_new_prompts_take(target, prompts, refill_at):
    eos = {7}
    expected = alone(target, prompts, 24, eos_ids=eos)
    lengths = [len(answer) for answer in expected]
    assert len(set(lengths)) > 3 and min(lengths) < 24, "the fixture should end answers at many points"
    out, stats = continuous_generate(target, prompts, 24, Batching(eos_ids=eos, batch_size=5, refill_at=refill_at))
    assert out == expected
    for answer in out:
        assert 7 not in answer[:-1]
    assert stats.new_tokens == sum(lengths)
    if refill_at == 1:  # every row is kept busy until the queue runs dry, not waiting for the longest answer
        assert stats.steps < sum(lengths) / 5 + 24


@pytest.mark.parametrize("batch_size", [3, 8])
def test_prompts_with_a_shared_prefix_take_it_from_one_computation(target, prompts, batch_size):
    system = [0, 9, 4, 17, 22, 5, 13]  # a chat template's system prompt, say
    chats = [system + p for p in prompts]
    expected = alone(target, chats, 16, eos_ids={7})
    out, stats = continuous_generate(target, chats, 16, Batching(eos_ids={7}, batch_size=batch_size, refill_at=2))
    assert out == expected
    assert 1 <= stats.prefix_forwards < stats.prefills  # computed once, then reused by later groups


def test_identical_prompts_share_all_but_their_last_token(target):
    opening = [0, 3, 8, 8, 21, 30, 2]  # prompts written from one opening
    params = SamplingParams(temperature=1.0)
    out, stats = continuous_generate(target, [opening] * 12, 10, Batching(params, batch_size=4), seeds=list(range(12)))
    assert stats.prefix_forwards == 1
    for seed, answer in enumerate(out):
        alone_out, _ = continuous_generate(target, [opening], 10, Batching(params, batch_size=1), seeds=[seed])
        assert answer == alone_out[0]


def test_one_new_token_finishes_every_row_at_its_prefill(target, prompts):
    out, stats = continuous_generate(target, prompts, 1, Batching(batch_size=4))
    assert out == alone(target, prompts, 1)
    assert stats.steps == 0
    assert stats.prefills == 6  # 23 prompts, 4 rows


def test_stream_yields_answers_as_they_complete_with_their_prompt_index(target, prompts):
    eos = {7}
    expected = alone(target, prompts, 24, eos_ids=eos)
    seen = list(stream_generate(target, prompts, 24, Batching(eos_ids=eos, batch_size=4)))
    assert sorted(index for index, _ in seen) == list(range(23))
    for index, answer in seen:
        assert answer == expected[index]


def test_progress_counts_tokens_and_rows_and_bounds_what_is_left(target, prompts):
    reports: list[Progress] = []
    out, stats = continuous_generate(
        target, prompts, 24, Batching(eos_ids={7}, batch_size=5), on_progress=reports.append
    )
    total = sum(len(a) for a in out)
    assert [r.tokens for r in reports] == sorted(r.tokens for r in reports)
    assert all(r.tokens <= total <= r.tokens_bound <= 23 * 24 for r in reports)
    assert (reports[-1].tokens, reports[-1].rows_done, reports[-1].rows_total) == (total, 23, 23)
    assert reports[-1].tokens_bound == total
    assert len(reports) == stats.prefills + stats.steps


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (smallest set reaching top_p), in float64: (V,) -> (V,)."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[:top_k]] = True
    top = probs * keep
    top = top / top.sum()
    mass = 0.0
    nucleus = torch.zeros(V, dtype=torch.bool)
    for token in order[:top_k].tolist():
        nucleus[token] = True
        mass += float(top[token])
        if mass >= top_p:
            break
    kept = top * nucleus
    return kept / kept.sum()


@torch.no_grad()
def exact_pair(model, prompt, temperature, top_k, top_p) -> torch.Tensor:
    """P(t1, t2 | prompt) as (V, V)."""
    first = reference_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1], temperature, top_k, top_p)
    inputs = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], 1)
    second = model(input_ids=inputs).logits[:, -1]
    return first[:, None] * torch.stack([reference_probs(row, temperature, top_k, top_p) for row in second])


@pytest.mark.parametrize(
    ("per_prompt_seeds", "short"),
    [(True, [0, 4, 9]), (False, [0, 4, 9]), (True, [0, 7, 7, 2, 5, 3, 4, 9])],  # the last: a shared prefix
)
def test_sampled_rows_follow_the_target_distribution(per_prompt_seeds, short):
    model = attentive_llama(sharpness=3.0)
    temperature, top_k, top_p = 0.8, 12, 0.9
    long = [0, 7, 7, 2, 5, 3, 11, 11]
    n = 2500
    prompts = [short if i % 2 else long for i in range(2 * n)]  # ragged: refills mix both
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    seeds = list(range(2 * n)) if per_prompt_seeds else None
    generator = torch.Generator().manual_seed(0)
    out, _ = continuous_generate(model, prompts, 2, Batching(params, batch_size=48), seeds=seeds, generator=generator)
    pairs = torch.tensor(out)  # (2n, 2)
    for prompt, samples in ((long, pairs[0::2]), (short, pairs[1::2])):
        joint = exact_pair(model, prompt, temperature, top_k, top_p)
        z_first = chi_square_z(torch.bincount(samples[:, 0], minlength=V), joint.sum(1))
        z_pair = chi_square_z(torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V), joint)
        assert z_first < 4 and z_pair < 4, (z_first, z_pair)


def test_seeded_answers_do_not_depend_on_the_batch(target, prompts):
    params = SamplingParams(temperature=1.0)
    seeds = [100 + i for i in range(len(prompts))]
    small, _ = continuous_generate(target, prompts, 12, Batching(params, batch_size=2), seeds=seeds)
    large, _ = continuous_generate(target, prompts, 12, Batching(params, batch_size=16), seeds=seeds)
    assert small == large
    other, _ = continuous_generate(target, prompts, 12, Batching(params, batch_size=16), seeds=[s + 1 for s in seeds])
    assert other != small


def test_bad_arguments_are_named(target):
    with pytest.raises(ValueError, match="max_new_tokens"):
        continuous_generate(target, [[1, 2]], 0)
    with pytest.raises(ValueError, match="at least one token"):
        continuous_generate(target, [[1], []], 4)
    with pytest.raises(ValueError, match="one seed per prompt"):
        continuous_generate(target, [[1], [2]], 4, seeds=[1])
