"""KV of segment entries beyond the device pool: a host-memory tier and a store shared by replicas
(Redis, or a Mooncake Store indexed in Redis). `record.py` is the one entry format every tier stores;
`segment_store.py` moves entries between the tiers."""
