"""Which cache namespace a request runs in.

The engine keys every prefix block and every segment-index entry by the request's `cache_salt`,
so two requests only share KV when their salts are equal. This module turns the HTTP inputs into
that salt:

  * `--tenant-header NAME` set and the header present: salt = "tenant:" + header value
    (the body's `cache_salt` is ignored: the gateway that sets the header is the authority);
  * else the body's `cache_salt`, if any: salt = "salt:" + value;
  * else no salt: the default namespace, shared by every unsalted request.

The prefixes keep the two sources apart: a client cannot reach tenant "acme"'s entries by sending
`cache_salt: "acme"` without the header.

`cache_segment: {"scope": "shared"}` on content parts (refused unless --allow-shared-segments):
the engine has one salt per request, not per segment, so a request runs in the shared namespace
(salt dropped) only when *every* content part is marked shared; a request that mixes shared and
tenant parts stays entirely in its tenant namespace (safe, just less reuse).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sparsex.entrypoints.errors import bad_request

Scope = Literal["tenant", "shared", "default"]
TENANT_PREFIX = "tenant:"
SALT_PREFIX = "salt:"


@dataclass(frozen=True)
class CacheNamespace:
    salt: str | None
    scope: Scope          # reported to the client in the X-SparseX-Cache-Scope header


def resolve_namespace(*, header_value: str | None, body_salt: str | None, part_scopes: list[str],
                      allow_shared: bool, param: str) -> CacheNamespace:
    """part_scopes: the scope of every content part / segment ("tenant" when unmarked)."""
    if "shared" in part_scopes and not allow_shared:
        raise bad_request("cache_segment scope 'shared' is disabled on this server "
                          "(start it with --allow-shared-segments)", param=param, code="shared_segments_disabled")
    if part_scopes and all(s == "shared" for s in part_scopes):
        return CacheNamespace(None, "shared")
    if header_value:
        return CacheNamespace(TENANT_PREFIX + header_value, "tenant")
    if body_salt is not None:
        return CacheNamespace(SALT_PREFIX + body_salt, "tenant")
    return CacheNamespace(None, "default")
