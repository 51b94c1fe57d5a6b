"""`sparsex calibrate` and calibrated reuse-profile files (sparsex/calibration.py, sparsex/reuse_profiles.py):
the sweep on a tiny random-weight model and real Wikipedia text writes a well-formed file whose choices
follow the rule; `LLM(model)` finds that file by itself and its profiles replace the built-in ones for
that engine, explicit knobs winning; a malformed file or one for another model is refused; the server
reports where its profiles came from."""
from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest
import torch

from sparsex.calibration import (ABSOLUTE_BOUNDS, CalibrationConfig, KLBounds, Knobs, PointResult, choose,
                                 full_layers_of, load_dataset)
from sparsex.config import REUSE_PROFILES, ReuseConfig
from sparsex.reuse_profiles import (BUILTIN, PROFILE_DIR_ENV, ModelIdentity, ReuseProfiles, default_profile_path,
                                    find_reuse_profiles, read_profile_file, write_profile_file)

NUM_LAYERS = 6
POOL = 96            # KV blocks of the test's LLMs: the longest prompt twice over


def _tiny_model_dir(path, tokenizer, seed: int) -> str:
    """A Llama-shaped model of NUM_LAYERS layers with random weights (N(0, 0.1): attention far from
    uniform), SmolLM2's tokenizer, written as a Hugging Face directory."""
    from sparsex.models import hf_dir
    from sparsex.models.model_config import ModelConfig
    from sparsex.models.shapes import is_norm_weight, param_shapes
    hf = {"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
          "tie_word_embeddings": True, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.ones(shape) if is_norm_weight(name) else torch.randn(shape, generator=gen) * 0.1
               for name, shape in param_shapes(ModelConfig.from_hf_config(hf)).items()}
    os.makedirs(path, exist_ok=True)
    hf_dir.write_hf_dir(str(path), hf, tensors, tokenizer, {"name": f"tiny-{seed}"})
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tok):
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", tok, seed=0)


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory, tok):
    return _tiny_model_dir(tmp_path_factory.mktemp("other") / "model", tok, seed=1)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, wiki_texts):
    """Two requests of three real passages each (about 200 tokens apiece), in other orders."""
    path = tmp_path_factory.mktemp("set") / "set.jsonl"
    rows = [{"passages": wiki_texts[0:3], "question": "What is the first passage about?"},
            {"passages": [wiki_texts[2], wiki_texts[0], wiki_texts[1]], "question": "Which places are named?"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def calibration(tiny, dataset):
    from sparsex.calibration import run_calibration
    # (num_passages: the wiki passages the ingestion's preamble is drawn past; few are needed)
    cfg = CalibrationConfig(model=tiny, dataset=dataset, requests=2, num_passages=8, ingest_passes=2, fidelity_tokens=4,
                            full_layers=("1", "L/3"), ratios=(0.25, 0.5), selectors=("sparse_q", "kv_deviation"),
                            rescore=("auto", "off"), progress=False)
    return run_calibration(cfg)


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    return tmp_path / "profiles"


def _distinct_doc(doc: dict) -> dict:
    """The calibration's file with each profile's knobs set apart from every built-in profile's (and from
    each other's), so that a test sees which table an engine used."""
    doc = copy.deepcopy(doc)
    doc["profiles"]["fast"]["knobs"] = {"full_layers": 1, "recompute_ratio": 0.3, "selector": "kv_deviation",
                                        "rescore_layers": 0}
    doc["profiles"]["default"]["knobs"] = {"full_layers": 3, "recompute_ratio": 0.2, "selector": "sparse_q",
                                           "rescore_layers": None}
    doc["profiles"]["quality"]["knobs"] = {"full_layers": 2, "recompute_ratio": 0.7, "selector": "sparse_q",
                                           "rescore_layers": 0}
    for knobs in (p["knobs"] for p in doc["profiles"].values()):
        assert all(knobs["full_layers"] != b["full_layers"] or knobs["recompute_ratio"] != b["recompute_ratio"]
                   for b in REUSE_PROFILES.values())
    return doc


# ---- the sweep ----------------------------------------------------------------------------------------

@pytest.mark.model
def test_the_sweep_writes_a_profile_whose_choices_follow_the_rule(calibration, tiny, tmp_path):
    path = calibration.write(str(tmp_path / "p.json"))
    doc = read_profile_file(path)                   # the reader's checks pass on what the writer wrote
    assert doc["model"] == ModelIdentity.of(tiny).as_json()
    assert doc["num_layers"] == NUM_LAYERS and doc["calibration_set"]["requests"] == 2
    points = doc["points"]
    # the grid: full_layers 1 and L/3 = 2, both ratios, sparse_q with both rescorings (kv_deviation only as
    # a chosen point's variant, staged search), and the built-in profiles fitted to 6 layers (F capped at 3)
    grid = {(p["knobs"]["full_layers"], p["knobs"]["recompute_ratio"]) for p in points if p["stage"] == "grid"}
    assert grid == {(1, 0.25), (1, 0.5), (2, 0.25), (2, 0.5)}
    fitted = {n: ReuseConfig().with_overrides({"reuse_profile": n}).for_model(NUM_LAYERS) for n in REUSE_PROFILES}
    for name, cfg in fitted.items():
        [p] = [p for p in points if name in p["builtin"]]
        assert (p["knobs"]["full_layers"], p["knobs"]["recompute_ratio"]) == (cfg.full_layers, cfg.recompute_ratio)
    assert all(p["knobs"]["selector"] == "sparse_q" for p in points if p["stage"] != "variant")
    assert any(p["knobs"]["selector"] == "kv_deviation" for p in points)
    for p in points:
        assert 0 < p["compute_share"] < 1 and p["kl"] >= 0 and 0 <= p["top1"] <= 1
        assert len(p["kl_per_request"]) == 2
    assert len({json.dumps(p["knobs"], sort_keys=True) for p in points}) == len(points)
    # the rule, checked against every point of the file: relative bounds, anchored on the built-in default
    rule = doc["rule"]
    [anchor] = [p for p in points if "default" in p["builtin"]]
    assert rule["bounds"] == "relative" and rule["anchor_kl"] == anchor["kl"]
    bounds = rule["kl_bounds"]
    assert bounds == {n: pytest.approx(f * anchor["kl"]) for n, f in rule["factors"].items()}
    for name, chosen in doc["profiles"].items():
        assert chosen["knobs"] == points[chosen["point"]]["knobs"]
        within = [p for p in points if p["kl"] <= bounds[name]]
        assert chosen["meets_bound"] == bool(within)
        if within:
            assert chosen["kl"] <= bounds[name]
            assert chosen["compute_share"] == min(p["compute_share"] for p in within)
        else:
            assert chosen["kl"] == min(p["kl"] for p in points)
    shares = [doc["profiles"][n]["compute_share"] for n in ("fast", "default", "quality")]
    assert shares == sorted(shares)


@pytest.mark.model
def test_every_point_meets_the_same_index(calibration):
    """A point measured again after the whole sweep gives the same numbers: no run left KV a later one reused."""
    from sparsex.calibration import run_calibration
    cfg = calibration.cfg
    again = run_calibration(CalibrationConfig(
        model=cfg.model, dataset=cfg.dataset, requests=2, num_passages=8, ingest_passes=2, fidelity_tokens=4,
        full_layers=("L/3",), ratios=(0.25,), selectors=("sparse_q",), rescore=("auto",), progress=False))
    [first] = [p for p in calibration.points if p.knobs == Knobs(2, 0.25, "sparse_q", None)]
    [second] = [p for p in again.points if p.knobs == first.knobs]
    assert second.kl_per_request == pytest.approx(first.kl_per_request, rel=1e-4, abs=1e-7)
    assert second.compute_share == pytest.approx(first.compute_share)


# ---- loading --------------------------------------------------------------------------------------------

@pytest.mark.model
def test_llm_loads_the_models_profile_and_explicit_knobs_win(calibration, tiny, profile_dir, dataset):
    from sparsex import LLM, SamplingParams
    doc = _distinct_doc(calibration.profile_doc())
    path = write_profile_file(default_profile_path(ModelIdentity.of(tiny)), doc)
    prof = {n: doc["profiles"][n]["knobs"] for n in REUSE_PROFILES}

    llm = LLM(tiny, dtype="float32", num_blocks=POOL)                 # found by itself
    engine = llm.llm_engine
    assert llm.reuse_profiles.source == path and engine.reuse_profiles.table == prof
    r = engine.config.reuse
    assert (r.reuse_profile, r.full_layers, r.recompute_ratio, r.selector, r.rescore_layers) == \
        ("default", *prof["default"].values())
    # a request naming a profile gets the file's knobs, and runs with them
    passages, question = load_dataset(dataset)[0]
    llm.ingest(passages)
    engine.add_request("q", {"segments": [*passages[::-1], question]}, SamplingParams(temperature=0, max_tokens=2),
                       reuse={"reuse_profile": "quality"})
    q = engine.requests["q"].reuse
    assert (q.full_layers, q.recompute_ratio, q.selector, q.rescore_layers) == tuple(prof["quality"].values())
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].num_reused_tokens > 0
    # explicit knobs win over the file's profile, engine-wide and per request
    assert engine._reuse_for({"reuse_profile": "fast", "full_layers": 2}).full_layers == 2
    assert engine._reuse_for({"reuse_profile": "fast"}).selector == "kv_deviation"
    del llm, engine
    llm = LLM(tiny, dtype="float32", num_blocks=POOL, reuse_profile="quality", selector="kv_deviation")
    r = llm.config.reuse
    assert (r.full_layers, r.recompute_ratio, r.selector) == (2, 0.7, "kv_deviation")
    del llm
    # "none": the built-in profiles, whatever the profile dir holds
    llm = LLM(tiny, dtype="float32", num_blocks=POOL, reuse_profile_file="none")
    r = llm.config.reuse
    assert llm.reuse_profiles.source == BUILTIN
    builtin = ReuseConfig().for_model(NUM_LAYERS)                     # the built-in default, fitted to 6 layers
    assert (r.full_layers, r.recompute_ratio, r.selector) == (builtin.full_layers, builtin.recompute_ratio, "sparse_q")


@pytest.mark.model
def test_the_server_reports_where_its_profiles_came_from(calibration, tiny, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.entrypoints.async_engine import AsyncLLM
    from sparsex.reuse_profiles import engine_config
    path = write_profile_file(str(tmp_path / "p.json"), _distinct_doc(calibration.profile_doc()))
    profiles = find_reuse_profiles(tiny, path)
    llm = AsyncLLM(LLMEngine(engine_config(profiles, model=tiny, dtype="float32", num_blocks=POOL), profiles))
    try:
        text = llm.metrics.render().decode()
    finally:
        asyncio.run(llm.shutdown())
    [info] = [s for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "sparsex:reuse_config_info"]
    assert info.labels["profile_source"] == path
    assert (info.labels["full_layers"], info.labels["recompute_ratio"], info.labels["rescore_layers"]) == ("3", "0.2", "auto")


# ---- refusals (no model loads) -----------------------------------------------------------------------

@pytest.mark.unit
def test_a_file_for_another_model_or_a_malformed_one_is_refused(tiny, other_tiny, tmp_path, profile_dir):
    from sparsex import LLM
    ident = ModelIdentity.of(tiny)
    assert ModelIdentity.of(other_tiny).fingerprint != ident.fingerprint
    knobs = {n: {"knobs": dict(v)} for n, v in REUSE_PROFILES.items()}
    good = {"format": "sparsex-reuse-profile", "version": 1, "model": ident.as_json(), "profiles": knobs}
    path = write_profile_file(str(tmp_path / "good.json"), good)
    assert find_reuse_profiles(tiny, path).source == path
    with pytest.raises(ValueError, match="calibrated on another model"):
        find_reuse_profiles(other_tiny, path)
    with pytest.raises(ValueError, match="calibrated on another model"):
        LLM(other_tiny, reuse_profile_file=path)                       # before any model loads
    bad = {
        "is not JSON": "{",
        "not a sparsex-reuse-profile file": json.dumps({"format": "something"}),
        "version 7": json.dumps({**good, "version": 7}),
        "`profiles` must hold": json.dumps({**good, "profiles": {"fast": knobs["fast"]}}),
        "recompute_ratio must be": json.dumps({**good, "profiles": {**knobs, "quality": {"knobs": {
            "full_layers": 2, "recompute_ratio": 1.5}}}}),
        "may set": json.dumps({**good, "profiles": {**knobs, "fast": {"knobs": {
            "full_layers": 2, "recompute_ratio": 0.1, "blend": False}}}}),
        "cannot read it": None,
    }
    for why, text in bad.items():
        p = tmp_path / "bad.json"
        if text is None:
            p.unlink(missing_ok=True)
        else:
            p.write_text(text)
        with pytest.raises(ValueError, match=why):
            find_reuse_profiles(tiny, str(p))
    # found by itself: a malformed file in the profile dir is an error too, naming it
    auto = default_profile_path(ident)
    os.makedirs(os.path.dirname(auto))
    with open(auto, "w") as f:
        f.write("[]")
    with pytest.raises(ValueError, match=os.path.basename(auto)):
        find_reuse_profiles(tiny)
    assert find_reuse_profiles(tiny, "none") == ReuseProfiles.builtin()
    assert find_reuse_profiles(other_tiny).source == BUILTIN            # no file for it


@pytest.mark.unit
def test_bad_calibrate_arguments_exit_2(exit_status, tmp_path):
    from sparsex.cli import main
    for argv, why in ((["--ratios", "0.5,x"], "ratios"), (["--ratios", "0"], "ratios must be"),
                      (["--selectors", "best"], "selectors must be"), (["--rescore", "twice"], "rescore"),
                      (["--full-layers", "L/0"], "full_layers value"), (["--full-layers", "0"], "full_layers value"),
                      (["--fast-bound", "0.5"], "must nest"), (["--default-bound", "-1"], "factor must be a number > 0"),
                      (["--bounds", "absolute", "--quality-bound", "0"], "KL bound must be a number > 0"),
                      (["--bounds", "absolute", "--fast-bound", "0.001"], "must nest"),
                      (["--dataset", str(tmp_path / "missing.jsonl")], "is not a file"),
                      (["--requests", "0"], "requests"), (["--search", "random"], "search"),
                      (["dummy:nope"], "unknown dummy shape")):
        code, err = exit_status(main, ["calibrate", *argv])
        assert code == 2 and why in err, (argv, err)
        assert "Traceback" not in err


@pytest.mark.unit
def test_dataset_lines_are_checked(tmp_path):
    p = tmp_path / "d.jsonl"
    for text, why in (('{"passages": ["a", "b"]}\n', "question"), ('{"passages": ["a"], "question": "q"}\n', "passages"),
                      ("nope\n", "line 1 is not JSON"), ("\n", "holds no request")):
        p.write_text(text)
        with pytest.raises(ValueError, match=why):
            load_dataset(str(p))
    p.write_text('{"passages": ["a", "b"], "question": "q"}\n\n{"passages": ["c", "d"], "question": "r"}\n')
    assert load_dataset(str(p)) == [(["a", "b"], "q"), (["c", "d"], "r")]


@pytest.mark.unit
def test_full_layers_values_follow_the_models_depth():
    assert [full_layers_of(s, 30) for s in ("2", "4", "L/4", "L/2", "L/1", "40")] == [2, 4, 7, 15, 15, 15]
    assert [full_layers_of(s, 6) for s in ("1", "L/3", "L/2", "4")] == [1, 2, 3, 3]
    assert full_layers_of("2", 3) == 2                     # half of 3 is 1, but a profile keeps 2 full layers


@pytest.mark.unit
def test_the_rule_takes_the_least_compute_within_each_bound():
    def pt(kl: float, share: float) -> PointResult:
        return PointResult(Knobs(2, share), kl, 1.0, share, 1, [kl], "grid")
    points = [pt(0.02, 0.1), pt(0.008, 0.2), pt(0.004, 0.3), pt(0.004, 0.25), pt(0.003, 0.5)]
    got = choose(points, KLBounds(fast=0.01, default=0.005, quality=0.0025, relative=False))
    assert (got["fast"].point, got["default"].point) == (1, 3)
    assert (got["quality"].point, got["quality"].meets_bound) == (4, False)    # none within: the lowest KL
    # brute force: the least compute among the points within each bound
    for bounds in (KLBounds(0.05, 0.01, 0.004, relative=False), KLBounds(0.004, 0.004, 0.004, relative=False)):
        for name, c in choose(points, bounds).items():
            within = [p.compute_share for p in points if p.kl <= getattr(bounds, name)]
            assert c.meets_bound and points[c.point].compute_share == min(within)
    with pytest.raises(ValueError, match="absolute bounds"):
        choose(points, KLBounds())


@pytest.mark.unit
def test_relative_bounds_scale_with_the_anchor():
    """Relative bounds are factors of the built-in default's KL: on a model whose whole curve sits lower,
    the same factors pick distinct, closer points, where absolute bounds fitted to another model would put
    every profile on the cheapest point (the saved curve of Qwen2.5-Coder's calibration, rounded)."""
    def pt(kl: float, share: float) -> PointResult:
        return PointResult(Knobs(2, share), kl, 1.0, share, 1, [kl], "grid")
    points = [pt(0.0057, 0.114), pt(0.0049, 0.149), pt(0.0047, 0.202), pt(0.0033, 0.273), pt(0.0031, 0.308),
              pt(0.0011, 0.519), pt(0.0005, 0.559)]
    anchor = 0.0033                                               # the built-in default point's KL
    rel = KLBounds().resolve(anchor)
    assert not rel.relative and rel.default == pytest.approx(anchor) and rel.quality == pytest.approx(0.56 * anchor)
    got = {n: points[c.point].compute_share for n, c in choose(points, rel).items()}
    assert got == {"fast": 0.149, "default": 0.273, "quality": 0.519}
    absolute = {n: points[c.point].compute_share for n, c in choose(points, ABSOLUTE_BOUNDS).items()}
    assert set(absolute.values()) == {0.114}
    assert ABSOLUTE_BOUNDS.resolve(anchor) is ABSOLUTE_BOUNDS
    with pytest.raises(ValueError, match="anchor KL"):
        KLBounds().resolve(float("nan"))
