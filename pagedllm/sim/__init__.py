"""Fleet simulator: the real scheduler and block pool per replica, a fitted step-time model, router
policies, recorded or synthetic traces (``pagedllm simulate``; see docs/scaling.md)."""
