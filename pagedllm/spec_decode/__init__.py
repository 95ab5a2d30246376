"""Speculative decoding proposers (n-gram, suffix, draft model, EAGLE/MTP heads), called by the
worker; verification (the rejection sampler) lives in ``pagedllm.sample``."""
