"""The OpenAI-compatible server end to end: a real uvicorn server in this process, the real SmolLM2
model (cache mode sparsex), the official `openai` client (httpx where the raw shape matters).

Prompts that must not hit any cache run in a fresh tenant namespace (a unique X-Tenant value):
that keeps tests independent of their order without resetting the server's cache.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparsex import LLM, SamplingParams
from sparsex.config import EngineConfig
from sparsex.entrypoints.async_engine import AsyncLLM
from sparsex.entrypoints.background_server import BackgroundServer
from sparsex.entrypoints.openai_server import build_app
from sparsex.entrypoints.settings import ServerSettings

from geo_passages import PASSAGES

pytestmark = pytest.mark.model

KEY = "test-key"
TENANT = "X-Tenant"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The server's and the offline reference's knobs (pool size aside, which does not change numerics).
KNOBS = dict(model="smollm2-135m-instruct", dtype="float32", cache="sparsex", seed=0, max_model_len=1024)
# A passage well over min_segment_tokens (16) so the segment index keeps it.
PASSAGE_A = ("The Amazon river flows through Peru, Colombia and Brazil before reaching the Atlantic Ocean. "
             "It carries more water than any other river on Earth, and its basin covers about seven million "
             "square kilometres of tropical forest. ")
PASSAGE_B = ("Mount Kilimanjaro is a dormant volcano in Tanzania. Its highest summit, Uhuru Peak, rises almost "
             "5,900 metres above sea level, which makes it the tallest free-standing mountain in the world. ")


class Server:
    def __init__(self, srv: BackgroundServer, llm: AsyncLLM, model: str):
        self.srv, self.llm, self.model, self.url = srv, llm, model, srv.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def post(self, path: str, body, headers: dict | None = None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={**AUTH, **(headers or {})}, timeout=300, **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample as 'name{label="v",...}' -> value."""
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, deadline_s: float = 300.0) -> None:
        """Until the engine has no request left (aborts land asynchronously). The deadline only
        guards against a hang; it is no performance threshold."""
        end = time.monotonic() + deadline_s
        while self.llm.call_sync(lambda e: e.has_unfinished_requests()):
            assert time.monotonic() < end, "engine never went idle"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM.from_config(EngineConfig(**KNOBS, num_blocks=512))
    settings = ServerSettings(api_key=KEY, tenant_header=TENANT, allow_shared_segments=True, allow_reuse_overrides=True)
    srv = BackgroundServer(build_app(llm, settings))
    yield Server(srv, llm, llm.model_name)
    srv.stop()
    assert llm.error is None


@pytest.fixture(scope="module")
def strict(server):
    """A second app over the same engine with the defaults: no shared segments, no tenant header,
    no per-request reuse overrides."""
    srv = BackgroundServer(build_app(server.llm, ServerSettings(shutdown_engine=False)))
    yield Server(srv, server.llm, server.model)
    srv.stop()


@pytest.fixture(scope="module")
def offline():
    return LLM(**KNOBS, num_blocks=128)


def fresh() -> dict[str, str]:
    """Headers for a never-seen tenant: nothing cached for it."""
    return {TENANT: uuid.uuid4().hex}


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ---- basics -----------------------------------------------------------------------------------
def test_models_health_tokenize(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert httpx.get(server.url + "/health").status_code == 200         # no key needed for probes
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PASSAGE_A}]
    tok = server.post("/tokenize", {"messages": messages}).json()
    ref = server.llm.call_sync(lambda e: e.chat_to_prompt(messages))
    assert tok["tokens"] == ref.token_ids and tok["count"] == len(ref.token_ids)
    assert tok["segments"] == [[s.start, s.end] for s in ref.segments] and len(tok["segments"]) == 2
    assert tok["max_model_len"] == KNOBS["max_model_len"]


# ---- parity with the offline API --------------------------------------------------------------
def test_chat_greedy_matches_offline(server, offline):
    for i, stream in enumerate((False, True)):
        messages = [{"role": "user", "content": f"Write one sentence about the number {1234 + i}."}]
        ref = offline.chat(messages, greedy(), use_tqdm=False)[0]
        kw = dict(model=server.model, messages=messages, temperature=0, max_tokens=8, extra_headers=fresh())
        if stream:
            text, chunks = stream_text(server.client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
            usage = chunks[-1].usage
            assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        else:
            resp = server.client.chat.completions.create(**kw)
            text, usage = resp.choices[0].message.content, resp.usage
            assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
            assert resp.model == server.model and resp.id.startswith("chatcmpl-")
        assert text == ref.outputs[0].text
        assert usage.prompt_tokens == len(ref.prompt_token_ids)
        assert usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.prompt_tokens_details.cached_tokens == 0


def test_completion_greedy_matches_offline(server, offline):
    for i, stream in enumerate((False, True)):
        prompt = f"The {i + 7}th planet of the solar system is"
        ref = offline.generate(prompt, greedy(), use_tqdm=False)[0]
        kw = dict(model=server.model, prompt=prompt, temperature=0, max_tokens=8, extra_headers=fresh())
        if stream:
            chunks = list(server.client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks)
        else:
            resp = server.client.completions.create(**kw)
            text = resp.choices[0].text
            assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
            assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert text == ref.outputs[0].text


def test_sampling_options_match_offline(server, offline):
    # seeded sampling (a per-request generator) and a stop string, streamed and not
    messages = [{"role": "user", "content": "List three colours of the rainbow, separated by commas."}]
    ref = offline.chat(messages, SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10), use_tqdm=False)[0]
    got = server.client.chat.completions.create(model=server.model, messages=messages, temperature=1.0, top_p=0.9,
                                                seed=42, max_tokens=10, extra_headers=fresh())
    assert got.choices[0].message.content == ref.outputs[0].text

    base = offline.chat(messages, greedy(12), use_tqdm=False)[0].outputs[0].text
    stop = base.strip().split()[2][:3]          # a piece of the third word: cuts mid-text
    ref = offline.chat(messages, greedy(12, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop" and ref.text != base
    kw = dict(model=server.model, messages=messages, temperature=0, max_tokens=12, stop=[stop])
    whole = server.client.chat.completions.create(extra_headers=fresh(), **kw)
    assert whole.choices[0].message.content == ref.text and whole.choices[0].finish_reason == "stop"
    text, chunks = stream_text(server.client.chat.completions.create(stream=True, extra_headers=fresh(), **kw))
    assert text == ref.text                     # the held-back tail never leaked the stop string
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_n_and_logprobs(server):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    resp = server.client.chat.completions.create(model=server.model, messages=msgs, n=3, temperature=1.0, seed=7,
                                                 max_tokens=4, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)
    for c in resp.choices:
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
        for t in c.logprobs.content:
            assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
    cmpl = server.client.completions.create(model=server.model, prompt=["Hello,", "One, two,"], n=2, max_tokens=3,
                                            temperature=0, logprobs=2)
    assert sorted(c.index for c in cmpl.choices) == [0, 1, 2, 3]
    for c in cmpl.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 3
        assert "".join(c.logprobs.tokens) == c.text and c.logprobs.text_offset[0] == 0


# ---- caching, segments, tenants ---------------------------------------------------------------
def _chat_usage(server, messages, headers, **kw):
    resp = server.client.chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=2,
                                                 extra_headers=headers, **kw)
    return resp.usage


def test_cached_tokens_move_on_repeat(server):
    tenant = fresh()
    messages = [{"role": "user", "content": PASSAGE_A + "Which ocean does it reach?"}]
    first = _chat_usage(server, messages, tenant)
    again = _chat_usage(server, messages, tenant)
    assert first.prompt_tokens == again.prompt_tokens == server.post("/tokenize", {"messages": messages}).json()["count"]
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.prompt_tokens
    sx = again.model_extra["sparsex"]
    assert cached == sx["prefix_cached_tokens"] + sx["segment_reused_tokens"]


def test_segments_are_reused_out_of_order(server):
    tenant = fresh()
    q = "\nQuestion: which of these is in Africa?\nAnswer:"

    def run(segments):
        # two short passages: below the engine's min_blend_tokens, so this request asks to blend anyway
        r = server.post("/v1/completions", {"model": server.model, "segments": segments, "max_tokens": 2,
                                            "temperature": 0, "reuse": {"min_blend_tokens": 0}}, headers=tenant)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    first = run([PASSAGE_A, PASSAGE_B, q])
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    swapped = run([PASSAGE_B, PASSAGE_A, q])            # no common prefix: only segment reuse can help
    sx = swapped["sparsex"]
    assert sx["prefix_cached_tokens"] == 0 and sx["segment_reused_tokens"] > 0
    assert swapped["prompt_tokens_details"]["cached_tokens"] == sx["segment_reused_tokens"]
    # the openai SDK needs `prompt`: an empty one next to `segments` is accepted
    resp = server.client.completions.create(model=server.model, prompt="", max_tokens=2, temperature=0,
                                            extra_body={"segments": [PASSAGE_B, PASSAGE_A, q]}, extra_headers=tenant)
    assert resp.usage.prompt_tokens == swapped["prompt_tokens"]
    # at the engine default (min_blend_tokens=256) hits this short are not blended: the request is exact
    r = server.post("/v1/completions", {"model": server.model, "segments": [q, PASSAGE_A, PASSAGE_B, q],
                                        "max_tokens": 2, "temperature": 0}, headers=tenant)
    assert r.status_code == 200, r.text
    exact = r.json()["usage"]["sparsex"]
    assert exact["segment_reused_tokens"] == 0 and exact["reused_spans"] == []
    assert "min_blend_tokens" in exact["reuse_skipped"] and "< 256" in exact["reuse_skipped"]   # and says why


def test_reuse_overrides_need_the_flag(server, strict):
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "reuse": {"recompute_ratio": 0.5}}
    refused = httpx.post(strict.url + "/v1/chat/completions", json=body)
    _assert_error(refused, 400, "reuse")
    assert refused.json()["error"]["code"] == "reuse_overrides_disabled"
    assert "--allow-reuse-overrides" in refused.json()["error"]["message"]
    refused = httpx.post(strict.url + "/v1/completions", json={**body, "messages": None, "prompt": "hi"})
    _assert_error(refused, 400, "reuse")
    assert httpx.post(strict.url + "/v1/chat/completions", json={**body, "reuse": None}).status_code == 200
    assert server.post("/v1/chat/completions", body, headers=fresh()).status_code == 200     # the flag's server
    # a misspelt knob is named, not silently ignored
    _assert_error(server.post("/v1/chat/completions", {**body, "reuse": {"recompute_rate": 0.5}}), 400,
                  "reuse.recompute_rate")


INGEST_PASSAGES = [PASSAGE_A, PASSAGE_B, *(PASSAGES[i] for i in (2, 3, 4, 6, 7))]
INGEST_PREFIX = "You answer questions about geography using only the passages that follow. " * 11


def test_segments_endpoint_ingests_per_tenant(server):
    a, b = fresh(), fresh()
    question = [INGEST_PREFIX, *INGEST_PASSAGES[::-1], "\nQuestion: which passage mentions a seal?\nAnswer:"]

    def ask(headers):
        r = server.post("/v1/completions", {"model": server.model, "segments": question, "max_tokens": 1,
                                            "temperature": 0}, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["sparsex"]

    assert httpx.post(server.url + "/v1/segments", json={"segments": ["x"]}).status_code == 401     # same auth
    r = server.post("/v1/segments", {"model": server.model, "segments": INGEST_PASSAGES, "prefix": INGEST_PREFIX,
                                     "group_size": 4, "passes": 2}, headers=a)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "segments.ingest" and r.headers["x-sparsex-cache-scope"] == "tenant"
    assert got["num_prompts"] == 2 * 2 and got["num_segments"] == len(INGEST_PASSAGES)
    assert got["num_tokens_computed"] > 0 and got["num_segment_entries"] >= len(INGEST_PASSAGES)
    assert ask(b)["segment_reused_tokens"] == 0          # another tenant finds nothing
    hit = ask(a)                                         # positive control: the ingesting tenant
    assert hit["segment_reused_tokens"] > 0 and hit["reuse_skipped"] is None
    assert sum(span["end"] - span["start"] for span in hit["reused_spans"]) == hit["segment_reused_tokens"]
    for span in hit["reused_spans"]:
        assert set(span) == {"start", "end", "source", "prompt_index"}
        assert span["source"] in ("segment", "indexed", "request", "approx_prefix")


def test_stuffed_rag_chat_reuses_passages_with_no_client_change(server):
    """LangChain's usual RAG prompt through the official client: every retrieved passage joined into
    ONE system message, the question in the user message, nothing marked. The second conversation
    retrieves the same passages in another order: they are found by content."""
    tenant = fresh()

    def ask(order, question):
        system = INGEST_PREFIX + "\n\n" + "\n\n".join(PASSAGES[i] for i in order)
        resp = server.client.chat.completions.create(
            model=server.model, temperature=0, max_tokens=2, extra_headers=tenant,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
        return resp.usage

    before = server.metrics()
    first = ask(range(8), "Which river reaches the Atlantic?")
    assert first.prompt_tokens_details.cached_tokens == 0
    second = ask([5, 2, 7, 0, 3, 6, 1, 4], "Which lake holds a seal?")
    sx = second.model_extra["sparsex"]
    prefix = sx["prefix_cached_tokens"]
    assert prefix > 0                                   # the shared instructions: an exact prefix hit
    cached = second.prompt_tokens_details.cached_tokens
    assert cached == prefix + sx["segment_reused_tokens"]
    assert sx["transparent_reused_tokens"] == sx["segment_reused_tokens"] >= 256   # found by content
    assert cached > 2 * prefix
    assert {span["source"] for span in sx["reused_spans"]} <= {"indexed", "request"}
    after = server.metrics()
    grew = after["sparsex:transparent_reused_tokens_total"] - before.get("sparsex:transparent_reused_tokens_total", 0)
    assert grew >= sx["transparent_reused_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"segments": []}, "segments"),
    ({"segments": ["ok", 3]}, "segments.1"),
    ({"segments": ["ok"], "passes": 0}, "passes"),
    ({"segments": ["ok"], "group_size": 0}, "group_size"),
    ({"segments": ["ok", "hello " * 1100]}, "segments"),
    ({"segments": ["ok"], "model": "gpt-4"}, "model"),
])
def test_segments_endpoint_errors(server, body, param):
    _assert_error(server.post("/v1/segments", body, headers=fresh()), 400, param)


def test_usage_reports_reused_spans_and_skip_reason(server):
    r = server.post("/v1/completions", {"model": server.model, "prompt": "Hello there", "max_tokens": 1},
                    headers=fresh())
    sx = r.json()["usage"]["sparsex"]
    assert sx["reused_spans"] == [] and sx["reuse_skipped"] is None     # a cold prompt: nothing found


def test_tenant_isolation(server):
    messages = [{"role": "user", "content": PASSAGE_B + "How tall is it?"}]
    a, b = fresh(), fresh()
    assert _chat_usage(server, messages, a).prompt_tokens_details.cached_tokens == 0
    hit = _chat_usage(server, messages, a)                                      # positive control
    assert hit.prompt_tokens_details.cached_tokens > 0
    miss = _chat_usage(server, messages, b)                                     # another tenant
    assert miss.prompt_tokens_details.cached_tokens == 0
    assert miss.model_extra["sparsex"]["segment_reused_tokens"] == 0
    # the header overrides the body's cache_salt, and a body salt equal to a tenant's name is
    # another namespace (no way into tenant a's entries without its header)
    over = _chat_usage(server, messages, a, extra_body={"cache_salt": "anything"})
    assert over.prompt_tokens_details.cached_tokens > 0
    spoof = _chat_usage(server, messages, {}, extra_body={"cache_salt": a[TENANT]})
    assert spoof.prompt_tokens_details.cached_tokens == 0
    # segments are isolated too: tenant b, reordered passages, no reuse of tenant a's
    r = [server.post("/v1/completions", {"model": server.model, "segments": segs, "max_tokens": 1}, headers=h).json()
         for segs, h in (([PASSAGE_A, PASSAGE_B, "?"], a), ([PASSAGE_B, PASSAGE_A, "?"], b))]
    assert r[1]["usage"]["sparsex"]["segment_reused_tokens"] == 0


def test_shared_scope(server, strict):
    shared = {"cache_segment": {"scope": "shared"}}
    # a unique system message first: nothing in the shared (= unsalted) namespace starts like this
    messages = [{"role": "system", "content": [{"type": "text", "text": f"Reference {uuid.uuid4().hex}.", **shared}]},
                {"role": "user", "content": [{"type": "text", "text": PASSAGE_A, **shared}]}]
    r1 = server.post("/v1/chat/completions", {"model": server.model, "messages": messages, "max_tokens": 1},
                     headers=fresh())
    assert r1.status_code == 200 and r1.headers["x-sparsex-cache-scope"] == "shared"
    assert r1.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r2 = server.post("/v1/chat/completions", {"model": server.model, "messages": messages, "max_tokens": 1},
                     headers=fresh())                   # another tenant shares it, by request
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    mixed = messages + [{"role": "user", "content": "And?"}]      # an unmarked part keeps the tenant scope
    r3 = server.post("/v1/chat/completions", {"model": server.model, "messages": mixed, "max_tokens": 1},
                     headers=fresh())
    assert r3.headers["x-sparsex-cache-scope"] == "tenant"
    assert r3.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    refused = httpx.post(strict.url + "/v1/chat/completions", json={"model": server.model, "messages": messages})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "shared_segments_disabled"


# ---- errors and auth --------------------------------------------------------------------------
LONG = "hello " * 1100          # > max_model_len tokens
CHAT_ERRORS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, None),
    ({"messages": [{"role": "user", "content": "hi"}], "reuse": {"selector": "nope"}}, "reuse"),
    ({"messages": [{"role": "user", "content": "hi"}], "reuse": {"min_context_tokens": -1}}, None),
    ({"messages": [{"role": "user", "content": "hi"}], "reuse": {"min_blend_tokens": -1}}, None),
    ({"messages": [{"role": "user", "content": "hi"}], "reuse": {"candidate_ratio": 2.0}}, None),
    ({"messages": [{"role": "user", "content": "hi"}], "reuse": {"boundary_share": -0.1}}, None),
    ({"messages": [{"role": "user", "content": "hi"}], "reuse": {"merge_encodings": 0}}, None),
    ({"messages": [{"role": "user", "content": "hi"}], "reuse": {"blend": "sometimes"}}, None),
    ({"messages": [{"role": "user", "content": "hi"}], "reuse": {"rescore_layers": 2, "candidate_ratio": 0.05}}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 70}, "seed"),
]
COMPLETION_ERRORS = [
    ({"prompt": [10 ** 8]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": LONG}, "prompt"),
    ({"prompt": "hi", "segments": ["a"]}, "prompt"),
    ({}, "prompt"),
    ({"segments": [{"text": "a", "token_ids": [1]}]}, "segments.0"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": ["a"] * 65, "n": 2}, "prompt"),
]


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("body,param", CHAT_ERRORS, ids=[p or next(iter(set(b) - {"messages"})) for b, p in CHAT_ERRORS])
def test_chat_errors(server, body, param):
    _assert_error(server.post("/v1/chat/completions", {"model": server.model, "max_tokens": 2, **body}), 400, param)


@pytest.mark.parametrize("body,param", COMPLETION_ERRORS)
def test_completion_errors(server, body, param):
    _assert_error(server.post("/v1/completions", {"model": server.model, "max_tokens": 2, **body}), 400, param)


def test_protocol_errors(server):
    raw = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers={**AUTH, "content-type": "application/json"})
    _assert_error(raw, 400)
    _assert_error(server.post("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), 400, "prompt")
    _assert_error(httpx.get(server.url + "/v1/nope", headers=AUTH), 404)
    _assert_error(httpx.get(server.url + "/v1/completions", headers=AUTH), 405)
    with pytest.raises(openai.BadRequestError) as exc:              # what SDK users see
        server.client.chat.completions.create(model=server.model, messages=[], max_tokens=2)
    assert exc.value.status_code == 400 and exc.value.param == "messages"


def test_auth(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        _assert_error(r, 401)
        assert r.json()["error"]["code"] == "invalid_api_key"
    _assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "a"}), 401)
    _assert_error(httpx.post(server.url + "/v1/completions", content=b"{bad"), 401)    # before any parsing
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert server.post("/v1/completions", body).status_code == 200


# ---- load, disconnects, metrics ---------------------------------------------------------------
def test_concurrent_streams_with_disconnects(server):
    """32 streaming clients; 8 hang up after their first token while asking for 512 (so only an
    abort can end them). The others are unaffected and nothing leaks."""
    before = server.metrics()
    leavers = set(range(0, 32, 4))

    async def one(client: openai.AsyncOpenAI, i: int):
        leave = i in leavers
        stream = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": f"Say something about the number {i}."}],
            temperature=0, max_tokens=512 if leave else 4, stream=True,
            extra_body={"ignore_eos": True}, extra_headers=fresh())
        got, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                got += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if leave and got:
                await stream.close()                # hang up mid-stream
                return None
        return finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert all(results[i] == "length" for i in range(32) if i not in leavers)
    server.wait_idle()

    def audit(engine):
        engine.check_integrity()        # every block's refcount == its holders
        held = sum(1 for b in engine.kv.pool.blocks if b.ref_cnt > 0)
        pinned = len(engine.segment_index.block_refs()) if engine.segment_index is not None else 0
        return len(engine.requests), len(engine.scheduler.running), len(engine.scheduler.waiting), held, pinned

    n_requests, running, waiting, held, pinned = server.llm.call_sync(audit)
    assert (n_requests, running, waiting) == (0, 0, 0)
    assert held == pinned           # only segment-cache entries hold blocks; every request's are free or cached
    after = server.metrics()
    key = 'sparsex:request_success_total{finished_reason="abort"}'
    assert after.get(key, 0) - before.get(key, 0) == len(leavers)


def test_non_streaming_disconnect_aborts(server):
    before = server.metrics()
    key = 'sparsex:request_success_total{finished_reason="abort"}'

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300) as client:
            body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            while True:                              # until the engine runs it
                m = (await client.get("/metrics")).text
                if 'sparsex:num_requests_running{model_name="%s"} 1.0' % server.model in m:
                    break
                assert not task.done(), task
                await asyncio.sleep(0.05)
            task.cancel()                            # the client goes away: its connection closes

    asyncio.run(main())
    server.wait_idle()
    assert server.metrics().get(key, 0) - before.get(key, 0) == 1
    server.llm.call_sync(lambda e: e.check_integrity())


def test_metrics(server):
    before = server.metrics()
    resp = server.client.chat.completions.create(model=server.model, max_tokens=3, temperature=0,
                                                 messages=[{"role": "user", "content": PASSAGE_A + "Summarise."}])
    _chat_usage(server, [{"role": "user", "content": PASSAGE_A + "Summarise."}], {})
    after = server.metrics()
    for name in ("sparsex:time_to_first_token_seconds_count", "sparsex:inter_token_latency_seconds_count",
                 "sparsex:e2e_request_latency_seconds_count", "sparsex:prefix_cache_queries_total",
                 "sparsex:prefix_cache_hits_total", "sparsex:prompt_tokens_total", "sparsex:generation_tokens_total",
                 'sparsex:request_success_total{finished_reason="length"}'):
        assert after[name] > before.get(name, 0), name
    for name in ("sparsex:num_requests_running", "sparsex:num_requests_waiting", "sparsex:kv_cache_usage_perc",
                 "sparsex:segment_cache_queries_total", "sparsex:segment_cache_hits_total",
                 "sparsex:sparse_kv_recomputed_tokens_total", "sparsex:sparse_q_selection_seconds_count",
                 "sparsex:num_preemptions_total"):
        assert name in after, name
    assert 0.0 <= after["sparsex:kv_cache_usage_perc"] <= 1.0
    # the reuse profile and knobs in force, published once
    assert after['sparsex:reuse_config_info{full_layers="4",profile_source="built-in",recompute_ratio="0.125",'
                 'rescore_layers="auto",reuse_profile="default",selector="sparse_q"}'] == 1.0
    assert after["sparsex:generation_tokens_total"] - before["sparsex:generation_tokens_total"] >= \
        resp.usage.completion_tokens
    # segment reuse earlier in this module moved the segment counters
    assert after["sparsex:segment_cache_hits_total"] > 0 and after["sparsex:sparse_q_selection_seconds_count"] > 0


# ---- fuzzing ----------------------------------------------------------------------------------
def _bound(body) -> None:
    """Keep generated requests cheap: at most 2 new tokens and 2 choices (invalid values stay)."""
    if not isinstance(body, dict):
        return
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 2:
            body[k] = 2
    if "max_tokens" not in body:
        body["max_tokens"] = 2
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2


def test_openapi_fuzz_finds_no_5xx(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/tokenize"}
    for op in operations:
        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case):
            _bound(case.body)
            resp = case.call(base_url=server.url, headers=AUTH, timeout=300)
            assert resp.status_code < 500, (case.method, case.path, case.body, resp.status_code, resp.text)

        check()
    assert server.llm.error is None
