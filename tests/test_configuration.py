"""One source per knob: every EngineConfig / ReuseConfig field has a CLI flag, an HTTP request
field (reuse knobs), a line in docs/configuration.md, and the same default everywhere. No model."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from sparsex import LLM, cli
from sparsex.config import EngineConfig, ReuseConfig, engine_knob_names, knob_meta, knob_type, reuse_knob_names
from sparsex.demo import DemoConfig
from sparsex.entrypoints.protocol import ReuseOptions
from sparsex.entrypoints.serve_cli import ADVANCED_GROUP, engine_config, engine_knobs, flag_name

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
    assert [p.kind for n, p in params.items() if n not in ("self", "model")] == [inspect.Parameter.VAR_KEYWORD]
    for argv in (["serve"], ["generate", "x"]):
        cfg = engine_config(cli.build_parser().parse_args(argv))
        assert {n: getattr(cfg, n) for n in engine_knob_names()} == {n: getattr(engine, n) for n in engine_knob_names()}
        assert cfg.reuse == reuse
    demo = cli.build_parser().parse_args(["demo"])
    assert (demo.cache, demo.dtype) == (engine.cache, engine.dtype) == (DemoConfig.cache, DemoConfig.dtype)


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


def _outside(bound: float, integer: bool, below: bool) -> float:
    step = 1 if integer else 0.01
    return bound - step if below else bound + step


@pytest.mark.parametrize("cls, name", KNOBS, ids=[n for _, n in KNOBS])
def test_bounds_in_metadata_match_validation(cls, name):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta, integer = knob_meta(f), knob_type(cls, f) is int
    for key, below in (("ge", True), ("le", False)):
        if meta[key] is None:
            continue
        bad = _outside(meta[key], integer, below)
        with pytest.raises(ValueError, match=name):
            if cls is ReuseConfig:
                ReuseConfig(**{name: bad}).verify()
            else:
                EngineConfig(**{name: bad})
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", flag_name(name), str(bad)])
        if cls is ReuseConfig:
            with pytest.raises(Exception, match=name):
                ReuseOptions(**{name: bad})
        # the bound itself is accepted
        ok = meta[key]
        if cls is ReuseConfig:
            kw = {name: int(ok) if integer else ok}
            if name == "recompute_ratio" and ok == 1.0:
                kw["candidate_ratio"] = 1.0         # cross-field rule: candidates >= what is kept
            if name == "full_layers":
                kw["selector"] = "random"           # cross-field rule: probe selectors need a full layer
            ReuseConfig(**kw).verify()


def test_unknown_knob_is_a_type_error_listing_valid_ones():
    with pytest.raises(TypeError, match=re.escape("['full_layer']") + ".*'full_layers'"):
        EngineConfig.from_knobs(full_layer=3)
