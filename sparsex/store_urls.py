"""The shared segment store's urls, checked where they are given (EngineConfig) and where they are used
(the tiers): `redis://` / `rediss://` (the Redis tier, and the index of a Mooncake store) and
`mooncake://` (sparsex/kvstore/mooncake_tier.py). ValueError naming the url (its password hidden)."""
from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from sparsex.arg_types import parse_bytes

REDIS_SCHEMES = ("redis", "rediss")
_SCHEMES = REDIS_SCHEMES
_PROTOCOLS = ("tcp", "rdma")
_OPTIONS = ("metadata", "protocol", "device", "segment", "buffer", "host", "timeout", "part")
DEFAULT_PORT = 50051                         # mooncake_master's default RPC port
DEFAULT_SEGMENT_BYTES = 512 << 20
DEFAULT_BUFFER_BYTES = 16 << 20
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_PART_BYTES = 16 << 20


def redact(url: str) -> str:
    """The url without its password (error messages and logs must not show it)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def _split(url, kind: str, shown: str, form: str):
    """(urlsplit parts, port) of a non-empty url string; ValueError "bad <kind> url <shown>: ..." else."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"bad {kind} url {shown}: {form}")
    try:
        parts = urlsplit(url)
        return parts, parts.port
    except ValueError as e:
        raise ValueError(f"bad {kind} url {shown}: {e}") from None


def parse_redis_url(url: str) -> dict:
    """Check a `redis://[user:password@]host:port/db` url (or rediss://, optionally ?ssl_...=...);
    ValueError naming it (password hidden) if bad. A password with special characters is %-encoded."""
    shown = redact(url) if isinstance(url, str) else repr(url)
    parts, port = _split(url, "Redis", shown, "expected redis://[user:password@]host:port/db")
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"bad Redis url {shown}: scheme must be one of {', '.join(s + '://' for s in _SCHEMES)}")
    if not parts.hostname:
        raise ValueError(f"bad Redis url {shown}: no host")
    db = parts.path.strip("/") or "0"
    if not db.isdigit():
        raise ValueError(f"bad Redis url {shown}: the path must be a database number, got {parts.path!r}")
    if parts.fragment:
        raise ValueError(f"bad Redis url {shown}: no '#' part is taken")
    # The tier sets its own timeouts and retries (redis-py lets url options override them); rediss://
    # may carry TLS options (?ssl_cert_reqs=none, ?ssl_ca_certs=/path).
    options = parse_qsl(parts.query, keep_blank_values=True)
    bad = [name for name, _ in options if parts.scheme != "rediss" or not name.startswith("ssl_")]
    if bad:
        raise ValueError(f"bad Redis url {shown}: options {bad} are not taken (rediss:// takes ssl_* options)")
    return {"scheme": parts.scheme, "host": parts.hostname, "port": port or 6379, "db": int(db),
            "username": parts.username or None, "password": parts.password}


def parse_mooncake_url(url: str) -> dict:
    """Check a `mooncake://master:port?metadata=http://host:port/metadata&protocol=tcp` url; ValueError
    naming it if bad. Options: protocol (tcp | rdma), device (RDMA device names, with rdma), segment
    (bytes of this replica's memory in the store: 512M), buffer (the client's own transfer buffer: 16M),
    host (the address other clients reach this one at; default: the one that routes to the master),
    timeout (seconds a store call may take before the tier counts it failed: 1.0), part (the largest
    object a record's payload is stored as: a larger payload is cut into parts of this size, moved in
    one batch: 16M)."""
    shown = repr(url)
    form = "expected mooncake://master:port?metadata=http://host:port/metadata&protocol=tcp"
    parts, port = _split(url, "Mooncake", shown, form)
    if parts.scheme != "mooncake":
        raise ValueError(f"bad Mooncake url {shown}: scheme must be mooncake://")
    if not parts.hostname:
        raise ValueError(f"bad Mooncake url {shown}: no master host; {form}")
    if parts.path not in ("", "/") or parts.fragment or parts.username or parts.password:
        raise ValueError(f"bad Mooncake url {shown}: only mooncake://master:port?options; {form}")
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"bad Mooncake url {shown}: options {unknown} are not taken (known: {', '.join(_OPTIONS)})")
    metadata = options.get("metadata", "")
    try:
        meta = urlsplit(metadata)
        meta_ok = meta.scheme in ("http", "https") and bool(meta.hostname) and meta.port is not None
    except ValueError:
        meta_ok = False
    if not meta_ok:
        raise ValueError(f"bad Mooncake url {shown}: metadata must be the master's HTTP metadata server, "
                         f"http://host:port/metadata (mooncake_master --enable_http_metadata_server=true)")
    protocol = options.get("protocol", "tcp")
    if protocol not in _PROTOCOLS:
        raise ValueError(f"bad Mooncake url {shown}: protocol must be one of {_PROTOCOLS}, got {protocol!r}")
    if options.get("device") and protocol != "rdma":
        raise ValueError(f"bad Mooncake url {shown}: device names RDMA devices; it needs protocol=rdma")
    try:
        segment = parse_bytes(options["segment"]) if "segment" in options else DEFAULT_SEGMENT_BYTES
        buffer = parse_bytes(options["buffer"]) if "buffer" in options else DEFAULT_BUFFER_BYTES
        timeout = float(options.get("timeout", DEFAULT_TIMEOUT_S))
        part = parse_bytes(options["part"]) if "part" in options else DEFAULT_PART_BYTES
    except ValueError as e:
        raise ValueError(f"bad Mooncake url {shown}: {e}") from None
    if not timeout > 0:
        raise ValueError(f"bad Mooncake url {shown}: timeout must be > 0 seconds, got {timeout}")
    if part < 1 << 20:
        raise ValueError(f"bad Mooncake url {shown}: part must be at least 1M, got {options['part']!r}")
    return {"master": f"{parts.hostname}:{port or DEFAULT_PORT}", "master_host": parts.hostname,
            "metadata": metadata, "protocol": protocol, "device": options.get("device", ""),
            "segment": segment, "buffer": buffer, "host": options.get("host") or None, "timeout": timeout,
            "part": part}
