"""Structured outputs (response_format / structured_outputs, through xgrammar) and logit_bias.

Unit: the bitmask application against a plain-torch reference, the sampler's bias and mask, the
parameter checks and the grammar compile cache. Model: a real server on SmolLM2 driven by the
official `openai` client: every json_schema output validates (jsonschema), greedy and seeded,
streamed too; constrained and free requests share a batch; logit_bias bans and forces; bad input
gets a 400 naming it and the engine keeps serving.
"""
from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import jsonschema
import openai
import pytest
import torch

from sparsex.config import EngineConfig
from sparsex.entrypoints.async_engine import AsyncLLM
from sparsex.entrypoints.background_server import BackgroundServer
from sparsex.entrypoints.openai_server import build_app
from sparsex.entrypoints.settings import ServerSettings
from sparsex.layers.sampler import Sampler, SamplingBatch
from sparsex.layers.token_bitmask import apply_token_bitmask_, unpack_bitmask
from sparsex.sampling_params import SamplingParams, StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")

# ---- unit: the bitmask and the sampler -----------------------------------------------------------


def _reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bit by bit, in Python ints: [rows, vocab] bool."""
    out = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    for r in range(bitmask.shape[0]):
        for t in range(vocab):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            out[r, t] = bool((word >> (t % 32)) & 1)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("vocab", [64, 100, 130])
def test_bitmask_matches_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1                                  # an unconstrained row
    bitmask[2, 0] = -2**31                           # only the sign bit: token 31 allowed in word 0
    assert torch.equal(unpack_bitmask(bitmask, vocab), _reference_allowed(bitmask, vocab))
    logits = torch.randn(3, vocab, generator=gen)
    expected = logits.masked_fill(~_reference_allowed(bitmask, vocab), float("-inf"))
    assert torch.equal(apply_token_bitmask_(logits.clone(), bitmask), expected)
    # xgrammar's own CPU kernel agrees
    ours = apply_token_bitmask_(logits.clone(), bitmask)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab)
    assert torch.equal(ours, theirs)


@pytest.mark.unit
def test_bitmask_narrower_than_logits_disallows_the_tail():
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)       # 64 tokens allowed
    assert unpack_bitmask(bitmask, 70)[0].tolist() == [True] * 64 + [False] * 6


@pytest.mark.unit
def test_sampler_applies_bias_then_mask_and_keeps_raw_logprobs():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, logprobs=1, logit_bias={7: 100.0}),
              SamplingParams(temperature=0, logprobs=1, logit_bias={7: 100.0, 9: 100.0}),
              SamplingParams(temperature=0.8, seed=1, logprobs=1)]
    gens = [None, None, torch.Generator().manual_seed(1)]
    batch = SamplingBatch.from_params(params, gens, "cpu")
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[1, 0] = ~(1 << 7)                                  # row 1: token 7 disallowed despite its bias
    bitmask[2] = 0
    bitmask[2, 1] = 1 << (40 - 32)                             # row 2: only token 40
    batch.token_bitmask = bitmask
    raw = logits.clone()
    out = Sampler()(logits, batch)
    assert torch.equal(logits, raw)                            # the input is never modified
    assert out.sampled_token_ids.tolist() == [7, 9, 40]
    assert torch.allclose(out.sampled_logprobs, torch.log_softmax(raw, -1)[[0, 1, 2], [7, 9, 40]])


@pytest.mark.unit
def test_params_checks_name_the_problem():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, json_object=True)
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="schema object"):
        StructuredOutputsParams(json="[1]")
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(logit_bias={"5": 1.0})
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


@pytest.mark.unit
def test_compile_cache_and_errors(tok):
    from sparsex.engine.structured_output import MAX_SPEC_CHARS, StructuredOutputError, StructuredOutputManager
    mgr = StructuredOutputManager(tok, 49152, (tok.eos_token_id,), torch.device("cpu"))
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"type":  "object",\n "properties": {"x": {"type": "integer"}}}')
    mgr.compile(a)
    mgr.compile(b)                                  # same schema, as text, other whitespace: a hit
    assert (mgr.num_compiles, mgr.num_cache_hits, mgr.num_cached) == (1, 1, 1)
    g1, g2 = mgr.grammar_for(a), mgr.grammar_for(a)
    assert g1.matcher is not g2.matcher
    with pytest.raises(StructuredOutputError, match="nonsense") as e:
        mgr.compile(StructuredOutputsParams(json={"type": "nonsense"}))
    assert e.value.code == "invalid_json_schema" and e.value.param == "structured_outputs"
    with pytest.raises(StructuredOutputError, match="too large") as e:
        mgr.compile(StructuredOutputsParams(json={"enum": ["x" * 100] * (MAX_SPEC_CHARS // 100)}))
    assert e.value.code == "grammar_too_large"
    with pytest.raises(StructuredOutputError, match="not defined"):
        mgr.compile(StructuredOutputsParams(grammar="root ::= nope"))
    assert mgr.num_cached == 1
    # the bitmask: a free row is all ones, a constrained row allows '{' tokens but not EOS
    mask = mgr.grammar_bitmask([None, g1])
    allowed = unpack_bitmask(mask, 49152)
    assert bool(allowed[0].all()) and not bool(allowed[1, tok.eos_token_id])
    assert all(tok.decode([t]).lstrip().startswith("{") for t in allowed[1].nonzero().flatten().tolist())
    assert mgr.grammar_bitmask([None, None]) is None


# ---- model: a real server ---------------------------------------------------------------------------
KEY = "test-key"
TENANT = "X-Tenant"
PROMPT = [{"role": "user", "content": "Reply in JSON about a cat."}]
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "pet": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                 "legs": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["name", "legs"]}},
        "required": ["pet"]},
    "enum": {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]}}, "required": ["mood"]},
    "array": {"type": "object", "properties": {"colors": {"type": "array", "minItems": 2, "maxItems": 3,
                                                          "items": {"enum": ["red", "blue", "green"]}}},
              "required": ["colors"]},
    "required": {"type": "object", "properties": {"cute": {"type": "boolean"}, "age": {"type": "integer",
                                                                                         "minimum": 1, "maximum": 20}},
                 "required": ["cute", "age"], "additionalProperties": False},
}


def _fmt(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM.from_config(EngineConfig(model="smollm2-135m-instruct", dtype="float32", cache="prefix", seed=0,
                                            max_model_len=512, num_blocks=128))
    srv = BackgroundServer(build_app(llm, ServerSettings(api_key=KEY, tenant_header=TENANT)))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    yield srv, llm, client
    srv.stop()
    assert llm.error is None


def _chat(client, **kw):
    kw.setdefault("max_tokens", 40)
    return client.chat.completions.create(model="smollm2-135m-instruct", messages=PROMPT,
                                          extra_headers={TENANT: uuid.uuid4().hex}, **kw)


@pytest.mark.model
def test_json_schema_outputs_validate(server):
    srv, llm, _ = server
    # sent at once: the engine decodes them as one batch (and the test takes one request's time)
    aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    async def chat(**kw):
        kw.setdefault("max_tokens", 40)
        return await aclient.chat.completions.create(model="smollm2-135m-instruct", messages=PROMPT,
                                                     extra_headers={TENANT: uuid.uuid4().hex}, **kw)

    async def streamed(**kw):
        chunks = [ch async for ch in await chat(stream=True, **kw)]
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks[-1]

    cases = [(name, kw) for name in SCHEMAS for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7})]

    async def main():
        return await asyncio.gather(
            *(chat(response_format=_fmt(SCHEMAS[name], strict=name != "enum"), **kw) for name, kw in cases),
            streamed(response_format=_fmt(SCHEMAS["array"]), temperature=1.0, seed=3),
            chat(response_format=_fmt(SCHEMAS["required"]), temperature=1.0, seed=11, n=2),   # a matcher per choice
            chat(response_format={"type": "json_object"}, temperature=0, max_tokens=30))

    *outs, (text, last), two, obj = asyncio.run(main())
    for (name, kw), out in zip(cases, outs):
        c = out.choices[0]
        assert c.finish_reason == "stop", (name, kw, c.message.content)
        jsonschema.validate(json.loads(c.message.content), SCHEMAS[name])
    # streamed: the deltas reassemble to a valid document
    assert last.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS["array"])
    assert len(two.choices) == 2
    for c in two.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["required"])
    # json_object: an object (a complete one unless max_tokens cut it)
    c = obj.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.lstrip().startswith("{")
    llm.call_sync(lambda e: e.check_integrity())


@pytest.mark.model
def test_constrained_and_free_requests_share_a_batch(server):
    srv, llm, _ = server
    aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    tenant = {TENANT: "shared-batch"}

    async def one(fmt):
        kw = {"response_format": fmt} if fmt else {}
        r = await aclient.chat.completions.create(model="smollm2-135m-instruct", messages=PROMPT, max_tokens=30,
                                                  temperature=0, extra_headers=tenant, **kw)
        return r.choices[0].message.content

    async def main():
        batch = await asyncio.gather(one(None), one(_fmt(SCHEMAS["enum"])), one(None), one(_fmt(SCHEMAS["required"])))
        return batch, await one(None)

    (free, enum_out, free2, req_out), alone = asyncio.run(main())
    assert free == free2 == alone
    jsonschema.validate(json.loads(enum_out), SCHEMAS["enum"])
    jsonschema.validate(json.loads(req_out), SCHEMAS["required"])
    assert llm.call_sync(lambda e: e.structured_output.num_compiles) >= 1
    llm.call_sync(lambda e: e.check_integrity())


@pytest.mark.model
def test_logit_bias_bans_and_forces(server, tok):
    _, _, client = server
    prompt = "The capital of France is"

    def completion(**kw):
        return client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=4, logprobs=0,
                                         extra_headers={TENANT: uuid.uuid4().hex}, **kw)

    free = completion(temperature=0)
    first_text = free.choices[0].logprobs.tokens[0]
    ids, prompt_ids = tok.encode(prompt + free.choices[0].text), tok.encode(prompt)
    assert ids[:len(prompt_ids)] == prompt_ids
    first_id = ids[len(prompt_ids)]
    assert tok.decode([first_id]) == first_text
    banned = completion(temperature=0, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first_text
    forced = completion(temperature=1.0, seed=5, logit_bias={"1234": 100})
    assert forced.choices[0].logprobs.tokens == [tok.decode([1234])] * 4
    assert forced.choices[0].text == tok.decode([1234] * 4)


BAD = [
    ({"response_format": _fmt({"type": "nonsense"})}, "response_format", "invalid_json_schema"),
    ({"response_format": _fmt({"enum": ["x" * 100] * 700})}, "response_format", "grammar_too_large"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema",
     "invalid_json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "unsupported_parameter"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias", "invalid_logit_bias"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias", "invalid_logit_bias"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs", "unsupported_parameter"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "invalid_grammar"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json",
     "unsupported_parameter"),
]


@pytest.mark.model
@pytest.mark.parametrize("body,param,code", BAD, ids=[c for _, _, c in BAD])
def test_bad_input_is_a_400_naming_it(server, body, param, code):
    srv, llm, client = server
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                   json={"model": "smollm2-135m-instruct", "messages": PROMPT, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert llm.call_sync(lambda e: e.get_num_unfinished_requests()) == 0
    llm.call_sync(lambda e: e.check_integrity())
    # the SDK sees the same, and the engine keeps serving
    if code == "invalid_json_schema" and param == "response_format":
        with pytest.raises(openai.BadRequestError, match="nonsense"):
            _chat(client, response_format=_fmt({"type": "nonsense"}), max_tokens=2)
        assert _chat(client, max_tokens=2, temperature=0).choices[0].finish_reason == "length"


# ---- model: offline ----------------------------------------------------------------------------------
@pytest.mark.model
def test_offline_generate_and_chat(llm_prefix):
    from sparsex.engine.structured_output import StructuredOutputError
    so = StructuredOutputsParams(json=SCHEMAS["enum"])
    gen = llm_prefix.generate(["Mood as JSON:"], SamplingParams(temperature=0, max_tokens=20, structured_outputs=so))
    chat = llm_prefix.chat(PROMPT, SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=20, structured_outputs=so))
    for c in gen[0].outputs + chat[0].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS["enum"])
    engine = llm_prefix.llm_engine
    with pytest.raises(StructuredOutputError, match="nonsense"):
        llm_prefix.generate(["x", "y"], SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nonsense"})))
    assert engine.get_num_unfinished_requests() == 0 and not engine.requests
    engine.check_integrity()
