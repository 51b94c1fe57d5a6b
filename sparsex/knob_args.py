"""Command-line flags derived from a knob's declaration (`config.knob`): the flag name, its type,
choices, bounds (checked as the value is parsed: a usage error naming it), default and help. `sparsex
serve`, `generate`, `demo` and every `sparsex bench` command declare their engine flags through
`add_knob_arg`."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from sparsex.config import PROFILE_KNOBS, REUSE_PROFILES, ReuseConfig, check_knob, knob_field, knob_meta, knob_type


def _checked(cls: type, f: dataclasses.Field, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: `parse`, then the knob's declared choices and bounds (`check_knob`), as a
    usage error naming the value."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
            check_knob(cls, f, value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    convert.__name__ = parse.__name__        # argparse names the type in "invalid <name> value"
    return convert


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def knob_help(f: dataclasses.Field, cls: type | None = None) -> str:
    """A knob's --help line: its help text and its default."""
    shown = "unset" if f.default is None else f.default
    if cls is ReuseConfig and f.name in PROFILE_KNOBS:
        shown = "the profile's: " + ", ".join(f"{p} {v[f.name]}" for p, v in REUSE_PROFILES.items())
    return f"{knob_meta(f)['help']} (default: {shown})".lstrip()


def add_knob_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, name: str,
                 help: str | None = None) -> None:
    """The flag of one EngineConfig / ReuseConfig field (`--full-layers` for full_layers), with its
    type, choices, bounds, default and help from the field (`help` replaces the help text). Bool
    knobs take --X / --no-X. A segment-reuse flag has no default of its own: one not given is left
    out of the parsed arguments, so the config keeps its value (the reuse profile's, or the
    declared default), as `LLM(...)` does for a keyword not passed."""
    f = knob_field(cls, name)
    meta = knob_meta(f)
    text = knob_help(f, cls) if help is None else help
    default = argparse.SUPPRESS if cls is ReuseConfig else f.default
    if knob_type(cls, f) is bool:
        p.add_argument(flag_name(name), dest=name, action=argparse.BooleanOptionalAction, default=default,
                       help=text)
        return
    p.add_argument(flag_name(name), dest=name, default=default, choices=meta["choices"],
                   type=_checked(cls, f, meta["parse"] or knob_type(cls, f)), help=text)
