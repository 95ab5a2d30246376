"""Shared settings of the observability tests (the tiny checkpoint comes from conftest.py)."""

#: Engine settings for the tiny model: 4-token blocks so short prompts fill several blocks.
TINY_KW = dict(dtype="float32", num_threads=1, block_size=4, kv_cache_memory="256KiB",
               max_num_batched_tokens=64)
