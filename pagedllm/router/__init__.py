"""``pagedllm router``: a prefix-cache-aware front over many replicas (``server``), its prefix
index built from the replicas' KV events (``index``) and its policies (``policy``)."""
