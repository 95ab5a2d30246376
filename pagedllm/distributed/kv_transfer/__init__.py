"""KV connectors: the seam between the engine's KV block pool and storage outside it (vLLM v1's
``vllm.distributed.kv_transfer``). See docs/kv_connector.md."""
