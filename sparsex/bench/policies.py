"""Cache policies the workload benchmark compares, all served by this engine on the same model.

A policy is an engine cache mode plus, for ``cache="sparsex"``, per-request segment-reuse
overrides (`LLMEngine.add_request(..., reuse=...)`). Named policies:

  none        full prefill of every prompt (cache="none")
  prefix      exact prefix caching only (cache="prefix")
  naive       reuse every hit segment's KV as is: selector none, full_layers 0, nothing recomputed
  epic16/32   EPIC-style: recompute only the first 16/32 tokens of each reused segment, in every
              layer (selector boundary, boundary_tokens k, recompute_ratio 0, full_layers 0)
  cacheblend  CacheBlend's rule as LMCache runs it (check layer 1): layer 0 on every row, then the
              K/V deviation of every row at layer 1, the top 15% recomputed from there on
              (kv_deviation, F=2, 0.15). Not F=1: layer 0's K/V depend only on token and position,
              so a deviation measured there is the re-rotation's rounding, not context
  sparsex     the engine's defaults (`ReuseConfig()`: sparse_q, F=4, two stages: 50% candidates
              re-scored 2 layers deeper, 12.5% kept; a request whose segment hits total fewer than
              `min_blend_tokens` = 256 tokens is not blended but served exact)
  sparsex-every-hit  the same, blending every hit however few tokens (min_blend_tokens=0)
  sparsex-fast / sparsex-quality  the engine's other reuse profiles (`reuse_profile`), otherwise its defaults

The baselines (naive, epic, cacheblend), custom specs and the sweep grid name selection rules:
they blend every hit, as the papers' rules do (min_blend_tokens=0), and select in one stage
(rescore_layers=0: ``sparse_q:2:0.15`` is one stage; ``rescore_layers=auto`` asks for the default's two);
every other knob is the engine's.

`sweep_policies()` gives the recompute_ratio x full_layers grid for the Pareto front. The default
selector scores tokens with a probe on layer F-1, so F=0 points use the boundary selector (the only
rule that needs no full layer), which is said in their name.

A custom policy is written ``SELECTOR:F:RATIO[:BOUNDARY][:KNOB=VALUE...]`` (e.g. ``kv_deviation:2:0.3``,
``sparse_q:4:auto`` for a per-request ratio,
``sparse_q:2:0.15:rescore_layers=2:candidate_ratio=0.3``): any other `ReuseConfig` field by name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sparsex.config import REUSE_PROFILES, SELECTORS, ReuseConfig, parse_ratio

SWEEP_RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
SWEEP_FULL_LAYERS = (0, 1, 2, 4)


@dataclass(frozen=True)
class Policy:
    name: str
    cache: str                                # engine cache mode: "none" | "prefix" | "sparsex"
    reuse: tuple[tuple[str, object], ...] = ()  # segment-reuse overrides (sorted items; hashable)
    description: str = ""
    family: str = "named"                     # "named" | "custom" | "sweep" (plots group by it)

    @property
    def overrides(self) -> dict | None:
        """What `add_request(reuse=...)` gets: None for non-segment policies and for the defaults."""
        if self.cache != "sparsex" or not self.reuse:
            return None
        return dict(self.reuse)

    def knobs(self) -> ReuseConfig | None:
        """The effective segment-reuse knobs (engine defaults + overrides), for reports."""
        if self.cache != "sparsex":
            return None
        return ReuseConfig().with_overrides(dict(self.reuse))

    def full_layers(self, num_layers: int) -> int:
        """Layers in which every uncached row is computed (all of them without segment reuse)."""
        knobs = self.knobs()
        return num_layers if knobs is None else knobs.full_layers


def _sparsex(name: str, description: str, family: str = "named", **reuse) -> Policy:
    """A selection-rule policy: it blends every hit (min_blend_tokens=0) and selects in one stage
    (rescore_layers=0) unless it says otherwise."""
    reuse.setdefault("min_blend_tokens", 0)
    reuse.setdefault("rescore_layers", 0)
    cfg = dataclasses.replace(ReuseConfig(), **reuse)
    cfg.verify()                    # a bad knob fails here, as a ValueError, before any model loads
    return Policy(name, "sparsex", tuple(sorted(reuse.items())), description, family)


def _named() -> dict[str, Policy]:
    d = ReuseConfig()
    return {p.name: p for p in (
        Policy("none", "none", description="full prefill, no cache"),
        Policy("prefix", "prefix", description="exact prefix caching"),
        _sparsex("naive", "reuse hit segments as is, recompute nothing",
                 selector="none", full_layers=0, recompute_ratio=0.0, boundary_tokens=0),
        _sparsex("epic16", "recompute the first 16 tokens of each reused segment (all layers)",
                 selector="boundary", full_layers=0, recompute_ratio=0.0, boundary_tokens=16),
        _sparsex("epic32", "recompute the first 32 tokens of each reused segment (all layers)",
                 selector="boundary", full_layers=0, recompute_ratio=0.0, boundary_tokens=32),
        _sparsex("cacheblend", "K/V deviation at layer 1 (after one full layer), recompute 15%",
                 selector="kv_deviation", full_layers=2, recompute_ratio=0.15, boundary_tokens=0),
        Policy("sparsex", "sparsex",
               description=f"engine defaults: {d.selector}, F={d.full_layers}, r={d.recompute_ratio}, two stages "
                           f"(candidates {d.candidate_ratio}), blends from {d.min_blend_tokens} hit tokens"),
        # the engine's defaults with one change, not a selection rule: no _sparsex (which would make it one stage)
        Policy("sparsex-every-hit", "sparsex", (("min_blend_tokens", 0),),
               "engine defaults, but blends whatever it hits (min_blend_tokens=0)"),
        *(Policy(f"sparsex-{name}", "sparsex", (("reuse_profile", name),),
                 f"reuse_profile={name}: F={knobs['full_layers']}, r={knobs['recompute_ratio']}, the other knobs the engine's")
          for name, knobs in REUSE_PROFILES.items() if name != "default"),
    )}


NAMED_POLICIES: dict[str, Policy] = _named()
DEFAULT_POLICIES = tuple(NAMED_POLICIES)


_POSITIONAL = ("selector", "full_layers", "recompute_ratio", "boundary_tokens")     # SELECTOR:F:RATIO:BOUNDARY
_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(ReuseConfig)}
_KNOB_TYPES = {name: kind for name, kind in _FIELD_TYPES.items() if name not in _POSITIONAL}


def parse_knob(item: str, spec: str | None = None, positional: bool = False) -> tuple[str, object]:
    """`name=value` -> (name, value typed as the ReuseConfig field); `spec` names the whole
    text in errors. `positional`: the fields a policy string gives by position (selector, F,
    ratio, boundary) are accepted by name too."""
    spec = item if spec is None else spec
    name, _, text = item.partition("=")
    types = _FIELD_TYPES if positional else _KNOB_TYPES
    kind = types.get(name)
    if kind is None:
        raise ValueError(f"policy {spec!r}: unknown knob {name!r}; choose one of {sorted(types)}")
    if isinstance(kind, str) and kind.endswith(" | None"):          # rescore_layers: None = the default
        if text in ("none", "auto"):
            return name, None
        kind = kind[: -len(" | None")]
    if kind in (str, "str"):
        return name, text
    if name == "recompute_ratio":
        kind = parse_ratio
    try:
        if kind in (bool, "bool"):
            if text not in ("0", "1", "true", "false"):
                raise ValueError
            return name, text in ("1", "true")
        return name, (int(text) if kind in (int, "int") else parse_ratio(text) if kind is parse_ratio else float(text))
    except ValueError:
        raise ValueError(f"policy {spec!r}: bad value {text!r} for {name}") from None


def _custom(spec: str) -> Policy:
    parts = [p for p in spec.split(":") if "=" not in p]
    knobs = dict(parse_knob(p, spec) for p in spec.split(":") if "=" in p)
    if len(parts) not in (3, 4):
        raise ValueError(f"policy {spec!r}: expected a name ({', '.join(NAMED_POLICIES)}) "
                         f"or SELECTOR:F:RATIO[:BOUNDARY][:KNOB=VALUE...]")
    selector = parts[0]
    if selector not in SELECTORS:
        raise ValueError(f"policy {spec!r}: unknown selector {selector!r}; choose one of {SELECTORS}")
    try:
        full_layers, ratio = int(parts[1]), parse_ratio(parts[2])
        boundary = int(parts[3]) if len(parts) == 4 else 0
    except ValueError:
        raise ValueError(f"policy {spec!r}: F and BOUNDARY must be integers, RATIO a number") from None
    extra = "".join(f", {k}={v}" for k, v in knobs.items())
    return _sparsex(spec, f"custom: {selector}, F={full_layers}, r={ratio}, boundary={boundary}{extra}", "custom",
                    selector=selector, full_layers=full_layers, recompute_ratio=ratio, boundary_tokens=boundary,
                    **knobs)


def parse_policies(text: str | list[str] | tuple[str, ...]) -> list[Policy]:
    """`none,prefix,sparsex` (or a list of names/specs) -> policies, in the given order."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    items = [s for s in items if s]
    if not items:
        raise ValueError("no policies given")
    out, seen = [], set()
    for item in items:
        policy = NAMED_POLICIES.get(item) or _custom(item)
        if policy.name in seen:
            raise ValueError(f"policy {item!r} is listed twice")
        seen.add(policy.name)
        out.append(policy)
    return out


def sweep_policies(ratios: tuple[float, ...] = SWEEP_RATIOS,
                   full_layers: tuple[int, ...] = SWEEP_FULL_LAYERS) -> list[Policy]:
    """The recompute_ratio x full_layers grid. F >= 1: the default selector; F = 0: boundary."""
    default = ReuseConfig().selector
    out = []
    for f in full_layers:
        selector = default if f >= 1 else "boundary"
        for r in ratios:
            out.append(_sparsex(f"sweep-{selector}-F{f}-r{r:g}",
                                f"sweep: {selector}, F={f}, r={r:g}", "sweep",
                                selector=selector, full_layers=f, recompute_ratio=r, boundary_tokens=0))
    return out
