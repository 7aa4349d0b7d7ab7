"""What a run trains and is measured on: its examples, their loaders, and where the teacher's logits come from."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import BatchSampler, DataLoader, Sampler
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.distill import data as ddata
from draftsmith.distill import dataset_builder, dataset_cache, teacher_cache, vocab_cut
from draftsmith.distill.dataset_builder import ProcessGroup
from draftsmith.distill.losses import TopkTeacher
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import draftsmith_home, eos_token_ids
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.train.config import DistillConfig
from draftsmith.train.sharding import TeacherForward


@dataclass
class TeacherRows:
    """The teacher at a batch's M loss rows (the ``loss_mask`` positions in row-major order)."""

    log_probs: torch.Tensor | TopkTeacher  # (M, V), or (M, N) on a cut head's tokens: log p at the loss temperature
    hidden: dict[int, torch.Tensor] | None = None  # the target's hidden states (B, T, H) of layers asked for
    argmax: torch.Tensor | None = None  # (M,) the target's most probable token at the rows, when asked for


def build_examples(
    cfg: DistillConfig, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, accelerator: Accelerator
) -> tuple[list[dict], list[dict]]:
    """(train examples, held-out examples). The first ``heldout`` rows (after a seeded shuffle) are held out.

    In ``target`` mode the held-out prompts get the target's greedy answers (what greedy decoding
    will face), the training prompts ``generate.samples`` answers each with the generation settings.
    """
    folder = dataset_builder.built_folder(cfg.data.dataset)
    if folder is not None:
        return built_examples(cfg, folder)
    rows = ddata.load_rows(cfg.data.dataset, cfg.data.split, cfg.data.config)
    rows = ddata.map_columns(rows, cfg.data.column_map, cfg.data.dataset)
    if cfg.data.max_samples is not None:
        rows = rows.select(range(min(cfg.data.max_samples, len(rows))))
    rows = ddata.usable_rows(rows, cfg.data.mode, cfg.data.dataset, cfg.data.skip_bad_rows)
    if len(rows) <= cfg.data.heldout:
        raise DraftsmithError(
            f"dataset {cfg.data.dataset} has {len(rows)} rows; need more than heldout={cfg.data.heldout}"
        )
    rows = rows.shuffle(seed=cfg.seed)
    held_rows, train_rows = rows.select(range(cfg.data.heldout)), rows.select(range(cfg.data.heldout, len(rows)))
    if cfg.data.mode == "text":
        held = ddata.text_examples(held_rows, tokenizer, cfg.data.max_length)
        train_examples = ddata.text_examples(train_rows, tokenizer, cfg.data.max_length)
    else:
        held_prompts = encode_prompts(cfg, target, tokenizer, held_rows)
        train_prompts = [
            p for p in encode_prompts(cfg, target, tokenizer, train_rows) for _ in range(cfg.generate.samples)
        ]
        with accelerator.main_process_first():  # the main process generates, the others read the saved sets
            held_answers = target_answers(cfg, target, tokenizer, held_prompts, SamplingParams(), accelerator)
            train_answers = target_answers(cfg, target, tokenizer, train_prompts, generation(cfg), accelerator)
        held = ddata.target_examples(held_prompts, held_answers, cfg.data.max_length)
        train_examples = ddata.target_examples(train_prompts, train_answers, cfg.data.max_length)
    if not held or not train_examples:
        raise DraftsmithError(
            f"no usable {'held-out' if not held else 'training'} examples in {cfg.data.dataset} "
            "(rows with tokens to learn)"
        )
    return train_examples, held


def built_examples(cfg: DistillConfig, folder: Path) -> tuple[list[dict], list[dict]]:
    """(train, held-out) examples of a dataset folder written by ``draftsmith data``: the target's
    answers are already there, so nothing is generated. The first ``heldout`` rows after a seeded
    shuffle are held out (their answers were sampled with the dataset's own settings)."""
    dataset_builder.check_trusted(folder, cfg.target, cfg.data.allow_incomplete)
    examples = dataset_builder.training_examples(folder, cfg.data.max_length)
    if cfg.data.max_samples is not None:
        examples = examples[: cfg.data.max_samples]
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    examples = [examples[i] for i in order]
    if len(examples) <= cfg.data.heldout:
        raise DraftsmithError(
            f"dataset {folder} has {len(examples)} usable rows; need more than heldout={cfg.data.heldout}"
        )
    return examples[cfg.data.heldout :], examples[: cfg.data.heldout]


def generation(cfg: DistillConfig) -> SamplingParams:
    """How the target answers training prompts, and the draft its on-policy ones."""
    return SamplingParams(cfg.generate.temperature, 0, cfg.generate.top_p)


def encode_prompts(cfg: DistillConfig, target: PreTrainedModel, tokenizer, rows) -> list[list[int]]:
    """Chat-encoded prompts of ``rows``; prompts that leave no room for the answer are refused."""
    context = min(cfg.data.max_length, target.config.max_position_embeddings)
    prompts = ddata.encode_prompt_rows(rows, tokenizer, cfg.data.dataset)
    too_long = [len(p) for p in prompts if len(p) + cfg.generate.max_new_tokens > context]
    if too_long:
        raise DraftsmithError(
            f"{len(too_long)} prompts are too long: the longest has {max(too_long)} tokens, which with "
            f"generate.max_new_tokens={cfg.generate.max_new_tokens} exceeds max_length / context ({context}); raise "
            "max_length or lower generate.max_new_tokens"
        )
    return prompts


def target_name(cfg: DistillConfig) -> str:
    """The target as caches name it: ``tiny`` targets by their seed and config (each is another model)."""
    return cfg.target if cfg.target != "tiny" else f"tiny-{cfg.seed}-{sorted(cfg.tiny_target.items())}"


def target_answers(
    cfg: DistillConfig, target, tokenizer, prompts: list[list[int]], sampling: SamplingParams, accelerator: Accelerator
) -> list[list[int]]:
    """The target's answers to ``prompts``, generated once and cached under DRAFTSMITH_HOME."""
    eos = eos_token_ids(target, tokenizer)
    answering = ddata.Answering(
        cfg.generate.max_new_tokens, sampling, eos, batch_size=cfg.generate.batch_size, seed=cfg.seed
    )
    root = draftsmith_home() / "data"
    return ddata.cached_target_responses(
        root, target_name(cfg), target, prompts, answering, progress=accelerator.is_main_process
    )


class EpochSampler(Sampler[int]):
    """A shuffle whose order is a function of (seed, epoch) alone, so a resumed run sees the same data order.

    Epoch e's order is the (e+1)-th permutation drawn from a generator seeded with ``seed``, each
    preceded by one 64-bit draw: the draw torch's DataLoader makes from its generator for the
    workers' base seed, so epoch 0 is the order of ``DataLoader(shuffle=True, generator=...)``.
    Nothing is carried from one epoch to the next (a resumed process starts afresh).
    """

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epoch + 1):
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            order = torch.randperm(self.size, generator=generator)  # (size,)
        yield from order.tolist()


class LengthBucketSampler(BatchSampler):
    """Length-bucketed batches (``data.length_buckets``) whose order is a function of (seed, epoch)
    alone, like ``EpochSampler``'s, so a resumed run skipping the batches done sees the same ones.

    The windows cut the epoch's ``EpochSampler`` order; the batches are then shuffled with a generator
    seeded by the seed and the epoch (else the short sequences would come first). accelerate finds
    the epoch's setter on ``sampler``."""

    def __init__(self, lengths: list[int], batch_size: int, window: int, seed: int):
        super().__init__(EpochSampler(len(lengths), seed), batch_size, drop_last=False)
        self.lengths, self.window = lengths, window

    def __iter__(self):
        batches = ddata.length_buckets(list(self.sampler), self.lengths, self.batch_size, self.window)
        generator = torch.Generator().manual_seed(self.sampler.seed * 1_000_003 + self.sampler.epoch)
        for i in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[i]


def loaders(cfg: DistillConfig, train_examples: list[dict], heldout: list[dict], pad: int) -> tuple[DataLoader, ...]:
    """(training loader, shuffled per epoch with the run's seed, length-bucketed with ``data.bucket_batches``;
    held-out loader, sorted by length: its mean alpha does not depend on the order, its padding does)."""
    collate = functools.partial(ddata.collate, pad_id=pad)
    if cfg.data.bucket_batches:
        lengths = [len(e["input_ids"]) for e in train_examples]
        batches = LengthBucketSampler(lengths, cfg.optim.batch_size, cfg.data.bucket_batches, cfg.seed)
        train_loader = DataLoader(train_examples, batch_sampler=batches, collate_fn=collate)
    else:
        train_loader = DataLoader(
            train_examples,
            batch_size=cfg.optim.batch_size,
            sampler=EpochSampler(len(train_examples), cfg.seed),
            drop_last=False,
            collate_fn=collate,
        )
    by_length = sorted(heldout, key=lambda e: len(e["input_ids"]))
    held_loader = DataLoader(by_length, batch_size=cfg.optim.batch_size, collate_fn=collate)
    return train_loader, held_loader


@dataclass
class TeacherSettings:
    """What the teacher gives at the loss rows: over ``head_ids`` (N,) or the full vocabulary (None), at
    ``temperature``, normalized over the full vocabulary or not (forward KL with a cut head renormalizes
    over the kept tokens); ``layers``: the target layers whose entering hidden states (B, T, H) the
    draft's kind reads; ``device``: where the trainer wants them; ``argmax``: also the target's most
    probable token at each row (its whole vocabulary), for a kind that masks rows by it; ``sparse``: a
    store's log-probs may stay a ``TopkTeacher`` (the loss is forward KL and the kind does not read them)."""

    head_ids: torch.Tensor | None
    temperature: float
    full_normalizer: bool
    layers: tuple[int, ...]
    device: torch.device
    argmax: bool = False
    sparse: bool = False


class Teacher:
    """The teacher at a batch's loss rows: ``teacher(batch, rows (M,)) -> TeacherRows``. ``forwards``:
    the target forward passes it made for training batches; ``source``: live, store or filled (the
    store filled by the first epoch's live forwards); ``store``: the store's folder, if any. The target
    runs through ``forward``, sharded over the launch's processes or not (``train.sharding``)."""

    source = "live"
    store: Path | None = None

    def __init__(self, target: PreTrainedModel, settings: TeacherSettings, forward: TeacherForward | None = None):
        self.target, self.settings, self.forwards = target, settings, 0
        self.forward = forward or TeacherForward(target)

    @property
    def sharded(self) -> bool:
        return self.forward.sharded

    def __call__(self, batch: dict, rows: torch.Tensor) -> TeacherRows:
        return self.live(batch, rows)[0]

    def live(
        self, batch: dict, rows: torch.Tensor, argmax: bool = True, top_k: int = 0
    ) -> tuple[TeacherRows, tuple[torch.Tensor, torch.Tensor] | None]:
        """The target's forward over ``batch``: (the teacher at ``rows``, the head's top-``top_k`` (ids,
        log-probs), each (M, k), at temperature 1 when asked for, else None); ``argmax`` False leaves the
        argmax out even when the settings ask for it (the caller has it)."""
        self.forwards += 1
        s = self.settings

        def read(target: PreTrainedModel, out: vocab_cut.TargetRows):
            log_probs = vocab_cut.head_log_probs(target, out.hidden, s.head_ids, s.temperature, s.full_normalizer)
            best = vocab_cut.head_argmax(target, out.hidden).to(s.device) if s.argmax and argmax else None
            top = teacher_cache.head_top_k(target, out.hidden, top_k) if top_k else None
            # .to(): a target spread with teacher.device_map computes on its last device
            return TeacherRows(log_probs.to(s.device), out.layers, best), top

        return self.forward(batch, rows, s.layers, read)

    @property
    def runs_target(self) -> bool:
        """Whether a training step runs the target (a live teacher), rather than reading a store."""
        return True

    def epoch_end(self, accelerator: Accelerator) -> None:
        """Called before each epoch after the first (a filling teacher turns to its store)."""


class StoreTeacher(Teacher):
    """The teacher read from a feature store: top-k entries and hidden states of the training examples
    (``example["index"]`` is a batch row's place among them); the target is not run."""

    source = "store"
    runs_target = False

    def __init__(
        self,
        target: PreTrainedModel,
        settings: TeacherSettings,
        examples: list[dict],
        entries: dataset_cache.Entries,
        reader: teacher_cache.Store | None = None,
        folder: Path | None = None,
    ):
        super().__init__(target, settings)
        if settings.layers:  # a store read without hidden states has no reader
            reader.check_layers(settings.layers)
        self.reader, self.entries = reader, entries
        self.store = reader.folder if reader is not None else folder  # the store read (train_summary.json says it)
        self.digests = [teacher_cache.example_digest(e) for e in examples]
        for i, example in enumerate(examples):
            example["index"] = i  # the batch's rows are these entries

    def __call__(self, batch: dict, rows: torch.Tensor) -> TeacherRows:
        s, index = self.settings, batch["index"].tolist()
        vocab = self.target.config.vocab_size
        entries = [self.entries[i] for i in index]
        log_probs = teacher_cache.rows_teacher_log_probs(
            entries, rows.device, vocab, s.head_ids, s.temperature, s.sparse
        )
        argmax = teacher_cache.rows_teacher_argmax(entries, rows.device) if s.argmax else None
        if not s.layers:
            return TeacherRows(log_probs, None, argmax)
        width = batch["input_ids"].shape[1]
        hidden = self.reader.hidden([self.digests[i] for i in index], s.layers, width, self.target.dtype, rows.device)
        return TeacherRows(log_probs, hidden, argmax)


# rows a filling teacher holds before it writes them to a shard: its memory does not grow with the data
FILL_SHARD_ROWS = 256


class FillingTeacher(Teacher):
    """The live teacher for the first epoch, which writes what it computed into the store (each process
    its own shards, every ``FILL_SHARD_ROWS`` rows); from the second epoch the store is read (``epoch_end``)."""

    source = "filled"

    def __init__(
        self,
        target,
        settings: TeacherSettings,
        folder: Path,
        examples: list[dict],
        cfg: DistillConfig,
        pad: int,
        rank: int = 0,
        carried: tuple[dataset_cache.Entries, Path] | None = None,
    ):
        super().__init__(target, settings)
        self.store, self.examples, self.cfg, self.pad, self.rank = folder, examples, cfg, pad, rank
        # (the examples' top-k from the dataset's cache, in their order; that cache): the forwards then compute
        # the hidden states alone (no head), and the store keeps these entries beside them
        self.entries, self.carried_by = carried if carried is not None else (None, None)
        self.seen: dict[bytes, tuple] = {}  # digest -> (ids (N, k), log-probs (N, k), {layer: (L, H)})
        # this process's shards of the first epoch so far (a resumed run goes on numbering after them)
        self.written = len(list(folder.glob(f"shard-r{rank:03d}-[0-9]*.safetensors")))
        self.reading: StoreTeacher | None = None
        for i, example in enumerate(examples):
            example["index"] = i

    @property
    def runs_target(self) -> bool:
        return self.reading is None

    def __call__(self, batch: dict, rows: torch.Tensor) -> TeacherRows:
        if self.reading is not None:
            return self.reading(batch, rows)
        if self.entries is not None:
            teacher, (ids, logps) = self.hidden_states(batch, rows)
        else:
            teacher, (ids, logps) = self.live(batch, rows, argmax=False, top_k=self.cfg.teacher.top_k)  # (M, k)
        if self.settings.argmax:  # the top-k's first entry, as the store will give it: no second full head
            teacher.argmax = teacher_cache.rows_teacher_argmax([(ids, logps)], self.settings.device)
        counts = batch["loss_mask"].sum(1).tolist()
        lengths = batch["attention_mask"].sum(1).tolist()
        for row, i in enumerate(batch["index"].tolist()):
            hidden = {layer: teacher.hidden[layer][row, : lengths[row]].cpu() for layer in self.settings.layers}
            start = sum(counts[:row])
            entry = (ids[start : start + counts[row]], logps[start : start + counts[row]], hidden)
            self.seen[teacher_cache.example_digest(self.examples[i])] = entry
        if len(self.seen) >= FILL_SHARD_ROWS:
            self.flush()
        return teacher

    def hidden_states(self, batch: dict, rows: torch.Tensor) -> tuple[TeacherRows, tuple[torch.Tensor, torch.Tensor]]:
        """The target's decoder over ``batch`` for the hidden states of the settings' layers, its head not
        run: the log-probs at ``rows`` are the dataset cache's entries, also returned as (ids, log-probs) (M, k)."""
        self.forwards += 1
        s, given = self.settings, [self.entries[i] for i in batch["index"].tolist()]
        layers = self.forward(batch, rows, s.layers, lambda target, out: out.layers)
        vocab = self.target.config.vocab_size
        log_probs = teacher_cache.rows_teacher_log_probs(given, rows.device, vocab, s.head_ids, s.temperature, s.sparse)
        return TeacherRows(log_probs, layers), (torch.cat([e[0] for e in given]), torch.cat([e[1] for e in given]))

    def flush(self) -> None:
        """Write the rows seen since the last shard into this process's next shard, and forget them."""
        if not self.seen:
            return
        digests, dtype = list(self.seen), teacher_cache.STORAGE_DTYPES[self.cfg.teacher.cache_dtype]
        ids, logps = [self.seen[d][0] for d in digests], [self.seen[d][1] for d in digests]
        hidden = {layer: [self.seen[d][2][layer] for d in digests] for layer in self.settings.layers}
        self.store.mkdir(parents=True, exist_ok=True)
        teacher_cache.write_shard(
            self.store, f"r{self.rank:03d}-{self.written:05d}", digests, ids, logps, hidden, dtype
        )
        self.written += 1
        self.seen = {}

    def epoch_end(self, accelerator: Accelerator) -> None:
        """Write this process's shard of what the first epoch saw, complete the store (examples no process
        saw, e.g. after a resume within the first epoch, are computed now) and read it from here on."""
        if self.reading is not None:
            return
        rank, processes = accelerator.process_index, accelerator.num_processes
        dtype, layers = teacher_cache.STORAGE_DTYPES[self.cfg.teacher.cache_dtype], self.settings.layers
        self.store.mkdir(parents=True, exist_ok=True)
        self.flush()
        accelerator.wait_for_everyone()
        written = set(teacher_cache.stored_digests(self.store))
        missing = [
            e for e in teacher_cache.unique_examples(self.examples)[1] if teacher_cache.example_digest(e) not in written
        ]
        mine = missing[rank::processes]
        if mine:
            ids, logps, hidden = teacher_cache.chunk_features(
                self.target, mine, self.cfg.teacher.top_k, layers, self.cfg.optim.batch_size, self.pad
            )
            digests = [teacher_cache.example_digest(e) for e in mine]
            teacher_cache.write_shard(self.store, f"r{rank:03d}-rest", digests, ids, logps, hidden, dtype)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            made_by = store_made_by(self.cfg, self.target, self.examples, layers)
            if self.carried_by is not None:
                made_by["top_k_from"] = str(self.carried_by)  # the dataset's cache gave the top-k
            tokens = sum(sum(e["loss_mask"]) for e in self.examples)
            examples = len(written) + len(missing)
            teacher_cache.write_meta(self.store, examples, tokens, self.cfg.teacher.top_k, 0, made_by)
        accelerator.wait_for_everyone()
        self.seen = {}
        self.reading = from_store(self.target, self.settings, self.store, self.examples)


def store_made_by(cfg: DistillConfig, target: PreTrainedModel, examples: list[dict], layers: tuple[int, ...]) -> dict:
    """The fields of a store's meta.json that say how it was made (``teacher_cache.build`` writes the same)."""
    made_by = {
        "target": target.name_or_path,
        "target_key": target_name(cfg),
        "dtype": teacher_cache.dtype_name(target.dtype),
        "top_k": cfg.teacher.top_k,
        "content": teacher_cache.content_digest(teacher_cache.unique_examples(examples)[0]),
        "teacher_revision": teacher_cache.TEACHER_REVISION,
    }
    if layers:
        made_by |= {"layers": sorted(layers), "hidden_dtype": cfg.teacher.cache_dtype}
        made_by["hidden_size"] = target.config.hidden_size
    return made_by


def teacher_settings(
    cfg: DistillConfig,
    device: torch.device,
    head_ids: torch.Tensor | None = None,
    layers: tuple[int, ...] = (),
    argmax: bool = False,
    sparse: bool = False,
) -> TeacherSettings:
    """What a run's teacher gives at the loss rows, from what its kind reads: its log-probs over
    ``head_ids`` (N,) (the draft's head cut) or the full vocabulary, normalized over the full vocabulary
    unless the loss is forward KL (which renormalizes over the kept tokens, so a live target's full
    normalizer is never computed); the hidden states entering ``layers``; ``argmax``: the target's most
    probable token at the rows; ``sparse``: with forward KL, a store's log-probs stay top-k entries
    (``losses.TopkTeacher``) for a kind that does not read them."""
    forward_kl = cfg.loss.name == "forward_kl"
    return TeacherSettings(
        head_ids, cfg.loss.temperature, not forward_kl, layers, device, argmax, sparse and forward_kl
    )


def teacher(
    cfg: DistillConfig,
    target,
    examples: tuple[list[dict], list[dict]],
    pad: int,
    accelerator: Accelerator,
    settings: TeacherSettings,
) -> Teacher:
    """The teacher at a batch's loss rows (``settings``, made by ``teacher_settings``): the target's
    forward, or a store.

    examples: (train, held-out). A top-k cache the dataset carries (``draftsmith data --teacher-cache``;
    the shipped dataset's ships with it) serves a kind that reads no hidden states with no target
    forward at all; for one that does, the target's forwards give the hidden states alone. Else the
    feature store covers both (the dataset's content), so a run with another seed or held-out split of
    the same data reads the same store; one filled by the first epoch (``teacher.cache_fill:
    first_epoch``) covers the training examples. Under N processes each builds its share of the
    store's shards."""
    train_examples, heldout = examples
    if not cfg.teacher.cache:
        return Teacher(target, settings)
    layers = settings.layers
    carried = dataset_teacher_entries(cfg, target, train_examples, accelerator)
    if carried is not None and not layers:
        return StoreTeacher(target, settings, train_examples, carried[0], folder=carried[1])
    covered = train_examples if cfg.teacher.cache_fill == "first_epoch" else train_examples + heldout
    fmt = teacher_cache.StoreFormat(
        cfg.teacher.top_k,
        layers,
        teacher_cache.STORAGE_DTYPES[cfg.teacher.cache_dtype],
        shard_rows=min(256, -(-len(covered) // accelerator.num_processes)),  # a shard or more per process
    )
    folder = store_folder(cfg, target, covered, fmt)
    if cfg.teacher.cache_fill == "first_epoch" and not (folder / "meta.json").is_file():
        rank = accelerator.process_index
        return FillingTeacher(target, settings, folder, train_examples, cfg, pad, rank, carried)
    group = ProcessGroup(accelerator.process_index, accelerator.num_processes, accelerator.wait_for_everyone)
    name = target_name(cfg)
    teacher_cache.build(target, covered, folder, fmt, group, cfg.optim.batch_size, accelerator.is_main_process, name)
    return from_store(target, settings, folder, train_examples)


def store_folder(cfg: DistillConfig, target, covered: list[dict], fmt: teacher_cache.StoreFormat) -> Path:
    """Where the feature store of ``covered`` lives: a complete one found under DRAFTSMITH_HOME
    (``teacher_cache.find_store``: a store with more layers serves fewer), else one the dataset folder
    carries (``draftsmith data --hidden-layers``), else the folder a new one is written to."""
    name, k, layers, dtype = target_name(cfg), fmt.top_k, fmt.layers, fmt.hidden_dtype
    folder = teacher_cache.folder_for(name, target.dtype, covered, k, layers, dtype)
    folder = teacher_cache.find_store(folder, name, target.dtype, covered, k, layers, dtype)
    built = dataset_builder.built_folder(cfg.data.dataset)
    if built is not None and not (folder / "meta.json").is_file():
        carried = built / "feature-store" / "-"
        carried = teacher_cache.find_store(
            carried, teacher_cache.DATASET_TARGET, target.dtype, covered, k, layers, dtype
        )
        folder = carried if (carried / "meta.json").is_file() else folder
    return folder


def heldout_teacher(
    cfg: DistillConfig, target, training: Teacher, heldout: list[dict], head_ids: torch.Tensor | None, device
) -> StoreTeacher | None:
    """The teacher at the held-out rows read from the store the training teacher reads, when that store
    holds every held-out example (None: held-out metrics run the target). Its p is the stored top-k with
    the rest of the mass spread evenly, at temperature 1, over the head's tokens."""
    if not isinstance(training, StoreTeacher):
        return None
    layers = training.settings.layers
    settings = TeacherSettings(head_ids, 1.0, True, layers, device)
    if training.reader is not None:
        if any(teacher_cache.example_digest(e) not in training.reader.entries for e in heldout):
            return None
        return StoreTeacher(target, settings, heldout, training.reader.lookup(heldout), training.reader)
    carried = dataset_teacher_entries(cfg, target, heldout, None)
    if carried is None:
        return None
    entries, cache = carried
    return StoreTeacher(target, settings, heldout, entries, folder=cache)


def from_store(target, settings: TeacherSettings, folder: Path, examples: list[dict]) -> StoreTeacher:
    """The teacher read from the complete store in ``folder``."""
    reader = teacher_cache.Store(folder)
    return StoreTeacher(target, settings, examples, reader.lookup(examples), reader)


def dataset_teacher_entries(
    cfg: DistillConfig, target, examples: list[dict], accelerator: Accelerator | None
) -> tuple[dataset_cache.Entries, Path] | None:
    """``examples``' teacher entries from a top-k cache a ``draftsmith data`` folder carries (K >=
    teacher.top_k, computed in float32 or the run's teacher dtype, for the dataset as it is now:
    ``dataset_cache.dataset_entries``) and that cache's folder, or None: then the run's target teaches.
    ``accelerator``: the main process says where they come from (None: nothing is said)."""
    folder = dataset_builder.built_folder(cfg.data.dataset)
    if folder is None:
        return None
    dtype = teacher_cache.dtype_name(target.dtype)
    carried = dataset_cache.dataset_entries(folder, examples, dtype, cfg.teacher.top_k, cfg.data.max_length)
    if carried is not None and accelerator is not None:
        accelerator.print(
            f"teacher: top-{cfg.teacher.top_k} of {carried[1]} (the dataset's cache; no target forward for them)"
        )
    return carried
