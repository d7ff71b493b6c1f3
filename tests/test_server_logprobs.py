"""The server's logprobs and token ids (`d3d.logprobs`, `d3d.openai_schema`), end to end through the
official `openai` client on the same tiny server as tests/test_server.py: the target's own
log-probabilities whatever the method, streamed chunks joining to the whole answer, vLLM's
token-id extensions. (Their refusals — logprobs on /v1/completions, with method async, too many
alternatives — are among test_server.py's 400 cases.)"""

from __future__ import annotations

import pytest
import torch

from test_server import MESSAGES, MODEL, PROMPT, base_url, client, pipeline  # noqa: F401  (fixtures)


def reference_logprobs(pipeline, messages, max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Plain decoding's tokens, and the target's log-softmax (T, V) at each of them from one
    teacher-forced forward over prompt + answer (computed apart from the engine)."""
    prompt = pipeline.encode(messages)
    chunks = list(pipeline.generate(messages, max_new_tokens=max_tokens, temperature=0.0, method="ar"))
    tokens = [t for c in chunks for t in c.step.tokens]
    decoder = pipeline.target.decoder
    ids = torch.tensor([prompt + tokens])
    logits = decoder(ids, cache=decoder.new_cache(ids.shape[1]))[0, len(prompt) - 1:-1]
    return tokens, torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("method", ["ar", "speculative", "lookup", "drafter", "ar_drafter"])
def test_chat_logprobs_are_the_targets_own_whatever_the_method(client, pipeline, method):
    """logprobs / top_logprobs at T = 0 through the openai client: one entry per completion token,
    each the target's log-probability of that token (the argmax: the first alternative) and its
    top alternatives; every speculative method reports exactly plain decoding's numbers."""
    def ask(chosen):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
                                              logprobs=True, top_logprobs=3, extra_body={"d3d": {"method": chosen}})
    response = ask(method)
    entries = response.choices[0].logprobs.content
    tokens, logprobs = reference_logprobs(pipeline, MESSAGES, 24)
    assert len(entries) == response.usage.completion_tokens == len(tokens) == 24
    tokenizer = pipeline.target.tokenizer
    for entry, token, row in zip(entries, tokens, logprobs):
        assert entry.token == tokenizer.decode([token], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-5)
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=1e-5)
        assert entry.top_logprobs[0].logprob == entry.logprob and len(entry.top_logprobs) == 3
    if method != "ar":
        plain = ask("ar").choices[0].logprobs.content
        assert [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in entries] == \
            [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in plain]


def test_streamed_logprobs_join_to_the_whole_answers(client, pipeline):
    """Streamed, each chunk carries the entries of the tokens its text stands for; they join to the
    non-streamed entries. With a stop string, both end at the token that completed it."""
    for stop in (None, ["l"]):
        kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=30, logprobs=True, top_logprobs=2,
                      stop=stop)
        whole = client.chat.completions.create(**kwargs)
        stream = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        joined = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                  for e in chunk.choices[0].logprobs.content]
        assert [e.model_dump() for e in joined] == [e.model_dump() for e in whole.choices[0].logprobs.content]
        assert len(joined) == whole.usage.completion_tokens == stream[-1].usage.completion_tokens
    assert whole.choices[0].finish_reason == "stop" and whole.usage.completion_tokens < 30


def test_vllm_token_id_extensions(client, pipeline):
    """vLLM's return_tokens_as_token_ids names logprobs entries "token_id:N"; return_token_ids adds the
    prompt's ids and the completion's (streamed: the prompt's on the first chunk, each chunk its own)."""
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16,
                                               logprobs=True, top_logprobs=2, extra_body=extra)
    tokens, _ = reference_logprobs(pipeline, MESSAGES, 16)
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == tokens
    assert response.model_extra["prompt_token_ids"] == pipeline.encode(MESSAGES)
    assert [e.token for e in choice.logprobs.content] == [f"token_id:{t}" for t in tokens]
    assert all(a.token.startswith("token_id:") for e in choice.logprobs.content for a in e.top_logprobs)
    stream = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].model_extra["prompt_token_ids"] == pipeline.encode(MESSAGES)
    assert not any("prompt_token_ids" in (chunk.model_extra or {}) for chunk in stream[1:])
    assert [t for chunk in stream for t in chunk.choices[0].model_extra["token_ids"]] == tokens
    completion = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8,
                                           extra_body={"return_token_ids": True})
    assert completion.model_extra["prompt_token_ids"] == pipeline.encode(PROMPT, chat=False)
    assert len(completion.choices[0].model_extra["token_ids"]) == 8
