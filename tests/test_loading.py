"""What a target's load reads and skips: config.json once through transformers and then from d3d's
cache, a generic tokenizer through its own class — each giving what transformers' Auto classes give —,
a GGUF parsed once while it is converted, and no compiler imported to build an empty decoder."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

import d3d.loading
from conftest import tiny_config
from d3d.config import ModelConfig
from d3d.loading import read_config, read_tokenizer, tokenizer_class

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("D3D_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def auto_config_reads(monkeypatch) -> list:
    """Each folder transformers' AutoConfig reads from here on."""
    reads, read = [], transformers.AutoConfig.from_pretrained

    def counted(folder, *args, **kwargs):
        reads.append(folder)
        return read(folder, *args, **kwargs)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", counted)
    return reads


def write_config(folder, **overrides) -> None:
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, **overrides).save_pretrained(folder)


def test_a_config_is_read_by_transformers_once_then_from_the_cache(tmp_path, cache, auto_config_reads):
    folder = tmp_path / "model"
    write_config(folder, rms_norm_eps=1e-5)
    first = read_config(folder)
    assert auto_config_reads == [folder] and first == ModelConfig.from_hf(LlamaConfig.from_pretrained(folder))
    assert read_config(folder) == first and len(auto_config_reads) == 1  # from the cache
    write_config(folder, rms_norm_eps=1e-6)  # another file, another key
    assert read_config(folder).rms_norm_eps == 1e-6 and len(auto_config_reads) == 2
    for stored in (cache / "configs").iterdir():  # a damaged cache entry is read again, not trusted
        stored.write_text("{")
    assert read_config(folder).rms_norm_eps == 1e-6 and len(auto_config_reads) == 3


def test_an_unreadable_cache_still_loads(tmp_path, cache, auto_config_reads):
    cache.write_text("a file where the cache folder would be")
    folder = tmp_path / "model"
    write_config(folder)
    assert read_config(folder) == read_config(folder) and len(auto_config_reads) == 2


def tokenizer_folder(folder):
    vocab = {word: i for i, word in enumerate(["<unk>", "</s>", "<|user|>", "hello", "world", "there", "!"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_a_generic_tokenizer_is_read_by_its_class_as_auto_tokenizer_reads_it(tmp_path):
    folder = tokenizer_folder(tmp_path / "model")
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] in d3d.loading.GENERIC_TOKENIZERS
    assert tokenizer_class(folder) is PreTrainedTokenizerFast
    auto, (ours, eos) = AutoTokenizer.from_pretrained(folder), read_tokenizer(folder)
    assert type(ours) is type(auto) and eos == [auto.eos_token_id] == [1]
    text, messages = "hello world there !", [{"role": "user", "content": "hello there"}]
    assert ours.encode(text) == auto.encode(text) and ours.get_vocab() == auto.get_vocab()
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)
    assert ours.init_kwargs == auto.init_kwargs


@pytest.mark.parametrize("named", ["LlamaTokenizer", None])
def test_other_tokenizers_go_through_auto_tokenizer(tmp_path, named):
    """A class with a model's own code, or none named (AutoTokenizer then asks the config): AutoTokenizer."""
    folder = tokenizer_folder(tmp_path / "model")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    if named is None:
        del settings["tokenizer_class"]
    else:
        settings["tokenizer_class"] = named
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    assert tokenizer_class(folder) is AutoTokenizer


def test_a_gguf_is_parsed_once_within_the_block(tmp_path):
    """Every open of the same file in the block — `from gguf import GGUFReader` at call time, as
    transformers and d3d.quantized do — gets one parse, with the file's fields and tensors; outside
    it, gguf-py's own reader again."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(4, 16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def open_as_transformers_does(where):
        from gguf import GGUFReader

        return GGUFReader(where)
    parse = gguf.GGUFReader
    with d3d.loading.each_gguf_parsed_once():
        first, again = open_as_transformers_does(path), open_as_transformers_does(str(path))
        assert first is again and isinstance(first, parse)
    assert gguf.GGUFReader is parse and open_as_transformers_does(path) is not first
    fresh = parse(str(path))
    assert int(first.fields["llama.block_count"].parts[-1][0]) == 2 == int(fresh.fields["llama.block_count"].parts[-1][0])
    assert [t.name for t in first.tensors] == ["token_embd.weight"]
    # the fields' parts as plain arrays over the same bytes (transformers reads strings a byte at a time)
    assert all(type(part) is np.ndarray for field in first.fields.values() for part in field.parts)
    assert all(np.array_equal(a, b) for name, field in first.fields.items()
               for a, b in zip(field.parts, fresh.fields[name].parts, strict=True))
    assert np.array_equal(first.tensors[0].data, fresh.tensors[0].data)


def test_the_tensor_name_table_is_built_once_within_the_block():
    """transformers asks `gguf.get_tensor_name_map` (at call time) once per module of the model it
    converts; within the block each (architecture, block count) gets one table, the same names."""
    import gguf

    def names_as_transformers_asks(arch, blocks):
        from gguf import get_tensor_name_map

        return get_tensor_name_map(arch, blocks)
    build = gguf.get_tensor_name_map
    with d3d.loading.each_gguf_parsed_once():
        first = names_as_transformers_asks(gguf.MODEL_ARCH.LLAMA, 2)
        assert names_as_transformers_asks(gguf.MODEL_ARCH.LLAMA, 2) is first
        assert names_as_transformers_asks(gguf.MODEL_ARCH.LLAMA, 3) is not first
    assert gguf.get_tensor_name_map is build and names_as_transformers_asks(gguf.MODEL_ARCH.LLAMA, 2) is not first
    fresh = build(gguf.MODEL_ARCH.LLAMA, 2)
    for name in ("model.layers.1.self_attn.q_proj", "model.embed_tokens", "lm_head", "model.norm"):
        assert first.get_name(name) == fresh.get_name(name) is not None, name


def test_without_transformers_metadata_the_config_is_read_every_time(tmp_path, cache, auto_config_reads, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    folder = tmp_path / "model"
    write_config(folder)
    assert read_config(folder) == read_config(folder) and len(auto_config_reads) == 2
    assert not (cache / "configs").exists()


def test_a_decoder_built_for_loaded_weights_imports_no_compiler():
    """On the meta device, drawing the embedding, computing the RoPE table or Module.to_empty run
    PyTorch's Python references, which import torch._dynamo and sympy: ~1.5 s of every load on 2 cores."""
    code = ("import sys; from d3d.config import ModelConfig; from d3d.models import Decoder; "
            f"Decoder.for_weights(ModelConfig.from_json({tiny_config('llama').to_json()!r})); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
