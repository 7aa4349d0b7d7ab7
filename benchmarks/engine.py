"""vLLM's measured speedup beside the bundled decoder's measured and predicted speedup, same pair.

For the default target and a draft (a model folder; default: the target's first 2 layers, untrained,
saved to a temporary folder), at each gamma and batch size:
- vLLM: the target alone vs the target with the draft (``measure.vllm_pair.measure_engine_pair``), two
  servers side by side, float32, eager (no torch.compile warm-up);
- the bundled decoder: ``measure.pair.evaluate_pair`` on the same prompts, its measured speedup and the
  speedup predicted from its alpha, c and v.
Then the target as its own draft (gamma 3, batch 1), where both must accept 100 %. Prompts are the
held-out evaluation prompts, repeated in order up to the largest batch size. Greedy decoding. Both
engines run the same number of CPU threads (--threads, default every core of this process).

Data generation (``draftsmith data``): answers' tokens/s of the bundled continuous-batching decoder
and of vLLM (a server as ``--engine vllm`` starts it: prefix caching on; eager unless --compile),
each through the engine object the data command uses, on the same distinct prompts (the training
then the held-out ones), the same sampling (temperature 0.7, the data command's default; one seed
per prompt), the same max_new_tokens and batch size (rows decoded together; requests in flight),
after a short warm-up. Tokens are the answers' own, EOS included; the clock runs from the first
prompt sent to the last answer back.

Run: .venv/bin/python benchmarks/engine.py [--draft FOLDER] [--gammas 1,2,3,4] [--batch-sizes 1,16]
(needs `make vllm`). Writes benchmarks/results/engine.json and engine_data_generation.json;
--data-only measures only the data generation (64 prompts, 128 tokens, batch 64 by default). On
our 2 cores, shared with other jobs (load 7-10), the defaults with --threads 1 took 30 minutes, most
of it the bundled decoder at batch 16 and the six vLLM server starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from common import PROMPTS, default_target, save

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.distill.engines import BundledEngine, VllmEngine
from draftsmith.distill.self_prompts import derived_seed
from draftsmith.specdec.loading import DEFAULT_TARGET, cpu_has_native_bfloat16, load_model
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.measure.vllm_pair import measure_engine_pair
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat, read_prompts
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.vllm_client import served_model
from draftsmith.specdec.vllm_server import ServeOptions, serve

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_facts() -> dict:
    """What decides CPU speed here: the model name, cores, the vector flags, the load when measured."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return {
        "cpu": name or platform.processor(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "flags": {flag: flag in flags for flag in CPU_FLAGS},
        "native_bfloat16": cpu_has_native_bfloat16(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_at_start": os.getloadavg(),
    }


def held_out_prompts(count: int):
    """``count`` held-out prompts (repeated in order when there are fewer), one category, so batches fill."""
    prompts = read_prompts(PROMPTS)
    return [dataclasses.replace(prompts[i % len(prompts)], category="all") for i in range(count)]


def bundled_row(target, draft, tokenizer, eos, prompts, gamma: int, batch_size: int, args) -> dict:
    report = evaluate_pair(
        target,
        draft,
        tokenizer,
        MeasureSettings(
            prompts,
            options=DecodeOptions(gamma=gamma),
            max_new_tokens=args.max_new_tokens,
            eos_ids=eos,
            repeats=args.repeats,
            batch_size=batch_size,
            progress=False,
        ),
    ).to_json()
    keys = ("acceptance_rate", "mean_accepted_tokens", "target_tokens_per_s", "spec_tokens_per_s", "speedup")
    keys += ("predicted_speedup", "cost_ratio_c", "verify_ratio_v", "greedy_match", "speedup_per_repeat")
    return {key: report[key] for key in keys}


def engine_row(baseline, speculative, prompt_ids: list[list[int]], batch_size: int, args) -> dict:
    report = measure_engine_pair(
        baseline, speculative, prompt_ids, max_tokens=args.max_new_tokens, batch_size=batch_size, repeats=args.repeats
    ).to_json()
    keys = ("acceptance_rate", "acceptance_per_position", "mean_accepted_tokens", "target_tokens_per_s")
    keys += ("spec_tokens_per_s", "speedup", "speedup_spread", "greedy_match", "drafts", "proposed", "accepted")
    return {key: report[key] for key in keys}


def draft_pair(spec: str | None, target, tokenizer, folder: Path) -> tuple[torch.nn.Module, str, str]:
    """(draft model, its folder for vLLM, a description): ``spec`` loaded, or the 2-layer truncation saved."""
    if spec is not None:
        return load_model(spec, torch.device("cpu"), torch.float32), spec, spec
    draft = truncate_target(target, 2)
    draft.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return draft, str(folder), "the target's first 2 layers, untrained"


def generation_rate(engine, prompts: list[list[int]], max_new_tokens: int, eos: frozenset[int]) -> dict:
    """One pass of an engine over ``prompts`` as ``draftsmith data`` runs it: answers' tokens/s."""
    sampling = SamplingParams(temperature=0.7)
    seeds = [derived_seed(0, "engine-benchmark", i) for i in range(len(prompts))]
    for _ in engine.stream(prompts[: min(8, len(prompts))], 8, sampling, eos, seeds[: min(8, len(prompts))]):
        pass  # first requests and forwards pay for allocations
    start = time.perf_counter()
    answers = dict(engine.stream(prompts, max_new_tokens, sampling, eos, seeds))
    seconds = time.perf_counter() - start
    tokens = sum(len(a) for a in answers.values())
    finished = sum(bool(a) and a[-1] in eos for a in answers.values())
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": tokens / seconds, "finished_rows": finished}


def data_generation(target, tokenizer, eos, threads: int, args) -> dict:
    """The bundled decoder vs vLLM generating dataset answers at equal settings (see the module docstring)."""
    records = read_prompts(Path(__file__).parents[1] / "distill" / "data" / "prompts.jsonl") + read_prompts(PROMPTS)
    if len(records) < args.data_prompts:
        raise SystemExit(f"--data-prompts {args.data_prompts}: only {len(records)} distinct prompts are shipped")
    prompts = [encode_chat(tokenizer, r.turns[0]) for r in records[: args.data_prompts]]
    ours = generation_rate(BundledEngine(target, args.data_batch_size), prompts, args.data_max_new_tokens, eos)
    print(f"data generation, bundled decoder: {ours['tokens_per_s']:.1f} tokens/s")
    options = ServeOptions(dtype="float32", eager=not args.compile, threads=threads, prefix_caching=True)
    with serve(DEFAULT_TARGET, options) as server:
        engine = VllmEngine(server, served_model(server)["max_model_len"], args.data_batch_size)
        theirs = generation_rate(engine, prompts, args.data_max_new_tokens, eos)
        settings = {key: server.settings[key] for key in ("eager", "prefix_caching", "environment", "command")}
    print(f"data generation, vLLM: {theirs['tokens_per_s']:.1f} tokens/s")
    return {
        "prompts": len(prompts),
        "batch_size": args.data_batch_size,
        "max_new_tokens": args.data_max_new_tokens,
        "temperature": 0.7,
        "threads": threads,
        "dtype": "float32",
        "bundled": ours,
        "vllm": theirs,
        "vllm_over_bundled": theirs["tokens_per_s"] / ours["tokens_per_s"],
        "vllm_server": settings,
    }


def table(rows: list[dict]) -> str:
    head = (
        f"{'gamma':>5}{'batch':>6} | {'vLLM alpha':>10}{'tau':>6}{'target t/s':>11}{'spec t/s':>9}"
        f"{'speedup':>8}{'spread':>12} | {'ours alpha':>10}{'tau':>6}{'speedup':>8}{'predicted':>10}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        e, b = row["vllm"], row["bundled"]
        spread = f"{e['speedup_spread'][0]:.2f}-{e['speedup_spread'][1]:.2f}"
        lines.append(
            f"{row['gamma']:>5}{row['batch_size']:>6} | {e['acceptance_rate']:>10.3f}{e['mean_accepted_tokens']:>6.2f}"
            f"{e['target_tokens_per_s']:>11.1f}{e['spec_tokens_per_s']:>9.1f}{e['speedup']:>8.2f}{spread:>12} | "
            f"{b['acceptance_rate']:>10.3f}{b['mean_accepted_tokens']:>6.2f}{b['speedup']:>8.2f}"
            f"{b['predicted_speedup']:>10.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=None, help="a draft model folder (default: the 2-layer truncation)")
    parser.add_argument("--gammas", default="1,2,3,4")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--batch1-prompts", type=int, default=4, help="prompts measured at batch size 1")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="let vLLM torch.compile (minutes per server here)")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads of both engines (default: every core of this process)"
    )
    parser.add_argument("--data-only", action="store_true", help="measure only the data generation")
    parser.add_argument("--data-prompts", type=int, default=64, help="data generation: distinct prompts")
    parser.add_argument("--data-batch-size", type=int, default=64, help="data generation: rows / requests in flight")
    parser.add_argument("--data-max-new-tokens", type=int, default=128, help="data generation: answer length limit")
    args = parser.parse_args()
    gammas = [int(g) for g in args.gammas.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    started = time.perf_counter()
    facts = cpu_facts()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    target, tokenizer, eos = default_target()
    if args.data_only:
        save_data_generation(data_generation(target, tokenizer, eos, threads, args), facts, started)
        return
    prompts = held_out_prompts(max(sizes + [args.batch1_prompts]))

    def chosen(size: int):
        return prompts[: args.batch1_prompts] if size == 1 else prompts[:size]

    rows = [{"gamma": g, "batch_size": b} for g in gammas for b in sizes]
    with tempfile.TemporaryDirectory() as tmp:
        draft, draft_folder, described = draft_pair(args.draft, target, tokenizer, Path(tmp) / "draft")
        # The bundled decoder first, with no vLLM process alive; then vLLM. Each speedup is a ratio
        # measured side by side within one engine.
        for row in rows:
            size = row["batch_size"]
            row["bundled"] = bundled_row(target, draft, tokenizer, eos, chosen(size), row["gamma"], size, args)
            print(f"bundled gamma={row['gamma']} batch={row['batch_size']}: speedup {row['bundled']['speedup']:.2f}")
        self_bundled = bundled_row(target, target, tokenizer, eos, chosen(1), 3, 1, args)
        ids = {size: [encode_chat(tokenizer, p.turns[0]) for p in chosen(size)] for size in sizes}
        options = ServeOptions(dtype="float32", eager=not args.compile, kv_cache_gib=2, threads=threads)
        draft_config = {"method": "draft_model", "model": draft_folder}
        with serve(DEFAULT_TARGET, options) as baseline:
            for gamma in gammas:
                with serve(DEFAULT_TARGET, options, speculative=draft_config, gamma=gamma) as speculative:
                    for row in (r for r in rows if r["gamma"] == gamma):
                        row["vllm"] = engine_row(baseline, speculative, ids[row["batch_size"]], row["batch_size"], args)
                        print(f"vLLM gamma={gamma} batch={row['batch_size']}: speedup {row['vllm']['speedup']:.2f}")
            self_config = {"method": "draft_model", "model": DEFAULT_TARGET}
            with serve(DEFAULT_TARGET, options, speculative=self_config, gamma=3) as speculative:
                self_engine = engine_row(baseline, speculative, ids[1], 1, args)
            server = baseline.settings
    facts["load_average_at_end"] = os.getloadavg()
    result = {
        "target": DEFAULT_TARGET,
        "draft": described,
        "dtype": "float32",
        "threads": threads,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "prompts_per_batch_size": {str(size): len(chosen(size)) for size in sizes},
        "machine": facts,
        "vllm_server": {key: server[key] for key in ("eager", "environment", "command")},
        "rows": rows,
        "target_as_its_own_draft": {"gamma": 3, "batch_size": 1, "vllm": self_engine, "bundled": self_bundled},
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(table(rows))
    print(
        f"target as its own draft, gamma 3: vLLM alpha {self_engine['acceptance_rate']:.3f} "
        f"speedup {self_engine['speedup']:.2f}; ours alpha {self_bundled['acceptance_rate']:.3f} "
        f"speedup {self_bundled['speedup']:.2f} (predicted {self_bundled['predicted_speedup']:.2f})"
    )
    save("engine", result)
    save_data_generation(data_generation(target, tokenizer, eos, threads, args), cpu_facts(), time.perf_counter())


def save_data_generation(result: dict, facts: dict, started: float) -> None:
    """Print the data-generation line and write its results (``save`` adds the machine it ran on)."""
    result.update(target=DEFAULT_TARGET, cpu_flags=facts["flags"], seconds=round(time.perf_counter() - started, 1))
    result.update(load_average_at_start=facts["load_average_at_start"], load_average_at_end=os.getloadavg())
    print(
        f"data generation, {result['prompts']} prompts x {result['max_new_tokens']} tokens at batch "
        f"{result['batch_size']}: vLLM {result['vllm']['tokens_per_s']:.1f} tokens/s, bundled decoder "
        f"{result['bundled']['tokens_per_s']:.1f} tokens/s ({result['vllm_over_bundled']:.2f}x)"
    )
    save("engine_data_generation", result)


if __name__ == "__main__":
    main()
