"""The pair runner: both decoders over every turn of every prompt, batch by batch, repeat by repeat.

The target-only decoder (``decoder.target_generate``) and the speculative decoder run interleaved
batch by batch with the same seed, so a load change on a shared machine hits both alike and, when
sampling, both see the same draws. Batches never mix categories, so per-category timing is exact.
The target-only runs are timed as plain decoding runs fastest (one row per step of one sequence);
the greedy check holds the speculative output to the row-exact target it reproduces
(``greedy_identical``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.specdec.decoder import DecodeStats, speculative_generate, target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.measure.hf_compare import HFComparison
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.measure.tally import Tally
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import Prompt, check_length, encode_chat
from draftsmith.specdec.stream import needs_row_padding


@dataclass
class PairRun:
    """The pair under measurement, the settings both decoders share, and the generator they draw from."""

    target: PreTrainedModel
    draft: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    settings: MeasureSettings
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator(device=self.target.device)

    def encode(self, prompt: Prompt, history: list[dict]) -> list[int]:
        ids = encode_chat(self.tokenizer, history, prompt.text if len(prompt.turns) == 1 else None)
        check_length(ids, self.settings.max_new_tokens, self.target.config.max_position_embeddings, prompt.id)
        return ids

    def run_target(self, batch_ids: list[list[int]]) -> tuple[list[list[int]], DecodeStats]:
        options = self.settings.options
        return guard_memory(
            lambda: target_generate(
                self.target,
                batch_ids,
                self.settings.max_new_tokens,
                options=options,
                eos_ids=self.settings.eos_ids,
                generator=self.generator,
            ),
            len(batch_ids),
        )

    def greedy_identical(
        self, batch_ids: list[list[int]], base_out: list[list[int]], spec_out: list[list[int]]
    ) -> list[bool]:
        """``greedy_identical`` with this pair's target and settings."""
        settings, options = self.settings, self.settings.options
        return greedy_identical(
            self.target,
            batch_ids,
            settings.max_new_tokens,
            settings.eos_ids,
            base_out,
            spec_out,
            cache_kind=options.cache_kind,
            compile=options.compile,
        )

    def run_spec(self, batch_ids: list[list[int]]) -> tuple[list[list[int]], DecodeStats]:
        return guard_memory(
            lambda: speculative_generate(
                self.target,
                self.draft,
                batch_ids,
                self.settings.max_new_tokens,
                options=self.settings.options,
                eos_ids=self.settings.eos_ids,
                generator=self.generator,
            ),
            len(batch_ids),
        )


def greedy_identical(
    target: PreTrainedModel,
    batch_ids: list[list[int]],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    base_out: list[list[int]],
    spec_out: list[list[int]],
    cache_kind: str | None = None,
    compile: bool | None = None,
) -> list[bool]:
    """Whether each speculative output of a batch is the target's greedy output. The timed baseline
    (``base_out``) steps one sequence one row at a time, the fastest plain decoding; the speculative
    decoder reproduces the row-exact target (``decoder.target_generate``'s ``row_exact``). The two
    differ only in 16-bit dtypes where a near-tie meets the last bit of a product, so where an
    output differs from the baseline's, an untimed row-exact run of the target decides."""
    same = [spec == base for spec, base in zip(spec_out, base_out, strict=True)]
    if all(same) or len(batch_ids) > 1 or not needs_row_padding(target):
        return same
    options = DecodeOptions(cache_kind=cache_kind, compile=compile)
    reference, _ = target_generate(target, batch_ids, max_new_tokens, options, eos_ids=eos_ids, row_exact=True)
    return [spec == ref for spec, ref in zip(spec_out, reference, strict=True)]


def batches(prompts: list[Prompt], batch_size: int) -> list[list[int]]:
    """Prompt indices grouped by category, then cut into batches (so per-category timing is exact)."""
    by_category: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_category[p.category].append(i)
    cut = []
    for indices in by_category.values():
        cut += [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    return cut


def warm_up_sizes(settings: MeasureSettings, compiled: bool) -> set[int]:
    """The batch sizes a warm-up must run: every size the prompts' batches take when compiled (each
    size is its own graphs), else the batch size alone."""
    if not compiled:
        return {settings.batch_size}
    return {len(batch) for batch in batches(settings.prompts, settings.batch_size)}


def warm_up(pair: PairRun, ids: list[int], batch_sizes: set[int]) -> None:
    """Both decoders on ``ids`` at each of ``batch_sizes``: the first
    calls pay for allocator growth and kernel selection, and in compiled mode for compiling and
    capturing the graphs of each batch size."""
    for size in sorted(batch_sizes):
        pair.generator.manual_seed(pair.settings.seed)
        pair.run_target([ids] * size)
        pair.run_spec([ids] * size)


def run_repeats(
    pair: PairRun,
    hf: HFComparison | None = None,
    greedy_matches: list[bool] | None = None,
) -> tuple[list[dict[str, Tally]], dict[str, dict[str, Tally]]]:
    """Every repeat (``run_repeat``) under one progress bar: each repeat's tallies, and the tallies per
    category over all of them. The first repeat records greedy identity."""
    settings = pair.settings
    prompts = settings.prompts
    per_cat: dict[str, dict[str, Tally]] = defaultdict(lambda: {"target": Tally(), "spec": Tally()})
    total = settings.repeats * max(len(p.turns) for p in prompts) * len(batches(prompts, settings.batch_size))
    with tqdm(total=total, desc="eval", disable=not settings.progress, unit="batch") as bar:
        tallies = [
            run_repeat(
                pair,
                settings.seed + rep,
                per_cat,
                hf,
                greedy_matches if rep == 0 else None,
                bar,
            )
            for rep in range(settings.repeats)
        ]
    return tallies, per_cat


def run_repeat(
    pair: PairRun,
    seed: int,
    per_cat: dict[str, dict[str, Tally]],
    hf: HFComparison | None,
    greedy_matches: list[bool] | None,
    bar: tqdm,
) -> dict[str, Tally]:
    """One pass over every turn of every prompt, both decoders batch by batch; later turns see the
    target's earlier answers. Returns this repeat's tallies; also adds to ``per_cat`` and ``hf``,
    and appends to ``greedy_matches`` (when given, in greedy runs) whether each output is the target's."""
    prompts = pair.settings.prompts
    tally = {"target": Tally(), "spec": Tally()}
    answers: dict[int, list[dict]] = {i: [] for i in range(len(prompts))}  # conversation so far
    for turn in range(max(len(p.turns) for p in prompts)):
        todo = [p for p in range(len(prompts)) if len(prompts[p].turns) > turn]
        for batch in batches([prompts[i] for i in todo], pair.settings.batch_size):
            indices = [todo[i] for i in batch]
            ids = [pair.encode(prompts[i], answers[i] + prompts[i].turns[turn]) for i in indices]
            # Same seed for both decoders: with sampling, the pair sees the same draws.
            pair.generator.manual_seed(seed)
            base_out, base_stats = pair.run_target(ids)
            pair.generator.manual_seed(seed)
            spec_out, spec_stats = pair.run_spec(ids)
            category = prompts[indices[0]].category
            tally["target"].outputs.append(base_out)
            for name, stats in (("target", base_stats), ("spec", spec_stats)):
                tally[name].add(stats)
                per_cat[category][name].add(stats)
            if greedy_matches is not None and pair.settings.options.sampling.greedy:
                greedy_matches += pair.greedy_identical(ids, base_out, spec_out)
            for row, i in enumerate(indices):
                reply = pair.tokenizer.decode(base_out[row], skip_special_tokens=True)
                answers[i] = answers[i] + prompts[i].turns[turn] + [{"role": "assistant", "content": reply}]
            for row_ids in ids if hf is not None else []:
                hf.time_prompt(row_ids, pair.settings)
            bar.update(1)
            bar.set_postfix(speedup=f"{tally['spec'].tokens_per_s / max(tally['target'].tokens_per_s, 1e-9):.2f}")
    return tally


def guard_memory(run, batch_size: int):
    """``run()``, turning an out-of-memory error into advice on the batch size."""
    try:
        return run()
    except torch.OutOfMemoryError as err:
        raise DraftsmithError(
            f"out of memory at batch size {batch_size}; try --batch-size {max(1, batch_size // 2)}"
        ) from err
