"""Measure a (target, draft) pair: acceptance, tau, real speedup, and the speedup theory predicts.

Speedup is spec tokens/s over target-only tokens/s on the same prompts, the same
``max_new_tokens`` and stop rules, the same cache kind, after a warm-up, with the two decoders
interleaved batch by batch and the median over repeats taken (``runs``). The baseline is
``decoder.target_generate``, a KV-cached decoder at least as fast as ``transformers`` ``generate``
(``benchmarks/decoder_vs_hf.py``), so the speedup is not inflated by a slow reference.

In compiled mode (``DecodeOptions.compile``, by default on CUDA) both decoders run compiled, and
the warm-up compiles and captures every graph before anything is timed: its seconds are reported
as ``compile_s``, apart from every tokens/s.

The cost ratios come from the same runs (``costs.step_costs``). With a token tree
(``DecodeOptions.tree``) the report adds the nodes verified per round.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.specdec.compiled import compiled_graphs
from draftsmith.specdec.decoder import decodes_compiled
from draftsmith.specdec.drafters import round_forwards
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.measure.figures import report_from_repeats
from draftsmith.specdec.measure.hf_compare import HFComparison, configure_assistant
from draftsmith.specdec.measure.report import Compiled, MeasuredUnder, PairReport
from draftsmith.specdec.measure.runs import PairRun, run_repeats, warm_up, warm_up_sizes
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.verify import tune_verify_widths


def evaluate_pair(
    target: PreTrainedModel,
    draft: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    settings: MeasureSettings,
    *,
    compare_hf: HFComparison | None = None,
    tune_verify: bool = True,
) -> PairReport:
    """Run the baseline and the speculative decoder side by side; return the report.

    settings: what is measured; ``settings.options`` is how the speculative decoder decodes (its
    sampling is the baseline's too); the target-only baseline is timed here, interleaved with the
    pair batch by batch, whatever was measured before. compare_hf: stock copies of the pair to time
    ``transformers`` on too; the assistant's generation config is set to draft ``options.gamma``
    tokens per round (``configure_assistant``), and the rounds are checked. tune_verify: at batch size
    1 and without widths in the options, pad verification passes to the widths
    ``verify.tune_verify_widths`` finds faster on this machine. The report says whether the decoders
    ran compiled (``compile``), and then the warm-up's seconds (``compile_s``) and the graphs it compiled.
    """
    if compare_hf is not None and settings.batch_size != 1:
        raise DraftsmithError("--compare-hf needs --batch-size 1: transformers' assisted generation takes one sequence")
    options = settings.options
    compiled = decodes_compiled(target, draft, options)
    options = dataclasses.replace(options, compile=compiled)  # the baseline decodes as the pair does
    start, graphs = time.perf_counter(), compiled_graphs()
    if tune_verify and settings.batch_size == 1 and not options.verify_widths and options.tree is None:
        widths = tune_verify_widths(target, options.gamma + 1, compiled=compiled)
        options = dataclasses.replace(options, verify_widths=widths)
    settings = dataclasses.replace(settings, options=options)
    pair = PairRun(target, draft, tokenizer, settings)
    warm = pair.encode(settings.prompts[0], settings.prompts[0].turns[0])
    warm_up(pair, warm, warm_up_sizes(settings, compiled))
    compiled_report = (
        Compiled(True, time.perf_counter() - start, compiled_graphs() - graphs) if compiled else Compiled()
    )

    if compare_hf is not None:
        configure_assistant(compare_hf.assistant.generation_config, options.gamma)
        HFComparison(compare_hf.target, compare_hf.assistant).time_prompt(warm, settings)  # warm-up, not counted
    greedy_matches: list[bool] = []
    repeat_tallies, per_cat = run_repeats(pair, compare_hf, greedy_matches)
    tree = options.tree is not None
    forwards = round_forwards(draft, options.gamma)
    report = report_from_repeats(repeat_tallies, per_cat, compare_hf, greedy_matches, options.gamma, tree, forwards)
    return dataclasses.replace(report, under=measured_under(settings), compiled=compiled_report)


def measured_under(settings: MeasureSettings) -> MeasuredUnder:
    """The settings a report was measured under."""
    options = settings.options
    return MeasuredUnder(
        gamma=options.gamma,
        tree=options.tree.text if options.tree is not None else None,
        batch_size=settings.batch_size,
        max_new_tokens=settings.max_new_tokens,
        repeats=settings.repeats,
        prompts=len(settings.prompts),
        temperature=options.sampling.temperature,
        top_k=options.sampling.top_k,
        top_p=options.sampling.top_p,
        verify_widths={str(q): w for q, w in options.verify_widths.items()},
    )
