"""Distillation targets (`d3d.train.distill`) and the loss that uses them: the target's top-k
distributions recorded while `d3d data` generates, the same ones computed by a teacher-forced pass
for shards made without them, stored per shard and read back in record order; packed rows point at
the distribution their label came from; the KL is a true divergence and training with it works.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.config import ConfigError
from d3d.drafter import Drafter
from d3d.loading import Target
from d3d.train import distill
from d3d.train.batch import IGNORE, collate, pack_example
from d3d.train.data import DataConfig, generate_batch, generate_data
from d3d.train.distill import TopK, keep_top, teacher_forced
from d3d.train.shards import read_shards
from d3d.train.trainer import TrainConfig, Trainer, distill_kl, drafter_loss, load_sequences
from test_data import CharTokenizer

K = 8


@pytest.fixture(scope="module")
def target() -> Target:
    decoder = make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1)
    return Target(decoder.requires_grad_(False), CharTokenizer(), "tiny-random", [])


@pytest.fixture(scope="module")
def source_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sources") / "prompts.jsonl"
    rows = [{"id": f"p/{i}", "prompt": f"prompt number {i} " + "abcdefgh"[i % 8] * (1 + i % 5)} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_keep_top_is_the_top_of_the_log_softmax():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    top = keep_top(logits, K)
    expected = torch.log_softmax(logits, -1).topk(K, -1)
    assert top.ids.dtype == torch.int32 and torch.equal(top.ids.long(), expected.indices)
    torch.testing.assert_close(top.logprobs, expected.values)
    assert (top.logprobs.exp().sum(-1) <= 1 + 1e-6).all()


@torch.no_grad()
def test_generation_records_what_teacher_forcing_computes(target):
    """Recorded while generating (left-padded batches), the distributions chose the greedy tokens and
    equal a teacher-forced pass over the same response (up to rounding of a different batch layout)."""
    prompts = [[0, 2, 5, 9, 13], [0, 2, 7, 7, 30, 41, 12, 5], [0, 2, 60]]
    generated = generate_batch(target.decoder, prompts, 7, [], top_k=K)
    for prompt, answer in zip(prompts, generated):
        top = answer.distributions
        assert len(top) == len(answer.response_ids) == 7
        assert top.ids[:, 0].tolist() == answer.response_ids  # greedy: the most likely token
        forced = teacher_forced(target.decoder, prompt, answer.response_ids, K)
        assert torch.equal(forced.ids[:, :3], top.ids[:, :3])
        torch.testing.assert_close(forced.logprobs, top.logprobs, atol=1e-4, rtol=1e-4)
    assert all(g.distributions is None for g in generate_batch(target.decoder, prompts, 3, []))


def test_d3d_data_writes_and_completes_distribution_files(target, source_file, tmp_path):
    """`--distill-top-k` writes one file per shard, rows in record order; a folder made without them
    gets them by teacher forcing on the next run; files of another k are refused."""
    config = DataConfig(sources=[source_file], shard_size=4, batch_size=2, max_new_tokens=6)
    with_top = tmp_path / "with"
    generate_data(target, with_top, config, progress=False, distill_top_k=K)
    records = list(read_shards(with_top))
    tops = list(distill.read_all(with_top))
    assert len(tops) == len(records) == 10
    for record, top in zip(records, tops):
        assert len(top) == len(record["response_ids"]) and top.ids.shape[1] == K
        assert top.ids[:, 0].tolist() == record["response_ids"]

    plain = tmp_path / "plain"
    generate_data(target, plain, config, progress=False)
    with pytest.raises(ConfigError, match="distill-top-k"):
        list(distill.read_all(plain))
    generate_data(target, plain, config, progress=False, distill_top_k=K)  # fills in the three shards
    for mine, theirs in zip(distill.read_all(plain), tops, strict=True):
        assert torch.equal(mine.ids[:, 0], theirs.ids[:, 0])
        torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="top-8"):
        generate_data(target, plain, config, progress=False, distill_top_k=4)

    # several folders train as one only with distributions of one width
    narrow = tmp_path / "narrow"
    generate_data(target, narrow, config, progress=False, distill_top_k=4)
    assert len(load_sequences(f"{with_top},{plain}", 64, teachers := [])) == 20 and len(teachers) == 20
    with pytest.raises(ConfigError, match="different widths"):
        load_sequences(f"{with_top},{narrow}", 64, [])


def test_a_corrupt_distribution_file_is_a_clear_error(tmp_path):
    path = tmp_path / "distill" / "shard-00000.safetensors"
    path.parent.mkdir()
    path.write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="delete it"):
        distill.read(path)


def test_packed_rows_point_at_the_distribution_of_their_label():
    """Clean rows and shifted block rows: row → teacher row of the response token it predicts."""
    tokens = list(range(10, 22))  # 12 tokens, response from index 5
    response_start = 5
    teacher = TopK(torch.arange(7)[:, None].repeat(1, K).int(), torch.zeros(7, K))  # row j names itself
    example = pack_example(tokens, response_start, [6], 4, 99, teacher=teacher)
    for row in range(example.input_ids.shape[0]):
        label, source = int(example.labels[row]), int(example.teacher_rows[row])
        if label == IGNORE:
            assert source == -1
        else:
            assert source == tokens.index(label) - response_start
    batch = collate([example, example])
    second = batch["teacher_rows"][1][batch["teacher_rows"][1] >= 0]
    assert (second >= 7).all() and batch["teacher_ids"].shape == (14, K)  # offsets into the stack


def test_kl_is_zero_at_the_teacher_and_positive_elsewhere(target):
    """With the drafter's distribution equal to the teacher's (top-k + rest bucket) the KL is 0; a
    reduced draft vocabulary moves teacher tokens it lacks into the bucket."""
    drafter = Drafter.from_target(target.decoder, [0], block_size=4)
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    top = keep_top(logits, K)
    log_q = torch.log_softmax(logits, -1)
    torch.testing.assert_close(distill_kl(drafter, log_q, top.ids.long(), top.logprobs), torch.zeros(3),
                               atol=1e-5, rtol=0)
    other = torch.log_softmax(torch.randn(3, 64, generator=torch.Generator().manual_seed(2)), -1)
    assert (distill_kl(drafter, other, top.ids.long(), top.logprobs) > 0.01).all()
    small = Drafter.from_target(target.decoder, [0], block_size=4, draft_vocab=torch.arange(32))
    scores = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    assert (distill_kl(small, torch.log_softmax(scores, -1), top.ids.long(), top.logprobs) >= -1e-6).all()


@pytest.mark.parametrize("kind", ["d3d", "ar"])
def test_training_with_distillation(target, source_file, tmp_path, kind):
    """`distill` adds KL terms to the loss and training lowers them; without the files it is refused.
    An AR drafter (no blocks) trains on the clean rows' terms alone."""
    data_dir = tmp_path / "data"
    config = DataConfig(sources=[source_file], shard_size=5, batch_size=5, max_new_tokens=16)
    generate_data(target, data_dir, config, progress=False, distill_top_k=K)
    teachers: list[TopK] = []
    sequences = load_sequences(data_dir, 64, teachers)
    assert [len(t) for t in teachers] == [len(tokens) - start for tokens, start in sequences]

    fp32 = Target(make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1), CharTokenizer(), "tiny-random", [])
    train = TrainConfig(layers=[0], block_size=4, steps=12, batch_size=4, lr=1e-2, warmup=2, anchors=2,
                        max_length=64, held_out=2, eval_every=0, save_every=6, seed=0, autocast=False,
                        distill=1.0, ce_weight=0.1, drafter_kind=kind)
    trainer = Trainer(fp32, data_dir, tmp_path / "run", train)
    first = trainer.train_step()
    assert {"kl_diff", "kl_ar", "diff", "ar"} <= first.keys()
    if kind == "ar":
        assert first["diff"] == first["kl_diff"] == 0.0
        assert first["loss"] == pytest.approx(0.1 * first["ar"] + first["kl_ar"], rel=1e-5)
    for _ in range(10):
        last = trainer.train_step()
    assert last["kl_ar"] < first["kl_ar"]
    batch = trainer._next_batch()
    batch.pop("teacher_rows")
    with pytest.raises(ConfigError, match="distill"):
        drafter_loss(trainer.drafter, batch, 1.0, distill=1.0)
    with pytest.raises(ConfigError):
        TrainConfig(layers=[0], distill=0.0, ce_weight=0.0)


def test_sampled_acceptance_is_the_overlap_of_the_two_distributions():
    """Σ_v min(p_v, q_v) over the target's top-k: the T = 1 acceptance, a lower bound from the top-k."""
    from d3d.estimate import sampled_acceptance

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    top = keep_top(logits, 2)
    assert sampled_acceptance(logits, top.ids, top.logprobs).item() == pytest.approx(top.logprobs.exp().sum().item())
    q_logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    q = torch.softmax(q_logits, -1)[0]
    p = torch.softmax(logits, -1)[0]
    expected = min(p[0], q[0]) + min(p[1], q[1])
    assert sampled_acceptance(q_logits, top.ids, top.logprobs).item() == pytest.approx(expected.item())


def test_training_evaluates_tau_at_t1_when_the_data_has_distributions(target, source_file, tmp_path):
    data_dir = tmp_path / "data"
    generate_data(target, data_dir, DataConfig(sources=[source_file], shard_size=5, batch_size=5, max_new_tokens=16),
                  progress=False, distill_top_k=K)
    fp32 = Target(make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1), CharTokenizer(), "tiny-random", [])
    train = TrainConfig(layers=[0], block_size=4, steps=2, batch_size=2, held_out=5, eval_every=0, save_every=2,
                        autocast=False)
    trainer = Trainer(fp32, data_dir, tmp_path / "run", train)  # hard labels: no teachers in the batches
    assert trainer.train_teachers is None and trainer.held_teachers is not None
    evaluation = trainer.evaluate()
    assert 1.0 <= evaluation["tau_t1"] <= 4.0 and 1.0 <= evaluation["tau"] <= 4.0
