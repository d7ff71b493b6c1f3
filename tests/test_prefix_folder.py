"""Stored prefixes on disk (`PrefixCache(folder=…)`, `--prefix-cache-dir`): a later process with the
same folder starts a prompt from the keys and values an earlier one computed — bit for bit what its
own prefill would write, so the same output; the folder keeps to its byte budget, the least recently
used file leaving first; a damaged file is removed, never restored from; a folder belongs to one
target's weights on one machine and kernel build.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import d3d.prefix_cache
from d3d.cache import KVCache
from conftest import make_decoder, tiny_config
from d3d.config import GenerationConfig, SamplingConfig
from d3d.generation import prefix_key
from d3d.prefix_cache import PrefixCache
from test_cli import assert_usage_error, run_cli, tiny_default  # noqa: F401 - fixture
from test_generation import tiny_pipeline, tiny_target
from test_prefix_cache import MIB, conversation, decode, filled_cache, models, same  # noqa: F401 - fixture


def files(folder) -> list:
    return sorted(folder.glob("*.safetensors"))


@pytest.mark.parametrize("split,tiled", [(False, False), (True, False), (True, True)], ids=["plain", "split", "tiled"])
def test_a_later_process_restores_the_stored_positions_bit_for_bit(tmp_path, split, tiled):
    source = filled_cache(20, split, tiled=tiled)
    PrefixCache(MIB, tmp_path).keep(list(range(100, 120)), source)
    assert len(files(tmp_path)) == 1
    later = PrefixCache(MIB, tmp_path)  # a new process: nothing in memory, the folder read
    assert len(later) == 1 and len(later.entries) == 0 and len(later.stored) == 1  # in the folder only
    target = KVCache(2, 2, 32, 64, split=split, tile_keys=tiled)
    assert later.restore(target, list(range(100, 112)) + [7], limit=12) == 12
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(target.snapshot(12), source.snapshot(12)))
    assert (later.stats.hits, later.stats.disk_hits, len(later)) == (1, 1, 1)  # memory keeps it now
    assert later.restore(KVCache(2, 2, 32, 64, split=split, tile_keys=tiled), list(range(100, 112)), 12) == 12
    assert later.stats.disk_hits == 1  # the second time from memory
    assert len(later) == 1
    later.clear()  # `/reset_prefix_cache`: memory and folder
    assert len(later) == 0 and files(tmp_path) == []
    assert PrefixCache(MIB).restore(KVCache(2, 2, 32, 64), list(range(100, 112)), 12) == 0  # no folder, nothing


def test_the_folder_keeps_an_extended_entry_once_and_to_its_budget(tmp_path):
    per_entry = 10 * filled_cache(10, False).position_bytes + 4096
    budget = 2 * per_entry + 1000
    store = PrefixCache(MIB, tmp_path, disk_bytes=budget)
    store.keep([1, 2, 3, 4], filled_cache(4, False, seed=1))
    store.keep([1, 2, 3, 4, 5, 6], filled_cache(6, False, seed=1))  # extends the first: its file replaced
    assert len(files(tmp_path)) == 1
    store.keep([1, 2, 3], filled_cache(3, False, seed=1))  # held within the longer file: none written
    assert len(files(tmp_path)) == 1
    for seed, first in ((2, 20), (3, 30)):  # two more of 10 positions: the budget holds two, the oldest leaves
        time.sleep(0.01)
        store.keep([first + i for i in range(10)], filled_cache(10, False, seed=seed))
    later = PrefixCache(MIB, tmp_path, disk_bytes=budget)
    assert len(files(tmp_path)) == 2 and {int(e.tokens[0]) for e in later.stored} == {20, 30}
    assert later.restore(KVCache(2, 2, 32, 64), [1, 2, 3, 4, 5, 6, 7], 6) == 0
    # a prefix used again counts as recent: the next one to leave is the other
    assert later.restore(KVCache(2, 2, 32, 64), [20 + i for i in range(11)], 10) == 10
    later.keep([40 + i for i in range(10)], filled_cache(10, False, seed=4))
    assert {int(e.tokens[0]) for e in PrefixCache(MIB, tmp_path).stored} == {20, 40}


def test_an_entry_larger_than_memory_keeps_what_fits_there_and_all_of_it_on_disk(tmp_path):
    per_position = filled_cache(1, False).position_bytes + 8
    store = PrefixCache(14 * per_position, tmp_path)
    store.keep(list(range(20)), filled_cache(20, False, seed=5))
    (held,) = store.entries.values()
    assert len(held.tokens) == 14  # the prefix that fits, as without a folder
    assert [len(e.tokens) for e in PrefixCache(MIB, tmp_path).stored] == [20]
    source = filled_cache(20, False, seed=5)
    target = KVCache(2, 2, 32, 64)
    assert PrefixCache(0, tmp_path).restore(target, list(range(20)) + [1], 20) == 20
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(target.snapshot(20), source.snapshot(20)))


def test_a_file_another_process_removed_is_written_again(tmp_path):
    store = PrefixCache(MIB, tmp_path)
    store.keep(list(range(12)), filled_cache(12, False))
    (written,) = files(tmp_path)
    written.unlink()
    store.keep(list(range(12)), filled_cache(12, False))  # held in memory, its file gone: written again
    assert files(tmp_path) == [written]


def test_a_damaged_file_is_removed_and_never_restored_from(tmp_path):
    store = PrefixCache(MIB, tmp_path)
    store.keep(list(range(12)), filled_cache(12, False))
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    later = PrefixCache(MIB, tmp_path)
    assert len(later.stored) == 1 and not (tmp_path / "garbage.safetensors").exists()
    (good,) = files(tmp_path)
    good.write_bytes(good.read_bytes()[:-100])  # cut short after the listing read its tokens
    assert later.restore(KVCache(2, 2, 32, 64), list(range(12)), 11) == 0
    assert files(tmp_path) == [] and later.stored == []
    store.keep(list(range(12)), filled_cache(12, False, seed=9))  # written again (memory held it)
    (good,) = files(tmp_path)
    data = bytearray(good.read_bytes())
    data[-64:] = bytes(64)  # zeroed where a crash may leave blocks unwritten: same size, a valid header
    good.write_bytes(bytes(data))
    fresh = PrefixCache(MIB, tmp_path)
    assert fresh.restore(KVCache(2, 2, 32, 64), list(range(12)), 11) == 0  # the checksum fails it
    assert files(tmp_path) == []
    store.keep(list(range(12)), filled_cache(12, False, seed=9))
    shorter = PrefixCache(MIB, tmp_path)
    shorter.keep(list(range(5)), filled_cache(5, False, seed=9))  # memory: a shorter prefix
    (good,) = [f for f in files(tmp_path) if f != shorter.entries[next(iter(shorter.entries))].path]
    good.write_bytes(good.read_bytes()[:-100])
    assert shorter.restore(KVCache(2, 2, 32, 64), list(range(12)), 11) == 5  # the file fails: the next best


def test_two_processes_sharing_the_folder_survive_each_others_removals(tmp_path):
    first = PrefixCache(MIB, tmp_path)
    first.keep(list(range(12)), filled_cache(12, False))
    second = PrefixCache(MIB, tmp_path)  # lists the file
    first.clear()  # and removes it
    assert second.restore(KVCache(2, 2, 32, 64), list(range(12)), 11) == 0 and second.stored == []
    third = PrefixCache(MIB, tmp_path)
    first.keep(list(range(6)), filled_cache(6, False))
    fourth = PrefixCache(MIB, tmp_path)
    first.clear()
    fourth.keep(list(range(12)), filled_cache(12, False))  # extends a file gone already
    third.keep(list(range(3)), filled_cache(3, False))  # listed the folder before that file: writes its own
    later = PrefixCache(MIB, tmp_path)  # processes see each other's files as they start
    assert sorted(len(e.tokens) for e in later.stored) == [3, 12]
    assert later.restore(KVCache(2, 2, 32, 64), list(range(12)), 11) == 11


def test_a_disk_that_refuses_the_file_leaves_memory_working(tmp_path, monkeypatch):
    """A full disk (OSError), and the folder removed under a running process (safetensors' own error)."""
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(d3d.prefix_cache, "save_tensors", full)
    store = PrefixCache(MIB, tmp_path)
    store.keep(list(range(12)), filled_cache(12, False))
    assert list(tmp_path.iterdir()) == [] and len(store) == 1  # no file, not even a staging one
    assert store.restore(KVCache(2, 2, 32, 64), list(range(12)), 11) == 11
    monkeypatch.undo()
    gone = PrefixCache(MIB, tmp_path / "gone")
    (tmp_path / "gone").rmdir()
    gone.keep(list(range(12)), filled_cache(12, False))
    assert len(gone) == 1 and gone.restore(KVCache(2, 2, 32, 64), list(range(12)), 11) == 11


def test_a_prompt_computed_by_an_earlier_process_decodes_exactly_as_from_scratch(models, tmp_path):
    """The whole path: turn 1 stored in a folder; a new store on that folder (a new process) starts
    turn 2 from it and commits the same tokens and logits as with no cache, greedy and sampled."""
    target, drafter = models
    system, message = conversation(3)
    for temperature in (0.0, 1.0):
        folder = tmp_path / str(temperature)
        config = GenerationConfig(max_new_tokens=16, eos_token_ids=[],
                                  sampling=SamplingConfig(temperature=temperature, seed=5))
        first = decode(target, drafter, "speculative", system, config, PrefixCache(MIB, folder))
        prompt = system + first[0] + message
        second = decode(target, drafter, "speculative", prompt, config, PrefixCache(MIB, folder))
        assert second[1] == len(system) + len(first[0]) - 1
        assert same(second, decode(target, drafter, "speculative", prompt, config))


def test_generate_with_a_prefix_folder_reuses_the_prompt_in_a_later_run(capsys, tiny_default, tmp_path):
    """`d3d generate --prefix-cache-dir`: the second run of a prompt takes it from the folder (in the
    target's own subfolder) and prints the same text; a folder that cannot be made is a usage error."""
    argv = ["generate", "a prompt long enough to be worth keeping", "--max-new-tokens", "12", "--drafter", "none",
            "--prefix-cache-dir", str(tmp_path / "prefixes")]
    code, first, err = run_cli(capsys, *argv)
    assert code == 0 and "from the prefix cache" not in err, err
    (subfolder,) = (tmp_path / "prefixes").iterdir()
    assert files(subfolder)
    code, second, err = run_cli(capsys, *argv)
    assert code == 0 and second == first and "prompt tokens from the prefix cache" in err
    (tmp_path / "a file").write_text("")
    code, _, err = run_cli(capsys, "generate", "hi", "--prefix-cache-dir", str(tmp_path / "a file" / "below"))
    assert_usage_error(code, err, "--prefix-cache-dir")


def test_a_folder_is_keyed_by_the_weights_files_as_they_are(tmp_path):
    """`prefix_key`: the same target and files, the same subfolder; a weight file rewritten (its size
    or time), another dtype, or another file: another subfolder — never another model's positions."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"0" * 64)
    target = tiny_target()
    target.folder = str(tmp_path)
    key = prefix_key(target)
    assert prefix_key(target) == key
    os.utime(weights, ns=(1, 1))
    assert prefix_key(target) != key
    key = prefix_key(target)
    weights.write_bytes(b"0" * 65)
    os.utime(weights, ns=(1, 1))
    assert prefix_key(target) != key
    other = tiny_target(make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1, dtype=torch.bfloat16))  # its dtype
    other.folder = str(tmp_path)
    assert prefix_key(other) != prefix_key(target)


def test_a_second_server_on_the_folder_starts_from_the_first_ones_prompts(tmp_path):
    """`d3d serve --prefix-cache-dir`: a server started later (a restart) answers a prompt the first
    one computed from the folder — usage's cached tokens say so — with the same text."""
    import openai

    from d3d import server as d3d_server
    from test_server import MODEL, PROMPT, running

    texts, cached = [], []
    for _ in range(2):
        app = d3d_server.create_app(tiny_pipeline(eos_token_ids=[]), MODEL,
                                    limits=d3d_server.Limits(prefix_cache_mb=8, prefix_cache_dir=str(tmp_path)))
        with running(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
            answer = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12)
        texts.append(answer.choices[0].text)
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    assert texts[0] == texts[1] and cached[0] == 0 and cached[1] == answer.usage.prompt_tokens - 1
