"""The drafter training loop (`d3d.train.trainer`) on the tiny target: the loss falls, a resumed run
is bit-for-bit the uninterrupted one, shared target weights stay frozen and unsaved, `run()` writes
its log, drafter and curves, and the `d3d train` command works end to end.

The data folder has the layout `d3d data` writes (shards/shard-NNNNN.jsonl with id, prompt_ids,
response_ids): 24 random prompts answered greedily by the tiny target itself.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file

import d3d.generation
import d3d.loading
from conftest import make_decoder, tiny_config
from d3d.cli import main
from d3d.config import ConfigError
from d3d.drafter import Drafter
from d3d.loading import Target
from d3d.train.data import generate_batch
from d3d.train.trainer import TrainConfig, Trainer, learning_rate, length_grouped, load_sequences
from test_generation import EOS, ByteTokenizer

NUM_RECORDS = 24


def tiny_train_target() -> Target:
    """A fresh fp32 tiny target (seed 1) with the byte tokenizer."""
    decoder = make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1)
    return Target(decoder, ByteTokenizer(), "tiny", [EOS])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """24 records of ~30 tokens: random prompts (6–11 tokens) and the target's greedy responses (20 tokens)."""
    folder = tmp_path_factory.mktemp("data")
    (folder / "shards").mkdir()
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 64) for _ in range(rng.randint(6, 11))] for _ in range(NUM_RECORDS)]
    responses = [g.response_ids for g in generate_batch(tiny_train_target().decoder, prompts, 20, [])]
    for shard in range(2):
        lines = [json.dumps({"id": f"r{i}", "prompt_ids": prompts[i], "response_ids": responses[i]}) + "\n"
                 for i in range(shard * 12, (shard + 1) * 12)]
        (folder / "shards" / f"shard-{shard:05d}.jsonl").write_text("".join(lines))
    return folder


def config(**overrides) -> TrainConfig:
    base = dict(layers=[0], block_size=4, steps=6, batch_size=2, lr=1e-2, warmup=2, anchors=3, max_length=64,
                held_out=4, eval_every=0, save_every=3, seed=3, autocast=False)
    return TrainConfig(**{**base, **overrides})


def own_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.parameters.items()}


def test_load_sequences_reads_the_shards(data_dir):
    """Every record becomes (prompt + response, len(prompt)); max_length cuts the prompt from the left."""
    sequences = load_sequences(data_dir, 512)
    assert len(sequences) == NUM_RECORDS
    first = json.loads((data_dir / "shards" / "shard-00000.jsonl").read_text().splitlines()[0])
    assert sequences[0] == (first["prompt_ids"] + first["response_ids"], len(first["prompt_ids"]))
    short = load_sequences(data_dir, 24)
    assert all(len(tokens) <= 24 for tokens, _ in short)
    assert short[0] == ((first["prompt_ids"] + first["response_ids"])[-24:], 4)  # 20 response tokens kept


def test_no_shards_is_a_config_error(tmp_path):
    """A folder without finished shards is refused with ConfigError naming `d3d data`."""
    with pytest.raises(ConfigError, match="d3d data"):
        load_sequences(tmp_path, 64)


@pytest.mark.parametrize("labels", ["shifted", "unshifted"])
def test_loss_falls(data_dir, tmp_path, labels):
    """20 steps at lr 1e-2 lower the training loss (mean of the last 3 steps well below the first 3)."""
    trainer = Trainer(tiny_train_target(), data_dir, tmp_path,
                      config(steps=20, warmup=1, batch_size=4, anchors=4, labels=labels))
    assert trainer.drafter.config.labels == labels
    losses = [trainer.train_step()["loss"] for _ in range(20)]
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, losses


def test_held_out_split_is_disjoint(data_dir, tmp_path):
    """min(held_out, 10%) sequences are held out for τ and never trained on."""
    trainer = Trainer(tiny_train_target(), data_dir, tmp_path, config(held_out=64))
    assert len(trainer.held_out) == NUM_RECORDS // 10
    assert len(trainer.train_set) == NUM_RECORDS - NUM_RECORDS // 10
    assert not {tuple(t) for t, _ in trainer.held_out} & {tuple(t) for t, _ in trainer.train_set}


def test_held_out_prompts_are_greedy_and_their_samples_never_train(tmp_path):
    """With sampled responses in the data (`d3d data --samples`), the held-out sequences are greedy
    ones (τ at T = 0 is read on them) and no response to a held-out prompt, sampled or not, trains;
    greedy-only data keeps the split it always had (the first of the shuffled order)."""
    folder = tmp_path / "data"
    (folder / "shards").mkdir(parents=True)
    rng = random.Random(1)
    lines = []
    for i in range(40):
        prompt = [rng.randrange(4, 64) for _ in range(8)]
        for sample in range(3):
            record = {"id": f"p{i}", "prompt_ids": prompt, "response_ids": [rng.randrange(4, 64) for _ in range(12)]}
            if sample:
                record.update(sample=sample, temperature=1.0)
            lines.append(json.dumps(record) + "\n")
    (folder / "shards" / "shard-00000.jsonl").write_text("".join(lines))
    trainer = Trainer(tiny_train_target(), folder, tmp_path / "run", config(held_out=4))
    origins: list = []
    every = load_sequences(folder, 64, origins=origins)
    origin_of = {tuple(tokens): origin for (tokens, _), origin in zip(every, origins)}
    held = [origin_of[tuple(tokens)] for tokens, _ in trainer.held_out]
    trained = [origin_of[tuple(tokens)] for tokens, _ in trainer.train_set]
    assert len(held) == 4 and all(sample == 0 for _, sample in held)
    assert not {pid for pid, _ in held} & {pid for pid, _ in trained}
    assert len(trained) == 3 * 40 - 3 * 4  # every response of every other prompt trains
    greedy_only = Trainer(tiny_train_target(), data_dir_of(tmp_path, lines[::3]), tmp_path / "run2", config(held_out=4))
    order = list(range(40))
    random.Random(3).shuffle(order)  # config()'s seed: the split greedy-only data always had
    firsts = [json.loads(lines[3 * i])["response_ids"] for i in order[:4]]
    assert [tokens[-12:] for tokens, _ in greedy_only.held_out] == firsts


def data_dir_of(tmp_path, lines: list[str]):
    folder = tmp_path / "greedy-data"
    (folder / "shards").mkdir(parents=True)
    (folder / "shards" / "shard-00000.jsonl").write_text("".join(lines))
    return folder


def test_resume_reproduces_the_uninterrupted_run(data_dir, tmp_path):
    """3 steps, save, a new Trainer resuming, 3 more steps: weights bit-identical to a 6-step run, and the next loss equal."""
    # grad_accum and random masks make the run consume more RNG and wrap an epoch after the resume.
    c = config(grad_accum=2, mask_ratio="random", gamma=2.0)
    whole = Trainer(tiny_train_target(), data_dir, tmp_path / "a", c)
    whole.run(progress=False)
    assert whole.step == 6 and whole.epoch == 1  # 24 sequences drawn from 22 training ones

    first = Trainer(tiny_train_target(), data_dir, tmp_path / "b", c)
    for _ in range(3):
        first.train_step()
    first.save()
    interrupted = own_params(first)
    del first

    resumed = Trainer(tiny_train_target(), data_dir, tmp_path / "b", c)
    assert resumed.step == 3
    for name, value in own_params(resumed).items():
        assert torch.equal(value, interrupted[name]), name
    while resumed.step < c.steps:
        resumed.train_step()
    assert (resumed.epoch, resumed.index) == (whole.epoch, whole.index)
    expected = own_params(whole)
    for name, value in own_params(resumed).items():
        assert torch.equal(value, expected[name]), name
    assert resumed.train_step() == whole.train_step()  # same next batch, same loss, same lr


def test_resume_with_another_config_is_refused(data_dir, tmp_path):
    """A checkpoint made with one config cannot be continued with another: ConfigError."""
    trainer = Trainer(tiny_train_target(), data_dir, tmp_path, config())
    trainer.train_step()
    trainer.save()
    with pytest.raises(ConfigError, match="another config"):
        Trainer(tiny_train_target(), data_dir, tmp_path, config(lr=2e-2))
    assert Trainer(tiny_train_target(), data_dir, tmp_path, config()).step == 1  # the same config resumes


def test_a_refused_resume_names_what_differs(data_dir, tmp_path):
    """The refusal says which options differ and how; a run saved before `length_groups` existed
    resumes as what it was: ungrouped (0), not today's default."""
    trainer = Trainer(tiny_train_target(), data_dir, tmp_path, config(length_groups=0))
    trainer.train_step()
    trainer.save()
    with pytest.raises(ConfigError, match=r"lr: 0\.01 there, 0\.02 now") as refused:
        Trainer(tiny_train_target(), data_dir, tmp_path, config(length_groups=0, lr=2e-2))
    assert "anchors" not in str(refused.value)
    state_file = tmp_path / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["length_groups"]  # as an older d3d saved it
    state_file.write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="length_groups: 0 there, 64 now"):
        Trainer(tiny_train_target(), data_dir, tmp_path, config(length_groups=64))
    assert Trainer(tiny_train_target(), data_dir, tmp_path, config(length_groups=0)).step == 1


def test_length_grouped_batches_hold_sequences_of_similar_length():
    """Each window of micro-batches is sorted by length and cut; the micro-batches are shuffled.
    Every sequence stays, once; the padding a micro-batch carries shrinks."""
    rng = random.Random(0)
    lengths = [rng.randrange(20, 600) for _ in range(1000)]
    order = list(range(1000))
    rng.shuffle(order)
    grouped = length_grouped(order, lengths, 8, 16, random.Random(1))
    assert sorted(grouped) == list(range(1000))
    batches = [grouped[i:i + 8] for i in range(0, 1000, 8)]
    assert all(b == sorted(b, key=lambda i: lengths[i]) for b in batches)
    windows = [sorted(order[i:i + 128], key=lambda i: lengths[i]) for i in range(0, 1000, 128)]
    cut = [w[i:i + 8] for w in windows for i in range(0, len(w), 8)]
    assert sorted(map(tuple, batches)) == sorted(map(tuple, cut))  # the same micro-batches …
    assert batches != cut  # … in a shuffled order

    def padding(sequence_order):
        return sum(8 * max(lengths[i] for i in b) - sum(lengths[i] for i in b)
                   for b in (sequence_order[i:i + 8] for i in range(0, 1000, 8)))
    assert padding(grouped) < padding(order) / 4


def test_the_trainer_draws_micro_batches_of_similar_length(data_dir, tmp_path):
    """With `length_groups`, an epoch still holds every training sequence once, and its micro-batches
    are padded less than a plain shuffle's; 0 is the plain shuffle."""
    grouped = Trainer(tiny_train_target(), data_dir, tmp_path / "g", config(length_groups=4))
    plain = Trainer(tiny_train_target(), data_dir, tmp_path / "p", config(length_groups=0))
    assert sorted(grouped.order) == sorted(plain.order) == list(range(len(plain.train_set)))
    assert grouped.order != plain.order

    def padded_rows(trainer):
        lengths = [len(trainer.train_set[i][0]) for i in trainer.order]
        return sum(2 * max(lengths[i:i + 2]) for i in range(0, len(lengths) - 1, 2))
    assert padded_rows(grouped) < padded_rows(plain)
    rng = random.Random(3 * 1000)  # seed 3, epoch 0: the plain shuffle is what it always was
    expected = list(range(len(plain.train_set)))
    rng.shuffle(expected)
    assert plain.order == expected


def test_more_steps_on_resume_extends_the_run(data_dir, tmp_path):
    """Resuming with a larger --steps continues from the checkpoint to the new length, the steps done
    unchanged and the rest on the stretched schedule; fewer steps than done, or any other change, are refused."""
    trainer = Trainer(tiny_train_target(), data_dir, tmp_path, config(steps=3))
    trainer.run(progress=False)
    done = own_params(trainer)
    lr_at_3 = learning_rate(config(steps=3), 3)
    with pytest.raises(ConfigError, match="before where it stands"):
        Trainer(tiny_train_target(), data_dir, tmp_path, config(steps=2))
    with pytest.raises(ConfigError, match="another config"):
        Trainer(tiny_train_target(), data_dir, tmp_path, config(steps=5, lr=2e-2))
    extended = Trainer(tiny_train_target(), data_dir, tmp_path, config(steps=5))
    assert (extended.step, extended.extended_from) == (3, 3)
    for name, value in own_params(extended).items():
        assert torch.equal(value, done[name]), name
    extended.run(progress=False)
    assert extended.step == 5
    assert learning_rate(config(steps=5), 3) > lr_at_3  # the decay restarted over the longer run
    steps = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5]
    assert any(not torch.equal(value, done[name]) for name, value in own_params(extended).items())
    again = Trainer(tiny_train_target(), data_dir, tmp_path, config(steps=5))  # the new length is the run's now
    assert (again.step, again.extended_from) == (5, None)


def test_shared_target_weights_stay_frozen_and_unsaved(data_dir, tmp_path):
    """Training changes the drafter's own weights but no target weight; embedding and head are in no saved file."""
    target = tiny_train_target()
    before = {name: p.detach().clone() for name, p in target.decoder.named_parameters()}
    trainer = Trainer(target, data_dir, tmp_path, config(steps=3, eval_every=1, save_every=1))
    assert trainer.drafter.decoder.embed_tokens is target.decoder.embed_tokens  # shared, not copied
    assert not any("embed_tokens" in n or "lm_head" in n for n in trainer.parameters)
    initial = own_params(trainer)
    trainer.run(progress=False)
    for name, p in target.decoder.named_parameters():
        assert torch.equal(p, before[name]), name
    changed = [n for n, p in trainer.parameters.items() if not torch.equal(p, initial[n])]
    assert "mask_embedding" in changed and len(changed) == len(initial)
    for folder in ("checkpoint/drafter", "drafter"):
        keys = load_file(str(tmp_path / folder / "model.safetensors")).keys()
        assert not any("embed_tokens" in k or "lm_head" in k for k in keys), folder
        assert "mask_embedding" in keys
    optimizer_keys = load_file(str(tmp_path / "checkpoint" / "optimizer.safetensors")).keys()
    assert not any("embed_tokens" in k or "lm_head" in k for k in optimizer_keys)


def test_a_released_target_trains_the_same_run_without_its_layers(data_dir, tmp_path):
    """release_target frees the target's layers once the drafter is built (a resumed run too) and
    changes nothing else: the same losses and weights, bit for bit; a DFlash-style drafter that reads
    the target's own layers keeps them."""
    kept, released = tiny_train_target(), tiny_train_target()
    runs = {}
    for name, target, release in (("kept", kept, False), ("released", released, True)):
        trainer = Trainer(target, data_dir, tmp_path / name, config(steps=4, save_every=2), release_target=release)
        trainer.run(progress=False)
        runs[name] = [(r["step"], r.get("loss")) for r in map(json.loads, (tmp_path / name / "log.jsonl").read_text().splitlines())]
    assert len(kept.decoder.layers) == 2 and len(released.decoder.layers) == 0
    assert runs["kept"] == runs["released"]
    assert load_file(str(tmp_path / "kept" / "drafter" / "model.safetensors")).keys() == \
           load_file(str(tmp_path / "released" / "drafter" / "model.safetensors")).keys()
    for key, value in load_file(str(tmp_path / "kept" / "drafter" / "model.safetensors")).items():
        assert torch.equal(value, load_file(str(tmp_path / "released" / "drafter" / "model.safetensors"))[key]), key
    resumed = tiny_train_target()
    Trainer(resumed, data_dir, tmp_path / "released", config(steps=4, save_every=2), release_target=True)
    assert len(resumed.decoder.layers) == 0
    reader = tiny_train_target()
    Trainer(reader, data_dir, tmp_path / "dflash", config(drafter_kind="dflash", lambda_ar=0.0), release_target=True)
    assert len(reader.decoder.layers) == 2  # fp32 without autocast: the trainer reads these very layers


def test_run_writes_log_drafter_and_curves(data_dir, tmp_path):
    """run(): log.jsonl with losses and τ entries, a bf16 drafter/ that loads, and curves.png."""
    target = tiny_train_target()
    trainer = Trainer(target, data_dir, tmp_path, config(steps=4, eval_every=2, save_every=2))
    result = trainer.run(progress=False)
    assert result["step"] == 4 and 1.0 <= result["tau"] <= 4.0 and len(result["acceptance_rate"]) == 3

    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [("tau" in r) for r in records] == [True, False, True, False, True]
    assert all({"loss", "diff", "ar", "lr"} <= set(r) for r in records[1:])
    assert records[-1]["tau"] == result["tau"]

    weights = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
    assert weights["draft_vocab"].dtype == torch.int64  # ids are never cast
    loaded = Drafter.from_pretrained(tmp_path / "drafter", target.decoder, target.fingerprint)
    assert loaded.block_size == 4 and loaded.config.target_layers == [0]
    for name, value in loaded.own_state().items():
        assert torch.equal(value, trainer.drafter.state_dict()[name].to(torch.bfloat16).float()), name

    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert (tmp_path / "checkpoint" / "state.json").is_file() and not (tmp_path / "checkpoint.staging").exists()


def test_learning_rate_schedule():
    """Linear warm-up to lr, then cosine decay to the floor lr·min_lr_ratio at the last step (and after)."""
    c = TrainConfig(lr=1.0, warmup=10, steps=110, min_lr_ratio=0.1)
    assert learning_rate(c, 0) == pytest.approx(0.1)
    assert learning_rate(c, 4) == pytest.approx(0.5)
    assert learning_rate(c, 9) == pytest.approx(1.0)
    assert learning_rate(c, 10) == pytest.approx(1.0)
    assert learning_rate(c, 60) == pytest.approx(0.55)
    assert learning_rate(c, 110) == pytest.approx(0.1)
    assert learning_rate(c, 500) == pytest.approx(0.1)
    rates = [learning_rate(c, s) for s in range(111)]
    assert all(a <= b for a, b in zip(rates[:10], rates[1:10]))
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
    no_warmup = TrainConfig(lr=2.0, warmup=0, steps=4, min_lr_ratio=0.0)
    assert [learning_rate(no_warmup, s) for s in range(5)] == pytest.approx([2.0, 1.0 + 2 ** -0.5, 1.0,
                                                                              1.0 - 2 ** -0.5, 0.0])


@pytest.mark.parametrize("overrides, fragment", [
    ({"steps": 0}, "steps"), ({"batch_size": 0}, "batch_size"), ({"grad_accum": 0}, "grad_accum"),
    ({"anchors": 0}, "anchors"), ({"max_length": 0}, "max_length"), ({"save_every": 0}, "save_every"),
    ({"layers": []}, "layers"), ({"lr": 0.0}, "lr"), ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ({"min_lr_ratio": -0.1}, "min_lr_ratio"), ({"length_groups": -1}, "length_groups"),
])
def test_train_config_validation(overrides, fragment):
    """Invalid TrainConfig values raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=fragment):
        TrainConfig(**overrides)
    TrainConfig(layers=[], init_from="somewhere")  # layers may be empty when starting from a checkpoint


@pytest.fixture
def patched_load_target(monkeypatch):
    """`d3d train --target default` gets a fresh tiny target instead of SmolLM2 (as test_cli patches it)."""
    loads = []

    def load(source=None, dtype=torch.bfloat16, weights="stored"):
        loads.append((source, dtype))
        return tiny_train_target()

    monkeypatch.setattr(d3d.loading, "load_target", load)
    monkeypatch.setattr(d3d.generation, "load_target", load)
    return loads


def test_cli_train_runs_resumes_and_refuses_another_config(capsys, data_dir, tmp_path, patched_load_target):
    """`d3d train`: exit 0 with a JSON result; re-running resumes (no new steps); other options exit 2."""
    out = tmp_path / "run"
    argv = ["train", "--data", str(data_dir), "--out", str(out), "--layers", "0", "--block-size", "4",
            "--steps", "2", "--batch-size", "2", "--anchors", "2", "--max-length", "64", "--warmup", "1",
            "--eval-every", "0", "--save-every", "1", "--lr", "0.001"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 2 and 1.0 <= result["tau"] <= 4.0
    assert patched_load_target[0][1] == torch.float32  # fp32 master weights
    assert (out / "drafter" / "config.json").is_file() and (out / "curves.png").is_file()
    log_lines = (out / "log.jsonl").read_text().splitlines()

    assert main(argv) == 0  # the same command again: already at step 2, nothing to train
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 2
    assert (out / "log.jsonl").read_text().splitlines() == log_lines

    assert main(argv[:-1] + ["0.002"]) == 2
    err = capsys.readouterr().err
    assert "d3d: error:" in err and "another config" in err and "Traceback" not in err

    longer = [*argv]
    longer[longer.index("--steps") + 1] = "3"
    assert main(longer) == 0  # more steps: the run goes on, and says so
    assert f"extending {out} from 2 to 3 steps at step 2" in capsys.readouterr().err


def test_cli_train_length_groups(capsys, data_dir, tmp_path, patched_load_target):
    """`--length-groups N` reaches the run's config (0 turns grouping off); a negative N exits 2 before anything loads."""
    argv = ["train", "--data", str(data_dir), "--layers", "0", "--block-size", "4", "--steps", "1", "--batch-size", "2",
            "--anchors", "2", "--max-length", "64", "--warmup", "1", "--eval-every", "0", "--save-every", "1"]
    assert main(argv + ["--out", str(tmp_path / "bad"), "--length-groups", "-1"]) == 2
    err = capsys.readouterr().err
    assert "length_groups" in err and "Traceback" not in err and not patched_load_target
    assert main(argv + ["--out", str(tmp_path / "off"), "--length-groups", "0"]) == 0
    state = json.loads((tmp_path / "off" / "checkpoint" / "state.json").read_text())
    assert state["config"]["length_groups"] == 0


def test_cli_train_copies_every_layer_or_every_kth(capsys, data_dir, tmp_path, patched_load_target):
    """`--layers all` starts from a copy of the whole target, `every:K` from layers 0, K, 2K, …; a
    malformed list exits 2 before anything loads."""
    depth = tiny_train_target().decoder.config.num_layers
    common = ["--data", str(data_dir), "--block-size", "4", "--steps", "1", "--batch-size", "2", "--anchors", "2",
              "--max-length", "64", "--warmup", "1", "--eval-every", "0", "--save-every", "1"]
    for spec, layers in (("all", list(range(depth))), ("every:2", list(range(0, depth, 2)))):
        out = tmp_path / spec.replace(":", "-")
        assert main(["train", "--out", str(out), "--layers", spec, *common]) == 0
        capsys.readouterr()
        saved = json.loads((out / "drafter" / "config.json").read_text())
        assert saved["target_layers"] == layers
    loads = len(patched_load_target)
    assert main(["train", "--out", str(tmp_path / "bad"), "--layers", "0,x", *common]) == 2
    err = capsys.readouterr().err
    assert "d3d: error: --layers takes" in err and "Traceback" not in err
    assert len(patched_load_target) == loads  # refused before the target loaded


def test_reduced_draft_vocabulary_trains_on_frequent_tokens(data_dir, tmp_path):
    """With draft_vocab_size, the drafter's vocabulary is the most frequent response tokens, the loss
    falls, and the saved drafter drafts only inside that vocabulary."""
    from d3d.train.trainer import frequent_tokens

    trainer = Trainer(tiny_train_target(), data_dir, tmp_path / "run", config(steps=20, draft_vocab_size=16))
    counts = torch.zeros(64, dtype=torch.long)
    for tokens, start in trainer.train_set:
        counts += torch.bincount(torch.tensor(tokens[start:]), minlength=64)
    vocab = trainer.drafter.draft_vocab
    assert torch.equal(vocab, frequent_tokens(trainer.train_set, 16, 64))
    assert counts[vocab].min() >= counts[[i for i in range(64) if i not in set(vocab.tolist())]].max()
    losses = [trainer.train_step()["loss"] for _ in range(20)]
    assert sum(losses[-3:]) < sum(losses[:3])
    trainer.save()
    loaded = Drafter.from_pretrained(tmp_path / "run" / "checkpoint" / "drafter", trainer.target.decoder)
    logits = loaded.draft(loaded.new_cache(64), [5, 6, 7, 8])
    assert set(logits.argmax(-1).tolist()) <= set(vocab.tolist())


def test_resume_refuses_changed_data_unless_fixed_by_max_sequences(data_dir, tmp_path):
    """More shards since the run started: resume is refused; with max_sequences the run stays resumable."""
    import shutil

    grown = tmp_path / "data"
    shutil.copytree(data_dir / "shards", grown / "shards")
    (grown / "shards" / "shard-00001.jsonl").rename(tmp_path / "later.jsonl")  # only the first shard so far
    trainer = Trainer(tiny_train_target(), grown, tmp_path / "run", config())
    trainer.train_step()
    trainer.save()
    (tmp_path / "later.jsonl").rename(grown / "shards" / "shard-00001.jsonl")  # `d3d data` added a shard
    with pytest.raises(ConfigError, match="data changed"):
        Trainer(tiny_train_target(), grown, tmp_path / "run", config())
    fixed = Trainer(tiny_train_target(), grown, tmp_path / "fixed", config(max_sequences=12))
    fixed.train_step()
    fixed.save()
    assert Trainer(tiny_train_target(), grown, tmp_path / "fixed", config(max_sequences=12)).step == 1


def test_compare_runs_plots_and_reports_final_tau(tmp_path):
    """`d3d curves` reads each run's log.jsonl, draws one PNG and reports the last τ per run."""
    for name, taus in (("a", [1.0, 1.2]), ("b", [1.0, 1.1])):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"step": 10 * i, "tau": t, "acceptance_rate": [t - 1, 0.0]}) for i, t in enumerate(taus)]
        (tmp_path / name / "log.jsonl").write_text("\n".join(lines) + "\n")
    code = main(["curves", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c.png")])
    assert code == 0 and (tmp_path / "c.png").stat().st_size > 0


def test_compiled_layers_train_like_eager_and_save_the_same_drafter(data_dir, tmp_path):
    """`compile`: each layer through torch.compile trains the same run up to rounding (the same losses
    within 2% over 2 steps), τ is read eagerly (the same estimate), its checkpoint holds the same
    tensors by name, and it resumes bit for bit like an eager run."""
    c = config(steps=3, save_every=2, autocast=True)
    eager = Trainer(tiny_train_target(), data_dir, tmp_path / "eager", c)
    compiled = Trainer(tiny_train_target(), data_dir, tmp_path / "compiled", dataclasses.replace(c, compile=True))
    # τ is read eagerly, with the kernels decoding uses: the same estimate from the same weights
    assert compiled.evaluate() == eager.evaluate()
    for _ in range(2):
        a, b = eager.train_step(), compiled.train_step()
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-2), (a, b)
    compiled.save()
    saved = load_file(str(tmp_path / "compiled" / "checkpoint" / "drafter" / "model.safetensors"))
    eager.save()
    assert set(saved) == set(load_file(str(tmp_path / "eager" / "checkpoint" / "drafter" / "model.safetensors")))
    following = compiled.train_step()
    resumed = Trainer(tiny_train_target(), data_dir, tmp_path / "compiled", dataclasses.replace(c, compile=True))
    assert resumed.step == 2 and resumed.train_step() == following
    with pytest.raises(ConfigError, match="another config"):
        Trainer(tiny_train_target(), data_dir, tmp_path / "compiled", c)


def test_decoding_after_a_step_reads_the_new_weights(data_dir, tmp_path):
    """The optimizer writes the weights in place; a draft pass through the row-exact kernels after a
    step reads the stepped weights (their packed copies are refreshed), not the ones packed before it."""
    trainer = Trainer(tiny_train_target(), data_dir, tmp_path / "run", config(steps=2))
    drafter = trainer.drafter.eval()
    tokens = [5, 6, 7, 8, 9]
    before = drafter.draft(drafter.new_cache(64), tokens)  # packs the weights as they are
    trainer.train_step()
    drafter.eval()
    after = drafter.draft(drafter.new_cache(64), tokens)
    fresh = copy.deepcopy(drafter)  # a copy packs its own weights anew
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh.draft(fresh.new_cache(64), tokens))


def test_several_data_folders_are_one_data_set(data_dir, tmp_path):
    """`--data A,B`: the records of A then B, their distributions alike, and a run trains over both;
    folders made by different targets, or with distributions of different widths, are refused."""
    import shutil

    from d3d.train.shards import data_folders

    other = tmp_path / "other"
    shutil.copytree(data_dir, other)
    for path in (other / "shards").glob("*.jsonl"):  # other prompts' ids, the same tokens
        path.write_text(path.read_text().replace('"id": "r', '"id": "o'))
    one, origins = load_sequences(data_dir, 64), []
    both = load_sequences(f"{data_dir},{other}", 64, origins=origins)
    assert both == one + one and [o[0][0] for o in origins] == ["r"] * len(one) + ["o"] * len(one)
    assert load_sequences([data_dir, other], 64) == both
    trainer = Trainer(tiny_train_target(), f"{data_dir},{other}", tmp_path / "run", config(steps=1))
    assert trainer.num_sequences == 2 * len(one)
    assert trainer.train_step()["loss"] > 0

    for folder, target in ((data_dir, "tiny"), (other, "another")):
        (folder / "manifest.json").write_text(json.dumps({"target": target, "tokenizer_fingerprint": "f"}))
    try:
        with pytest.raises(ConfigError, match="different targets"):
            data_folders(f"{data_dir},{other}")
    finally:
        (data_dir / "manifest.json").unlink()  # the shared fixture as it was
    with pytest.raises(ConfigError, match="no data folder"):
        data_folders(",")
