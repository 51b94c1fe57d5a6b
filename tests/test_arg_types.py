"""argparse value types of every command line: each accepts its values and turns a bad one into a
usage error (argparse.ArgumentTypeError) that names it."""
from __future__ import annotations

import argparse

import pytest

from sparsex.arg_types import int_pair, length_list, non_negative_float, positive_int

pytestmark = pytest.mark.unit


def test_good_values_parse():
    assert positive_int("3") == 3
    assert non_negative_float("0") == 0.0 and non_negative_float("2.5") == 2.5
    assert length_list("512, 1024,2048") == (512, 1024, 2048)
    assert int_pair("300:500") == (300, 500)


@pytest.mark.parametrize("convert, text, named", [
    (positive_int, "0", "'0'"), (positive_int, "x", "'x'"), (positive_int, "1.5", "'1.5'"),
    (non_negative_float, "-1", "'-1'"), (non_negative_float, "nan", "'nan'"), (non_negative_float, "x", "'x'"),
    (length_list, "512,0", "'0'"), (length_list, "512,x", "'x'"), (length_list, ",", "token counts"),
    (int_pair, "300", "'300'"), (int_pair, "300:x", "'300:x'"), (int_pair, "1:2:3", "'1:2:3'"),
])
def test_bad_values_are_usage_errors_naming_them(convert, text, named):
    with pytest.raises(argparse.ArgumentTypeError, match=named):
        convert(text)
