"""An engine's reuse-profile table: the built-in one (config.REUSE_PROFILES) or a calibrated profile
file that `sparsex calibrate MODEL` wrote for that model (sparsex/calibration.py).

Where `LLM(model)` and `sparsex serve` take their table from (`find_reuse_profiles`):

    reuse_profile_file="none"    the built-in table
    reuse_profile_file=PATH      that file (a ValueError if it is malformed or names another model)
    unset                        <profile dir>/<model key>.json when it exists, else the built-in table
                                 (profile dir: $SPARSEX_PROFILE_DIR, else ~/.cache/sparsex/profiles;
                                 model key: the model's name and the first 16 hex of its fingerprint)

A calibrated table replaces the built-in values of each profile (`reuse_profile="quality"` means the
calibrated quality) for that engine only: it travels with the engine (`LLMEngine(config,
reuse_profiles)`), never through the module global. Precedence of a knob: explicit (a keyword of
`LLM`, a flag of `sparsex serve`, a request's `reuse`) > the profile's in the table > ReuseConfig's
declared default.

The file (JSON, `FORMAT`, version `VERSION`): `model` {name, kind, fingerprint} (`loader.model_identity`),
`sparsex_version`, `calibration_set`, `grid`, `rule`, `points` (every measured knob set with its KL,
top-1 and compute share) and `profiles` {fast, default, quality: {knobs, point, kl, top1,
compute_share, meets_bound}}. Only `format`, `version`, `model` and `profiles[*].knobs` are read
back; the rest documents the measurement.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

from sparsex.config import PROFILE_KNOBS, REUSE_PROFILES, EngineConfig, ReuseConfig, reuse_knob_names

logger = logging.getLogger(__name__)

FORMAT = "sparsex-reuse-profile"
VERSION = 1
PROFILE_DIR_ENV = "SPARSEX_PROFILE_DIR"
_DEFAULT_PROFILE_DIR = os.path.join("~", ".cache", "sparsex", "profiles")
BUILTIN = "built-in"            # ReuseProfiles.source of the built-in table
NO_FILE = "none"                # reuse_profile_file value that asks for the built-in table
# what a calibrated profile may set: the built-in profiles' two knobs plus the selector and its stages
CALIBRATED_KNOBS = ("full_layers", "recompute_ratio", "selector", "rescore_layers")


@dataclass(frozen=True)
class ModelIdentity:
    """What a profile file was calibrated on (`loader.model_identity`)."""
    name: str           # e.g. "smollm2-135m-instruct", a directory's name, "dummy:smollm2-135m"
    kind: str           # "gguf" | "hf_dir" | "dummy"
    fingerprint: str    # sha256 hex

    @staticmethod
    def of(model: str, seed: int = 0) -> ModelIdentity:
        from sparsex.models.loader import model_identity
        return ModelIdentity(*model_identity(model, seed=seed))

    @property
    def key(self) -> str:
        """The profile file's name in the profile dir, without `.json`."""
        name = re.sub(r"[^a-z0-9._-]+", "-", self.name.lower()).strip("-") or "model"
        return f"{name}-{self.fingerprint[:16]}"

    def as_json(self) -> dict[str, str]:
        return {"name": self.name, "kind": self.kind, "fingerprint": self.fingerprint}


@dataclass(frozen=True)
class ReuseProfiles:
    """A profile table (profile name -> the knobs it sets) and where it came from."""
    table: dict[str, dict[str, Any]]
    source: str = BUILTIN           # BUILTIN, or the profile file's path

    @staticmethod
    def builtin() -> ReuseProfiles:
        return ReuseProfiles({name: dict(knobs) for name, knobs in REUSE_PROFILES.items()})

    @property
    def calibrated(self) -> bool:
        return self.source != BUILTIN

    def describe(self, profile: str | None = None) -> str:
        """One line: every profile's knobs (or only `profile`'s) and the source."""
        names = [profile] if profile is not None else list(self.table)
        body = "; ".join(f"{n}: " + " ".join(f"{k}={_show(v)}" for k, v in self.table[n].items()) for n in names)
        return f"{body} (from {self.source})"


def _show(value: Any) -> str:
    return "auto" if value is None else str(value)


def profile_dir() -> str:
    """Where calibrated profile files are looked for and written by default."""
    return os.path.abspath(os.path.expanduser(os.environ.get(PROFILE_DIR_ENV) or _DEFAULT_PROFILE_DIR))


def default_profile_path(identity: ModelIdentity) -> str:
    return os.path.join(profile_dir(), identity.key + ".json")


# ---------------------------------------------------------------------------- reading


def check_profile_knobs(name: str, knobs: Any, where: str) -> dict[str, Any]:
    """A profile's knobs as a file gives them: a dict of CALIBRATED_KNOBS (full_layers and
    recompute_ratio at least), each a valid ReuseConfig value. ValueError naming `where`, the
    profile and the bad value."""
    if not isinstance(knobs, dict):
        raise ValueError(f"{where}: profile {name!r} must be an object of knobs, got {knobs!r}")
    unknown = sorted(set(knobs) - set(CALIBRATED_KNOBS))
    missing = [k for k in PROFILE_KNOBS if k not in knobs]
    if unknown or missing:
        raise ValueError(f"{where}: profile {name!r} sets {sorted(knobs)}; a profile sets {list(PROFILE_KNOBS)} "
                         f"and may set {[k for k in CALIBRATED_KNOBS if k not in PROFILE_KNOBS]}")
    try:
        ReuseConfig().with_overrides(knobs).verify()
    except ValueError as e:
        raise ValueError(f"{where}: profile {name!r}: {e}") from None
    return dict(knobs)


def read_profile_file(path: str) -> dict[str, Any]:
    """A profile file's JSON, checked for its format, version, model and three profiles."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"reuse profile file {path!r}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"reuse profile file {path!r} is not JSON ({e})") from None
    where = f"reuse profile file {path!r}"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{where} is not a {FORMAT} file (format {got!r}); `sparsex calibrate` writes them")
    if doc.get("version") != VERSION:
        raise ValueError(f"{where} has version {doc.get('version')!r}; this sparsex reads version {VERSION}")
    model = doc.get("model")
    if not isinstance(model, dict) or not all(isinstance(model.get(k), str) for k in ("name", "kind", "fingerprint")):
        raise ValueError(f"{where}: `model` must name the model (name, kind, fingerprint), got {model!r}")
    profiles = doc.get("profiles")
    if not isinstance(profiles, dict) or set(profiles) != set(REUSE_PROFILES):
        got = sorted(profiles) if isinstance(profiles, dict) else profiles
        raise ValueError(f"{where}: `profiles` must hold {sorted(REUSE_PROFILES)}, got {got!r}")
    for name, entry in profiles.items():
        check_profile_knobs(name, entry.get("knobs") if isinstance(entry, dict) else entry, where)
    return doc


def load_reuse_profiles(path: str, identity: ModelIdentity) -> ReuseProfiles:
    """The table of the profile file `path`, which must have been calibrated on `identity`'s model."""
    path = os.path.abspath(os.path.expanduser(path))
    doc = read_profile_file(path)
    m = doc["model"]
    if m["fingerprint"] != identity.fingerprint:
        raise ValueError(f"reuse profile file {path!r} was calibrated on another model: {m['name']!r} "
                         f"({m['kind']} {m['fingerprint'][:16]}), not {identity.name!r} ({identity.kind} "
                         f"{identity.fingerprint[:16]}); run `sparsex calibrate` for this model, or pass "
                         f"reuse_profile_file={NO_FILE!r} (--reuse-profile-file {NO_FILE}) for the built-in profiles")
    table = {name: dict(doc["profiles"][name]["knobs"]) for name in REUSE_PROFILES}
    return ReuseProfiles(table, path)


def find_reuse_profiles(model: str, reuse_profile_file: str | None = None, seed: int = 0) -> ReuseProfiles:
    """The profile table for `model` (see the module docstring for where it is looked for)."""
    if reuse_profile_file == NO_FILE:
        return ReuseProfiles.builtin()
    if reuse_profile_file is not None and (not isinstance(reuse_profile_file, str) or not reuse_profile_file.strip()):
        raise ValueError(f"reuse_profile_file must be a path or {NO_FILE!r}, got {reuse_profile_file!r}")
    identity = ModelIdentity.of(model, seed)
    if reuse_profile_file is not None:
        return load_reuse_profiles(reuse_profile_file, identity)
    path = default_profile_path(identity)
    if not os.path.exists(path):
        return ReuseProfiles.builtin()
    return load_reuse_profiles(path, identity)


# ---------------------------------------------------------------------------- writing


def write_profile_file(path: str, doc: dict[str, Any]) -> str:
    """Write `doc` as JSON at `path` (directories made, replaced atomically); returns the absolute path."""
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


# ---------------------------------------------------------------------------- engine config


def engine_config(profiles: ReuseProfiles, **knobs: Any) -> EngineConfig:
    """`EngineConfig.from_knobs(**knobs)` with `profiles`' table in place of the built-in one: the
    engine's reuse knobs are the named (or default) profile's from the table, then the explicit
    reuse knobs among `knobs` over them. A whole `reuse=ReuseConfig(...)` is taken as given."""
    if not profiles.calibrated or knobs.get("reuse") is not None:
        return EngineConfig.from_knobs(**knobs)
    names = set(reuse_knob_names())
    flat = {k: v for k, v in knobs.items() if k in names}
    rest = {k: v for k, v in knobs.items() if k not in names}
    base = ReuseConfig()
    reuse = base.with_overrides({**flat, "reuse_profile": flat.get("reuse_profile", base.reuse_profile)},
                                profiles.table)
    return EngineConfig.from_knobs(**rest, reuse=reuse)
