"""One source per knob: every EngineConfig / ReuseConfig field has a CLI flag, an HTTP request
field (reuse knobs), a line in docs/configuration.md, the same default everywhere, and the checks
its declared bounds and choices imply. No model."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

import sparsex.entrypoints.llm as llm_module
from sparsex import LLM, cli
from sparsex.config import (PROFILE_KNOBS, REUSE_PROFILES, EngineConfig, ReuseConfig, engine_knob_names, knob_field, knob_meta, knob_rule, knob_type,
                            reuse_knob_names)
from sparsex.demo import DemoConfig
from sparsex.entrypoints.ingest import IngestParams
from sparsex.entrypoints.protocol import IngestRequest, ReuseOptions
from sparsex.entrypoints.serve_cli import ADVANCED_GROUP, engine_config, engine_knobs
from sparsex.knob_args import flag_name

pytestmark = pytest.mark.unit

pytestmark = pytest.mark.unit

DOC = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
KNOBS = [(EngineConfig, n) for n in engine_knob_names()] + [(ReuseConfig, n) for n in reuse_knob_names()]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings if o.startswith("--")}


def test_knob_names_are_disjoint_and_documented():
    assert not set(engine_knob_names()) & set(reuse_knob_names())
    for _, name in KNOBS:
        assert f"\n| `{name}` |" in DOC, f"docs/configuration.md has no table row for {name}"


@pytest.mark.parametrize("cls, name", KNOBS, ids=[n for _, n in KNOBS])
def test_every_knob_has_help_and_a_flag(cls, name):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    assert knob_meta(f)["help"], f"{name} has no help text (config.knob)"
    serve = _options(_subparser("serve"))
    generate = _options(_subparser("generate"))
    if name != "model":         # serve takes it positionally, generate as --model
        assert flag_name(name) in serve and flag_name(name) in generate
        assert flag_name(name) in DOC
    if knob_type(cls, f) is bool:
        assert "--no-" + name.replace("_", "-") in serve


def test_every_serve_flag_is_documented():
    for option in sorted(_options(_subparser("serve")) - {"--help"}):
        assert option in DOC, f"docs/configuration.md does not mention {option}"


def test_every_reuse_knob_is_a_request_field():
    assert list(ReuseOptions.model_fields) == reuse_knob_names()
    for f in dataclasses.fields(ReuseConfig):
        field = ReuseOptions.model_fields[f.name]
        assert field.default is None and field.description == knob_meta(f)["help"]


def test_defaults_agree():
    engine, reuse = EngineConfig(), ReuseConfig()
    assert (engine.cache, engine.dtype) == ("sparsex", "auto")
    # LLM has no defaults of its own but the model's, which is EngineConfig's
    params = inspect.signature(LLM.__init__).parameters
    assert params["model"].default == engine.model
    # ... and where its profile table comes from (no knob: sparsex/reuse_profiles.py)
    assert [(n, p.kind, p.default) for n, p in params.items() if n not in ("self", "model")] == [
        ("reuse_profile_file", inspect.Parameter.KEYWORD_ONLY, None),
        ("knobs", inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty)]
    for argv in (["serve"], ["generate", "x"]):
        cfg = engine_config(cli.build_parser().parse_args(argv))
        assert {n: getattr(cfg, n) for n in engine_knob_names()} == {n: getattr(engine, n) for n in engine_knob_names()}
        assert cfg.reuse == reuse
    demo = cli.build_parser().parse_args(["demo"])
    assert (demo.model, demo.cache, demo.dtype, demo.seed) == (engine.model, engine.cache, engine.dtype, engine.seed) \
        == (DemoConfig.model, DemoConfig.cache, DemoConfig.dtype, DemoConfig.seed)
    for bench in ("throughput", "prefill"):
        args = cli.build_parser().parse_args(["bench", bench])
        assert (args.model, args.dtype) == (engine.model, engine.dtype)


@pytest.mark.parametrize("argv", [["demo", "--dtype", "fp8"], ["demo", "--cache", "lru"], ["demo", "--seed", "x"],
                                  ["bench", "throughput", "--dtype", "fp8"], ["bench", "prefill", "--dtype", "fp8"]])
def test_demo_and_bench_flags_are_the_engine_declarations(argv):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(argv)


def test_flags_reach_the_config():
    args = cli.build_parser().parse_args(["generate", "x", "--recompute-ratio", "0.3", "--no-approx-prefix",
                                          "--kv-cache-memory", "512M", "--cache", "prefix", "--rescore-layers", "0"])
    knobs = engine_knobs(args)
    cfg = EngineConfig.from_knobs(**knobs)
    assert cfg.reuse.recompute_ratio == 0.3 and cfg.reuse.approx_prefix is False and cfg.reuse.rescore_layers == 0
    assert cfg.kv_cache_memory == 512 << 20 and cfg.cache == "prefix"


def test_advanced_knobs_are_grouped():
    serve = _subparser("serve")
    group = next(g for g in serve._action_groups if g.title == ADVANCED_GROUP)
    in_group = {a.dest for a in group._group_actions}
    for cls, name in KNOBS:
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        assert (name in in_group) == knob_meta(f)["advanced"], name
    assert {"boundary_share", "min_blend_tokens", "merge_encodings", "blend"} <= in_group
    assert not {"recompute_ratio", "full_layers", "selector", "cache", "dtype"} & in_group
    # the docs' table row of an advanced knob is under the "Advanced" heading, an everyday one's above it
    advanced_at = DOC.index("\n## Advanced")
    for cls, name in KNOBS:
        row = DOC.index(f"\n| `{name}` |")
        if name in in_group:
            assert row > advanced_at, f"{name} is advanced: give it a row under '## Advanced'"
        else:
            assert row < advanced_at, f"{name} is an everyday knob: give it a row above '## Advanced'"


# every knob with declared bounds or choices, wherever it is declared
BOUNDED = [(cls, f.name) for cls in (EngineConfig, ReuseConfig, IngestParams) for f in dataclasses.fields(cls)
           if any(knob_meta(f)[k] is not None for k in ("choices", "ge", "le"))]
# rules between knobs that a value at a bound meets on its own: probe selectors need a full layer
COMPANIONS = {"full_layers": {"selector": "random"}}


def _build(cls: type, **knobs) -> None:
    """Construct and validate (ReuseConfig validates in verify(), the others when built)."""
    if cls is ReuseConfig:
        ReuseConfig(**knobs).verify()
    else:
        cls(**knobs)


def _outside(cls: type, name: str) -> list:
    """A value just past each declared bound, or one that is none of the choices."""
    f = knob_field(cls, name)
    meta = knob_meta(f)
    if meta["choices"] is not None:
        first = meta["choices"][0]
        return [max(meta["choices"]) + 1 if isinstance(first, int) else first + "_"]
    step = 1 if knob_type(cls, f) is int else 0.01
    return ([meta["ge"] - step] if meta["ge"] is not None else []) + ([meta["le"] + step] if meta["le"] is not None else [])


def _at_bounds(cls: type, name: str) -> list:
    meta = knob_meta(knob_field(cls, name))
    return list(meta["choices"]) if meta["choices"] is not None else [b for b in (meta["ge"], meta["le"]) if b is not None]


def test_bounded_knobs_are_found():
    names = {n for _, n in BOUNDED}
    assert {"cache", "block_size", "segment_eviction", "segment_store_fetch", "recompute_ratio", "selector",
            "rescore_layers", "passes", "group_size"} <= names
    assert not {"model", "device", "seed", "approx_prefix"} & names


@pytest.mark.parametrize("cls, name", BOUNDED, ids=[n for _, n in BOUNDED])
def test_a_value_outside_a_declared_bound_or_choice_is_refused_naming_it(cls, name):
    meta = knob_meta(knob_field(cls, name))
    allowed = [repr(c) for c in meta["choices"]] if meta["choices"] is not None else \
        [str(b) for b in (meta["ge"], meta["le"]) if b is not None]
    for bad in _outside(cls, name):
        with pytest.raises(ValueError) as e:
            _build(cls, **{name: bad})
        message = str(e.value)
        assert message.startswith(f"{name} must be ") and message.endswith(f"got {bad!r}"), message
        assert knob_rule(cls, knob_field(cls, name)) in message
        assert all(a in message for a in allowed), message
        if cls is IngestParams:
            with pytest.raises(Exception, match=name):
                IngestRequest(segments=["a"], **{name: bad})
            continue
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", flag_name(name), str(bad)])
        if cls is ReuseConfig and meta["choices"] is None:       # the request body declares bounds only
            with pytest.raises(Exception, match=name):
                ReuseOptions(**{name: bad})


@pytest.mark.parametrize("cls, name", BOUNDED, ids=[n for _, n in BOUNDED])
def test_a_value_at_a_declared_bound_or_choice_is_accepted(cls, name):
    integer = knob_type(cls, knob_field(cls, name)) is int
    for ok in _at_bounds(cls, name):
        ok = int(ok) if integer else ok
        _build(cls, **{name: ok}, **COMPANIONS.get(name, {}))
        if cls is IngestParams:
            assert getattr(IngestRequest(segments=["a"], **{name: ok}), name) == ok
            continue
        assert getattr(cli.build_parser().parse_args(["serve", flag_name(name), str(ok)]), name) == ok


def test_a_value_of_the_wrong_type_is_refused():
    with pytest.raises(ValueError, match=r"block_size must be one of .*, got 16\.0"):
        EngineConfig(block_size=16.0)
    with pytest.raises(ValueError, match="approx_prefix must be a bool, got 1"):
        ReuseConfig(approx_prefix=1).verify()
    with pytest.raises(ValueError, match=r"recompute_ratio must be a number in \[0\.0, 1\.0\] or 'auto', got nan"):
        ReuseConfig(recompute_ratio=float("nan")).verify()
    with pytest.raises(ValueError, match="dtype must be one of .* or a torch.dtype, got 'bf17'"):
        EngineConfig(dtype="bf17")
    assert EngineConfig(dtype=torch.float16).torch_dtype == torch.float16
    assert ReuseConfig(rescore_layers=None, recompute_ratio=1).verify() is None      # an int is a number


def test_enforce_eager_is_a_knob_of_the_cli_and_of_llm(monkeypatch):
    f = knob_field(EngineConfig, "enforce_eager")
    assert f.default is False and knob_type(EngineConfig, f) is bool and "CUDA graphs" in knob_meta(f)["help"]
    for argv in (["serve"], ["generate", "x"]):
        assert engine_config(cli.build_parser().parse_args(argv)).enforce_eager is False
        assert engine_config(cli.build_parser().parse_args([*argv, "--enforce-eager"])).enforce_eager is True
    # LLM(...) takes it as a keyword and hands it to the engine in its config (a stub engine: no model)
    monkeypatch.setattr(llm_module, "LLMEngine", lambda config, reuse_profiles=None: config)
    assert LLM(enforce_eager=True).llm_engine.enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager must be a bool, got 'yes'"):
        LLM(enforce_eager="yes")


def test_ingest_defaults_are_declared_once():
    params = inspect.signature(LLM.ingest).parameters
    for f in dataclasses.fields(IngestParams):
        assert params[f.name].default == f.default == IngestRequest.model_fields[f.name].default


def test_unknown_knob_is_a_type_error_listing_valid_ones():
    with pytest.raises(TypeError, match=re.escape("['full_layer']") + ".*'full_layers'"):
        EngineConfig.from_knobs(full_layer=3)


def test_the_declared_reuse_defaults_are_the_default_profile():
    reuse = ReuseConfig()
    assert reuse.reuse_profile == "default"
    assert all(set(knobs) == set(PROFILE_KNOBS) for knobs in REUSE_PROFILES.values())
    assert {k: getattr(reuse, k) for k in PROFILE_KNOBS} == REUSE_PROFILES["default"]


@pytest.mark.parametrize("profile", sorted(REUSE_PROFILES))
def test_a_profile_sets_its_knobs_and_explicit_knobs_win(profile):
    knobs = REUSE_PROFILES[profile]
    for make in (lambda **k: EngineConfig.from_knobs(**k).reuse,
                 lambda **k: engine_config(cli.build_parser().parse_args(
                     ["serve", *(a for n, v in k.items() for a in (flag_name(n), str(v)))])).reuse,
                 lambda **k: ReuseConfig().with_overrides(k)):
        got = make(reuse_profile=profile)
        assert (got.reuse_profile, got.full_layers, got.recompute_ratio) == \
            (profile, knobs["full_layers"], knobs["recompute_ratio"])
        got = make(reuse_profile=profile, full_layers=3, selector="kv_deviation")
        assert (got.full_layers, got.recompute_ratio, got.selector) == (3, knobs["recompute_ratio"], "kv_deviation")
    # a request's profile starts from the engine's other knobs (here min_blend_tokens=0)
    engine = EngineConfig.from_knobs(min_blend_tokens=0, recompute_ratio=0.3).reuse
    got = engine.with_overrides({"reuse_profile": profile})
    assert (got.min_blend_tokens, got.recompute_ratio) == (0, knobs["recompute_ratio"])


def test_an_unknown_profile_is_refused_naming_it():
    for make in (lambda: EngineConfig.from_knobs(reuse_profile="best"),
                 lambda: ReuseConfig().with_overrides({"reuse_profile": "best"})):
        with pytest.raises(ValueError, match="reuse_profile must be one of .*'quality'.* got 'best'"):
            make()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--reuse-profile", "best"])
    with pytest.raises(ValueError, match=r"unknown segment-reuse option\(s\) \['profile'\]"):
        ReuseConfig().with_overrides({"profile": "quality"})


def test_a_profile_is_fitted_to_a_shallow_model_and_an_explicit_depth_is_not():
    assert ReuseConfig().for_model(30).full_layers == 4
    assert [ReuseConfig().for_model(n).full_layers for n in (1, 2, 3, 4, 6, 8)] == [1, 2, 2, 2, 3, 4]
    explicit = EngineConfig.from_knobs(full_layers=3).reuse
    assert explicit.for_model(4).full_layers == 3
    with pytest.raises(ValueError, match="full_layers=3 exceeds the model's 2 layers"):
        explicit.for_model(2).verify(2)


def test_the_profile_is_no_part_of_the_kv_key():
    """Two configs with the same knobs blend the same KV, whichever profile named them."""
    named = ReuseConfig().with_overrides({"reuse_profile": "quality"})
    spelled = ReuseConfig(full_layers=2, recompute_ratio=0.5)
    assert named.kv_key == spelled.kv_key and named != spelled


def test_recompute_ratio_auto_is_accepted_everywhere_and_other_words_are_refused():
    """"auto" from LLM / EngineConfig, the CLI and a per-request HTTP override; any other string is
    refused naming what is allowed."""
    from sparsex.entrypoints.protocol import ReuseOptions
    assert EngineConfig.from_knobs(recompute_ratio="auto").reuse.recompute_ratio == "auto"
    args = cli.build_parser().parse_args(["generate", "x", "--recompute-ratio", "auto"])
    assert EngineConfig.from_knobs(**engine_knobs(args)).reuse.recompute_ratio == "auto"
    assert ReuseOptions(recompute_ratio="auto").overrides() == {"recompute_ratio": "auto"}
    with pytest.raises(ValueError, match=r"recompute_ratio must be a number in \[0\.0, 1\.0\] or 'auto', got 'fast'"):
        ReuseConfig(recompute_ratio="fast").verify()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "--recompute-ratio", "most"])
    for bad in ("most", 1.5):
        with pytest.raises(ValueError):
            ReuseOptions(recompute_ratio=bad)


def test_auto_two_stage_keeps_more_candidates_than_its_largest_ratio():
    from sparsex.config import AUTO_RATIO_MAX
    auto = ReuseConfig(recompute_ratio="auto")
    assert auto.max_recompute_ratio == AUTO_RATIO_MAX < auto.candidate_ratio
    assert auto.resolved(30).rescore_layers == 2                      # sparse_q's two stages, as for a number
    with pytest.raises(ValueError, match="candidate_ratio 0.2 is below recompute_ratio 'auto'"):
        ReuseConfig(recompute_ratio="auto", rescore_layers=2, candidate_ratio=0.2).verify()
    assert dict(auto.kv_key)["recompute_ratio"] == "auto"             # its own approximate chain
