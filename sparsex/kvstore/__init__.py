"""KV of segment entries beyond the device: a host-memory tier and a shared Redis store (issue: one
replica's segment index is its own). `record.py` is the one entry format every tier stores."""
