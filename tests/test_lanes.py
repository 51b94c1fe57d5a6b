"""The guard on the test lanes (tests/conftest.py), run on a small suite of its own in a subprocess:
a `unit` test that loads a model, directly or through a fixture another test built first, fails
naming what it did; so does a test with no lane mark, in the `-m unit` selection too; correctly
marked tests pass."""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CONFTEST = Path(__file__).with_name("conftest.py")

SUITE = '''
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    cfg = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny(model_dir):
    return LlamaForCausalLM.from_pretrained(model_dir)


@pytest.mark.model
def test_a_model_test_builds_the_fixture(tiny):
    assert tiny.config.hidden_size == 8


@pytest.mark.unit
def test_unit_loads_in_its_body(model_dir):
    LlamaForCausalLM.from_pretrained(model_dir)


@pytest.mark.unit
def test_unit_uses_a_cached_loading_fixture(tiny):
    pass


@pytest.mark.unit
def test_unit_catching_everything_still_fails(model_dir):
    try:
        LlamaForCausalLM.from_pretrained(model_dir)
    except Exception:
        pass


@pytest.mark.unit
def test_unit_touches_cuda():
    torch.cuda._lazy_init()


def test_without_a_lane():
    pass


@pytest.mark.unit
def test_a_unit_test_without_a_model(model_dir):
    assert LlamaConfig.from_pretrained(model_dir).hidden_size == 8     # a config is no model
'''


def test_the_guard_fails_mislabelled_and_unlabelled_tests(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    unit\n    model\n    bench\n    gpu\n")
    pytester.makepyfile(test_suite=SUITE)
    # a lane expression, as `make test-fast` passes one: the test without a lane is still selected
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "unit or model")
    result.assert_outcomes(passed=2, failed=3, errors=2)        # the fixture and no-lane checks fail in set-up
    result.stdout.fnmatch_lines_random([
        "*test_unit_loads_in_its_body is marked unit but loads * with transformers' from_pretrained: mark it model",
        "*test_unit_uses_a_cached_loading_fixture is marked unit but uses the fixture 'tiny', which loads a model: "
        "mark it model",
        "*test_unit_catching_everything_still_fails is marked unit but loads *: mark it model",
        "*test_unit_touches_cuda is marked unit but initialises CUDA: mark it gpu",
        "*test_without_a_lane carries no lane mark: mark it one of unit, model, bench, gpu*",
        "engines built: 0 (LLMEngine constructions); model loads: 0 (load_model calls reading weights; "
        "0 more served by those, 0 dummy models), in this process",
    ])
