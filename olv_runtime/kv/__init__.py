"""KV caches: contiguous capacity buffers appended in place
(:mod:`~olv_runtime.kv.contiguous`) and paged caches of blocks with per-block encodings
(:mod:`~olv_runtime.kv.paged`). The attention operators append to them; the state layer retains
them between calls (docs/kv_cache.md)."""
