"""The text pipeline: streamed chunks, stop strings, finish reasons, UTF-8 safety and the four
decoding methods, over the tiny random target with a tiny byte-level fake tokenizer (no network).

`ByteTokenizer` and `tiny_target` are imported by test_cli.py as well.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from conftest import make_decoder, tiny_config
from d3d.drafter import Drafter
from d3d.generation import METHODS, Chunk, Pipeline
from d3d.loading import Target
from d3d.sequence import PromptError, Step
from d3d.stats import SpecStats

SPECIALS = ["<bos>", "<eos>", "<user>", "<assistant>"]  # ids 0 … 3
BOS, EOS, USER, ASSISTANT = range(4)
PIECES = ([b" "] + [bytes([c]) for c in range(ord("a"), ord("z") + 1)] + [b".", b",", b"!", b"?", b"\n"]
          + [str(d).encode() for d in range(10)] + [b"H", b"S", b"T", b"O", b"P"]
          + [b"he", b"llo", b" wor", b"ld", b"ST", b"OP"]
          # Pieces of multi-byte characters, split the way byte-level BPE splits rare ones:
          # é = C3 A9, € = E2 82 AC, 😀 = F0 9F 98 80.
          + [b"\xc3", b"\xa9", b"\xe2", b"\x82\xac", b"\xf0\x9f", b"\x98", b"\x80"])
assert len(SPECIALS) + len(PIECES) == 64  # the conftest target's vocabulary


class ByteTokenizer:
    """A byte-level tokenizer over 64 ids (4 specials + 60 byte pieces), with a toy chat template.

    Like a real byte-level BPE tokenizer, decoding a token list that ends inside a multi-byte
    character gives "\\ufffd" for the incomplete bytes.
    """

    chat_template = "<bos>{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    eos_token_id = EOS

    def __init__(self) -> None:
        self.pieces = {piece: len(SPECIALS) + i for i, piece in enumerate(PIECES)}
        self.longest = max(len(p) for p in PIECES)

    def piece(self, token: int) -> bytes:
        if token < len(SPECIALS):
            return SPECIALS[token].encode()
        return PIECES[token - len(SPECIALS)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        return b"".join(self.piece(i) for i in ids
                        if not (skip_special_tokens and i < len(SPECIALS))).decode("utf-8", errors="replace")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Greedy longest-piece match over the UTF-8 bytes."""
        data, ids, i = text.encode("utf-8"), [], 0
        while i < len(data):
            for size in range(min(self.longest, len(data) - i), 0, -1):
                if data[i:i + size] in self.pieces:
                    ids.append(self.pieces[data[i:i + size]])
                    i += size
                    break
            else:
                raise ValueError(f"byte {data[i]:#x} is not in the toy vocabulary")
        return ([BOS] if add_special_tokens else []) + ids

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        assert tokenize, "the pipeline asks for token ids"
        ids = [BOS]
        for message in messages:
            ids += [ASSISTANT if message["role"] == "assistant" else USER] + self.encode(message["content"])
        return ids + ([ASSISTANT] if add_generation_prompt else [])

    def get_vocab(self) -> dict[str, int]:
        vocab = {name: i for i, name in enumerate(SPECIALS)}
        vocab.update({piece.hex(): i for piece, i in self.pieces.items()})
        return vocab


def tiny_target(decoder=None, eos_token_ids: list[int] | None = None) -> Target:
    """The conftest-style tiny target (seed 1) wrapped with the byte tokenizer."""
    if decoder is None:
        decoder = make_decoder(tiny_config("llama", tie_word_embeddings=False), seed=1)
    return Target(decoder, ByteTokenizer(), "tiny-random", [EOS] if eos_token_ids is None else eos_token_ids)


def tiny_pipeline(decoder=None, eos_token_ids: list[int] | None = None, drafter: bool = True) -> Pipeline:
    """A Pipeline over the tiny target; the D3D and AR drafters (block 4) are copied from target layer 0."""
    target = tiny_target(decoder, eos_token_ids)
    if not drafter:
        return Pipeline(target, None)
    return Pipeline(target, Drafter.from_target(target.decoder, [0], block_size=4),
                    ar_drafter=Drafter.from_target(target.decoder, [0], block_size=4, kind="ar"))


def tokens_of(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.step.tokens]


def synthetic_steps(token_lists: list[list[int]], finish_reason: str = "length",
                    consumed: list[int] | None = None) -> Iterator[Step]:
    """An engine stand-in yielding the given steps; `consumed` records how many were taken."""
    stats = SpecStats()
    for i, tokens in enumerate(token_lists):
        if consumed is not None:
            consumed.append(i)
        last = i == len(token_lists) - 1
        yield Step(list(tokens), 0, 0, "none", finish_reason if last else None, stats)


def encode_pieces(tokenizer: ByteTokenizer, pieces: list[bytes]) -> list[list[int]]:
    """One step per piece (each piece is one token)."""
    return [[tokenizer.pieces[p]] for p in pieces]


@pytest.fixture
def pipeline() -> Pipeline:
    return tiny_pipeline(eos_token_ids=[])  # no EOS: generations run to max_new_tokens


# -- streaming ------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_chunks_concatenate_to_the_full_text(pipeline, method):
    """Every prefix of the stream is a prefix of the final text, and all chunks join to decode(tokens)."""
    chunks = list(pipeline.generate("hello world", max_new_tokens=40, method=method))
    tokens = tokens_of(chunks)
    full = pipeline.target.tokenizer.decode(tokens)
    assert len(tokens) == 40
    assert "".join(c.text for c in chunks) == full
    streamed = ""
    for chunk in chunks:
        streamed += chunk.text
        assert full.startswith(streamed)
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].step.stats.new_tokens == 40


def test_chunks_follow_engine_steps(pipeline):
    """One chunk per engine step, each carrying that step (and so the running stats)."""
    prompt_ids = pipeline.encode("hello world")
    config = pipeline.generation_config(max_new_tokens=30)
    steps = list(pipeline.steps(prompt_ids, config, "speculative"))
    chunks = list(pipeline.generate("hello world", max_new_tokens=30))
    assert [c.step.tokens for c in chunks] == [s.tokens for s in steps]
    assert chunks[-1].step.stats is chunks[0].step.stats  # the running totals of one generation


def test_multibyte_characters_are_never_emitted_half():
    """A character split over 2-3 tokens (é, €, 😀) is held back until complete: no chunk holds U+FFFD."""
    tokenizer = ByteTokenizer()
    pieces = [b"c", b"a", b"f", b"\xc3", b"\xa9", b" ", b"\xe2", b"\x82\xac", b" ", b"\xf0\x9f", b"\x98", b"\x80", b"!"]
    chunks = list(tiny_pipeline().stream_text(synthetic_steps(encode_pieces(tokenizer, pieces)), []))
    texts = [c.text for c in chunks]
    assert "".join(texts) == "café € 😀!"
    assert not any("\ufffd" in t for t in texts)
    assert texts == ["c", "a", "f", "", "é", " ", "", "€", " ", "", "", "😀", "!"]


def test_multibyte_hold_with_stop_strings_and_multi_token_steps():
    """Stop-string hold and UTF-8 hold together, with several tokens per step: still never half a character."""
    tokenizer = ByteTokenizer()
    steps = [[tokenizer.pieces[b"he"], tokenizer.pieces[b"\xe2"]], [tokenizer.pieces[b"\x82\xac"], tokenizer.pieces[b"\xf0\x9f"]],
             [tokenizer.pieces[b"\x98"]], [tokenizer.pieces[b"\x80"], tokenizer.pieces[b"a"], tokenizer.pieces[b"b"]]]
    chunks = list(tiny_pipeline().stream_text(synthetic_steps(steps), ["zzz"]))
    assert "".join(c.text for c in chunks) == "he€😀ab"
    assert not any("\ufffd" in c.text for c in chunks)


def test_generation_ending_inside_a_character_flushes_the_rest():
    """If the engine stops mid-character the last chunk still carries everything decoded (with U+FFFD)."""
    tokenizer = ByteTokenizer()
    steps = encode_pieces(tokenizer, [b"a", b"\xe2"])
    chunks = list(tiny_pipeline().stream_text(synthetic_steps(steps, "length"), []))
    assert "".join(c.text for c in chunks) == tokenizer.decode([s[0] for s in steps]) == "a\ufffd"
    assert chunks[-1].finish_reason == "length"


def test_generated_multibyte_text_is_streamed_whole():
    """On real engine output containing partial-character tokens, no chunk boundary splits a character."""
    pipeline = tiny_pipeline(eos_token_ids=[])
    tokenizer = pipeline.target.tokenizer
    multibyte = {tokenizer.pieces[p] for p in PIECES if p[0] >= 0x80}
    for prompt in ["hello", "café", "€ 😀", "the world"]:
        chunks = list(pipeline.generate(prompt, max_new_tokens=48, method="speculative"))
        tokens = tokens_of(chunks)
        full = tokenizer.decode(tokens)
        assert "".join(c.text for c in chunks) == full
        so_far = ""
        for chunk in chunks:
            # A chunk may hold U+FFFD only where the final text has it too (invalid bytes, not a split).
            so_far += chunk.text
            assert full.startswith(so_far)
        if set(tokens) & multibyte:
            break
    assert set(tokens) & multibyte, "the fixture model should produce some partial-character tokens"


class CountingTokenizer(ByteTokenizer):
    """A ByteTokenizer that counts the token ids it is asked to decode."""

    decoded = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("length", [200, 2000])
def test_streaming_decodes_each_token_a_bounded_number_of_times(length):
    """Incremental: decoding work per token does not grow with the answer's length (re-decoding the
    whole answer every step would decode length²/2 ids), and the text is still decode(tokens)."""
    tokenizer = CountingTokenizer()
    pipeline = tiny_pipeline()
    pipeline.target.tokenizer = tokenizer
    pieces = [b"he", b"\xe2", b"\x82\xac", b" ", b"\xf0\x9f", b"\x98", b"\x80", b"llo", b"!"]
    ids = [tokenizer.pieces[pieces[i % len(pieces)]] for i in range(length)]
    steps = [ids[i:i + 3] for i in range(0, length, 3)]
    chunks = list(pipeline.stream_text(synthetic_steps(steps), []))
    assert "".join(c.text for c in chunks) == ByteTokenizer().decode(ids)
    assert tokenizer.decoded < 8 * length


def test_pieces_split_each_chunk_by_the_token_that_completed_it():
    """Chunk.pieces join to the chunk's text; each names the generated token (by index) whose text
    completed it: a character split over tokens belongs to its last token, text held back for a
    stop string comes with a later chunk under its own token's index."""
    tokenizer = ByteTokenizer()
    pieces = [b"he", b"\xe2", b"\x82\xac", b" ", b"S", b"T", b"x", b"S", b"T", b"OP", b"!"]
    steps = [[tokenizer.pieces[p] for p in pieces[i:i + 2]] for i in range(0, len(pieces), 2)]
    chunks = list(tiny_pipeline().stream_text(synthetic_steps(steps), ["STOP"]))
    for chunk in chunks:
        assert "".join(text for _, text in chunk.pieces) == chunk.text
    by_token: dict[int, str] = {}
    for chunk in chunks:
        for index, text in chunk.pieces:  # a piece may be split between two chunks
            by_token[index] = by_token.get(index, "") + text
    assert by_token == {0: "he", 2: "€", 3: " ", 4: "S", 5: "T", 6: "x"}
    assert chunks[2].pieces == [(0, "e"), (2, "€")]  # "e" was held: it might have begun "STOP"
    assert "".join(c.text for c in chunks) == "he€ STx" and chunks[-1].finish_reason == "stop"


# -- stop strings -----------------------------------------------------------------------------

def stop_run(pieces: list[bytes], stop: list[str], finish_reason: str = "length"):
    """stream_text over one piece per step; returns (chunks, steps consumed, whether the engine was closed)."""
    tokenizer = ByteTokenizer()
    consumed: list[int] = []
    closed = []

    def engine():
        try:
            yield from synthetic_steps(encode_pieces(tokenizer, pieces), finish_reason, consumed)
        finally:
            closed.append(True)

    chunks = list(tiny_pipeline().stream_text(engine(), stop))
    return chunks, len(consumed), bool(closed)


HELLO = [b"he", b"llo", b" wor", b"ld", b" ", b"S", b"T", b"OP", b" ", b"m", b"o", b"r", b"e"]  # "hello world STOP more"


def test_stop_string_spanning_tokens_is_never_emitted():
    """"STOP" over three tokens: output ends right before it, no prefix of it leaks, reason 'stop'."""
    chunks, consumed, closed = stop_run(HELLO, ["STOP"])
    assert "".join(c.text for c in chunks) == "hello world "
    assert chunks[-1].finish_reason == "stop"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert not any("S" in c.text for c in chunks)
    assert consumed == HELLO.index(b"OP") + 1  # the engine is not run past the stop string
    assert closed  # and it is closed (the engine's finally runs)


def test_stop_string_inside_tokens():
    """A stop string that starts and ends mid-token ("TO" inside "ST"+"OP") cuts inside the token."""
    chunks, _, _ = stop_run(HELLO, ["TO"])
    assert "".join(c.text for c in chunks) == "hello world S"
    assert chunks[-1].finish_reason == "stop"


def test_earliest_stop_string_wins():
    """With several stop strings the output ends at the one that occurs first in the text."""
    chunks, _, _ = stop_run(HELLO, ["world", "llo w", "STOP"])
    assert "".join(c.text for c in chunks) == "he"
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("sizes", [[2, 3, 1], [4, 2], [6], [1, 5]])
def test_stop_strings_end_where_one_token_steps_end(sizes):
    """Overlapping stop strings ("abcd" begins before "c" but completes after it): multi-token steps
    give exactly the text of one-token steps — the output never depends on how many tokens a
    speculative step commits."""
    tokenizer = ByteTokenizer()
    ids = [tokenizer.pieces[bytes([c])] for c in b"xabcdy"]
    one_by_one = list(tiny_pipeline().stream_text(synthetic_steps([[t] for t in ids]), ["abcd", "c"]))
    groups, start = [], 0
    for size in sizes:
        groups.append(ids[start:start + size])
        start += size
    chunks = list(tiny_pipeline().stream_text(synthetic_steps(groups), ["abcd", "c"]))
    assert "".join(c.text for c in one_by_one) == "xab" == "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == one_by_one[-1].finish_reason == "stop"


def test_num_tokens_stops_at_the_token_completing_the_stop_string():
    """Chunk.num_tokens counts the tokens plain decoding needed: with a stop string completed inside
    a multi-token step, up to the token completing it; otherwise every token so far."""
    tokenizer = ByteTokenizer()
    tokens = tokenizer.encode("hello world")  # he, llo, " wor", ld
    chunks = list(tiny_pipeline().stream_text(synthetic_steps([tokens[:1], tokens[1:]]), ["zz", "wo"]))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].num_tokens == 3
    chunks = list(tiny_pipeline().stream_text(synthetic_steps([tokens[:1], tokens[1:]]), ["wox"]))
    assert chunks[-1].finish_reason == "length" and [c.num_tokens for c in chunks] == [1, 4]


def test_stop_string_at_the_start_gives_empty_output():
    """A stop string matching the first generated text ends with nothing emitted."""
    chunks, consumed, _ = stop_run(HELLO, ["hel"])
    assert "".join(c.text for c in chunks) == ""
    assert chunks[-1].finish_reason == "stop" and consumed == 2


def test_stop_string_in_the_last_step_beats_length():
    """A stop string completed by the final step still ends the text before it, with reason 'stop'."""
    chunks, _, _ = stop_run(HELLO, ["more"], finish_reason="length")
    assert "".join(c.text for c in chunks) == "hello world STOP "
    assert chunks[-1].finish_reason == "stop"


def test_absent_stop_string_holds_nothing_back_at_the_end():
    """Text held back because it might start a stop string is flushed with the last chunk."""
    chunks, consumed, _ = stop_run(HELLO, ["more!"])
    assert "".join(c.text for c in chunks) == "hello world STOP more"
    assert chunks[-1].finish_reason == "length" and consumed == len(HELLO)


@pytest.mark.parametrize("stop", [[""], ["", "STOP"]])
def test_empty_stop_string_is_ignored_or_refused(stop):
    """An empty stop string matches nowhere in particular: it is refused (ValueError) or ignored.

    Ignoring it means the other stop strings still apply; cutting the text at an arbitrary place
    (after one character, or before the first) is wrong either way.
    """
    expected_chunks, _, _ = stop_run(HELLO, [s for s in stop if s])
    try:
        chunks, _, _ = stop_run(HELLO, stop)
    except ValueError:
        return
    assert "".join(c.text for c in chunks) == "".join(c.text for c in expected_chunks)
    assert chunks[-1].finish_reason == expected_chunks[-1].finish_reason


def test_stop_string_on_generated_text(pipeline):
    """Through generate(): a multi-token stop string taken from the greedy output ends it just before."""
    free = list(pipeline.generate("hello world", max_new_tokens=40, method="ar"))
    full = "".join(c.text for c in free)
    tokens = tokens_of(free)
    # A 3-character stop string (three tokens here) from inside the output, whole characters only.
    start = next(i for i in range(2, len(full) - 3) if "\ufffd" not in full[i:i + 3])
    stop = full[start:start + 3]
    cut = full.index(stop)
    assert len(pipeline.target.tokenizer.encode(stop)) > 1  # the stop string spans several tokens
    for method in METHODS:
        chunks = list(pipeline.generate("hello world", max_new_tokens=40, stop=[stop], method=method))
        assert "".join(c.text for c in chunks) == full[:cut]
        assert chunks[-1].finish_reason == "stop"
        assert len(tokens_of(chunks)) < len(tokens)  # generation ended early


# -- finish reasons, methods, prompts ---------------------------------------------------------

def test_finish_reason_length(pipeline):
    """No EOS produced: exactly max_new_tokens tokens and reason 'length'."""
    chunks = list(pipeline.generate("hello", max_new_tokens=17))
    assert len(tokens_of(chunks)) == 17 and chunks[-1].finish_reason == "length"


def test_finish_reason_eos():
    """The generation stops at the first EOS token (included in the tokens) with reason 'eos'."""
    free = tokens_of(list(tiny_pipeline(eos_token_ids=[]).generate("hello", max_new_tokens=40, method="ar")))
    eos = free[12]
    expected = free[:free.index(eos) + 1]
    pipeline = tiny_pipeline(eos_token_ids=[eos])
    for method in METHODS:
        chunks = list(pipeline.generate("hello", max_new_tokens=40, method=method))
        assert tokens_of(chunks) == expected
        assert chunks[-1].finish_reason == "eos"
        assert "".join(c.text for c in chunks) == pipeline.target.tokenizer.decode(expected)


def test_special_eos_token_is_not_in_the_text():
    """A special EOS token ends the stream but its text ("<eos>") is skipped."""
    tokenizer = ByteTokenizer()
    steps = encode_pieces(tokenizer, [b"he", b"llo"]) + [[EOS]]
    chunks = list(tiny_pipeline().stream_text(synthetic_steps(steps, "eos"), []))
    assert "".join(c.text for c in chunks) == "hello"
    assert chunks[-1].finish_reason == "eos"


def test_all_methods_give_identical_greedy_output(pipeline):
    """Every method: the same greedy tokens and text; each uses only its sources."""
    prompt = "hello hello hello world"
    results = {m: list(pipeline.generate(prompt, max_new_tokens=48, method=m)) for m in METHODS}
    expected = tokens_of(results["ar"])
    allowed = {"ar": {"none"}, "lookup": {"lookup", "none"}, "drafter": {"drafter", "none"},
               "speculative": {"lookup", "drafter", "none"}, "async": {"drafter", "none"},
               "ar_drafter": {"ar_drafter", "none"}}
    for method, chunks in results.items():
        assert tokens_of(chunks) == expected, method
        assert "".join(c.text for c in chunks) == "".join(c.text for c in results["ar"])
        assert set(chunks[-1].step.stats.steps_by_source) <= allowed[method]
    assert "lookup" in results["lookup"][-1].step.stats.steps_by_source
    assert "drafter" in results["drafter"][-1].step.stats.steps_by_source
    assert "ar_drafter" in results["ar_drafter"][-1].step.stats.steps_by_source


def test_methods_agree_without_chat_template_and_with_messages(pipeline):
    """Raw prompts (chat=False) and message lists go through the same engines with identical output."""
    raw = {m: tokens_of(list(pipeline.generate("the world", chat=False, max_new_tokens=20, method=m)))
           for m in METHODS}
    assert len({tuple(v) for v in raw.values()}) == 1
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "he"},
                {"role": "user", "content": "world"}]
    chat = {m: tokens_of(list(pipeline.generate(messages, max_new_tokens=20, method=m))) for m in METHODS}
    assert len({tuple(v) for v in chat.values()}) == 1


def test_encode_uses_chat_template_or_raw_text(pipeline):
    """chat=True wraps the prompt in the template; chat=False encodes the bare text."""
    tokenizer = pipeline.target.tokenizer
    assert pipeline.encode("hello", chat=False) == tokenizer.encode("hello")
    assert pipeline.encode("hello") == [BOS, USER] + tokenizer.encode("hello") + [ASSISTANT]
    messages = [{"role": "user", "content": "hi"}]
    assert pipeline.encode(messages, chat=False) == pipeline.encode("hi")  # messages always use the template


def test_no_chat_template_refuses_chat(pipeline):
    """A tokenizer without a chat template: chat prompts fail with ValueError, raw prompts work."""
    pipeline.target.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        list(pipeline.generate("hello", max_new_tokens=4))
    assert len(tokens_of(list(pipeline.generate("hello", chat=False, max_new_tokens=4)))) == 4


def test_drafter_method_without_drafter_raises():
    """method='drafter' on a pipeline without a drafter is a ValueError, not a silent fallback."""
    pipeline = tiny_pipeline(drafter=False)
    with pytest.raises(ValueError, match="drafter"):
        list(pipeline.generate("hello", max_new_tokens=4, method="drafter"))
    # The other methods still work without a drafter and agree.
    outputs = {m: tokens_of(list(pipeline.generate("hello", max_new_tokens=16, method=m)))
               for m in ("ar", "lookup", "speculative")}
    assert outputs["ar"] == outputs["lookup"] == outputs["speculative"]


def test_unknown_method_raises(pipeline):
    """A misspelt method is refused instead of silently running speculative decoding."""
    with pytest.raises(ValueError, match="method"):
        list(pipeline.generate("hello", max_new_tokens=4, method="AR"))


def test_empty_raw_prompt_is_a_prompt_error(pipeline):
    """An empty raw prompt (no tokens) raises PromptError (a ValueError) before generating."""
    with pytest.raises(PromptError, match="empty"):
        list(pipeline.generate("", chat=False, max_new_tokens=4))


def test_seeded_sampling_is_reproducible(pipeline):
    """Sampling with a seed gives the same tokens twice; a different seed (almost surely) differs."""
    def sample(seed):
        return tokens_of(list(pipeline.generate("hello", max_new_tokens=24, temperature=1.0, seed=seed)))
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_generation_config_carries_eos_and_sampling():
    """generation_config copies the target's EOS ids and builds the sampling config."""
    pipeline = tiny_pipeline(eos_token_ids=[EOS, 9])
    config = pipeline.generation_config(max_new_tokens=5, temperature=0.5, top_k=3, top_p=0.9, seed=1)
    assert config.eos_token_ids == [EOS, 9] and config.max_new_tokens == 5
    assert (config.sampling.temperature, config.sampling.top_k, config.sampling.top_p, config.sampling.seed) == (0.5, 3, 0.9, 1)


# -- the real embedded target -----------------------------------------------------------------

@pytest.mark.slow
def test_untrained_drafter_on_real_target_matches_ar():
    """SmolLM2 with an untrained 2-layer drafter: 24 speculative tokens identical to plain AR decoding."""
    pipeline = Pipeline.load(drafter="untrained", dtype=torch.float32, drafter_layers=[0, 1])
    assert pipeline.drafter is not None and pipeline.drafter.config.target_layers == [0, 1]
    assert pipeline.drafter_source.startswith("UNTRAINED")
    speculative = list(pipeline.generate("Say hi", max_new_tokens=24, method="speculative"))
    ar = list(pipeline.generate("Say hi", max_new_tokens=24, method="ar"))
    assert len(tokens_of(ar)) == 24 and ar[-1].finish_reason == "length"
    assert tokens_of(speculative) == tokens_of(ar)
    assert "".join(c.text for c in speculative) == "".join(c.text for c in ar)
    assert speculative[-1].step.stats.steps_by_source.get("drafter", 0) > 0


@pytest.mark.slow
def test_incremental_text_with_the_real_tokenizer():
    """SmolLM2's byte-level BPE splits an emoji and CJK characters over tokens: streamed one token
    per step, the chunks still join to decode(all tokens) and none holds half a character."""
    from d3d.loading import load_target

    tokenizer = load_target(None, torch.float32).tokenizer
    text = "Hello , world! café 😀 don't . ok 日本語 — ∑ x² 🚀🚀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some tokens hold part of a character
    pipeline = Pipeline(Target(None, tokenizer, "smollm2", []))
    chunks = list(pipeline.stream_text(synthetic_steps([[i] for i in ids]), []))
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in c.text for c in chunks)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shipped_drafter_is_the_default_and_lossless(dtype):
    """The drafter shipped in the package loads as the default for SmolLM2, drafts, and greedy
    speculative output (drafter alone and gated with lookup) is AR's token for token."""
    pipeline = Pipeline.load(dtype=dtype)
    assert pipeline.drafter_source == "shipped default"
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    ar = tokens_of(list(pipeline.generate(prompt, max_new_tokens=48, method="ar")))
    for method in ("drafter", "speculative"):
        chunks = list(pipeline.generate(prompt, max_new_tokens=48, method=method))
        assert tokens_of(chunks) == ar, method
        if method == "drafter":
            assert chunks[-1].step.stats.steps_by_source.get("drafter", 0) > 0
