"""LoRA on a tiny random Llama against transformers + peft: each adapter alone (prefill and decode,
fp32 logits within 1e-4), batches mixing adapters and the base (each row gets its solo result),
slot swapping and CPU-cache eviction past their bounds, and steps without adapter rows left
bit-identical."""
from __future__ import annotations

import pytest
import torch

from pagedllm.lora import LoRARequest
from pagedllm.lora.model_manager import LoRAModelManager

from lora_helpers import LoRAStepDriver, ours_from_hf, peft_logits

PROMPT = [5, 17, 3, 88, 42, 9, 61, 23, 7, 70, 31, 2]
OTHER = [44, 12, 90, 6, 33, 71, 8]
MORE = [11, 50, 93]


def _manager(model, max_loras=4, max_cpu_loras=None, max_lora_rank=8):
    return LoRAModelManager(model, max_loras=max_loras, max_lora_rank=max_lora_rank,
                            max_cpu_loras=max_cpu_loras or max_loras, dtype=model.dtype, device=torch.device("cpu"))


def _req(name, i, path):
    return LoRARequest(name, i, path)


@pytest.mark.parametrize("name", ["all", "rslora", "qv", "pattern"])
def test_adapter_matches_peft_prefill_and_decode(hf_tiny, tiny_adapters, name):
    model = ours_from_hf(hf_tiny)
    drv = LoRAStepDriver(model, _manager(model))
    lr = _req(name, 7, tiny_adapters[name])
    ref = peft_logits(hf_tiny, tiny_adapters[name], PROMPT + MORE)
    base = peft_logits(hf_tiny, None, PROMPT)
    got = drv.step([("a", PROMPT, lr)])["a"]
    torch.testing.assert_close(got, ref[:len(PROMPT)], atol=1e-4, rtol=1e-4)
    assert (got - base).abs().max() > 0.05  # the adapter really changes the logits
    for i, tok in enumerate(MORE[:-1]):
        out = drv.step([("a", [tok], lr)])["a"]
        torch.testing.assert_close(out[0], ref[len(PROMPT) + i], atol=1e-4, rtol=1e-4)


def test_mixed_batch_each_row_gets_its_solo_result(hf_tiny, tiny_adapters):
    """Three adapters and the base in the same steps (prefills, then decodes mixed with a chunked
    prefill): every request's logits equal those of the request run alone."""
    names = ["all", "rslora", "qv"]
    lrs = {n: _req(n, i + 1, tiny_adapters[n]) for i, n in enumerate(names)}
    plan = {"r0": ("all", PROMPT), "r1": ("rslora", OTHER), "r2": (None, PROMPT[:9]), "r3": ("qv", PROMPT),
            "r4": ("all", OTHER[:5])}

    def lr_of(rid):
        n = plan[rid][0]
        return None if n is None else lrs[n]

    model = ours_from_hf(hf_tiny)
    drv = LoRAStepDriver(model, _manager(model, max_loras=3))
    first = drv.step([(rid, toks, lr_of(rid)) for rid, (_, toks) in plan.items()])
    assert drv.last_mapping is not None and len(drv.last_mapping.segments) == 3
    # decodes of r0..r2 with a two-chunk prefill of r5 (adapter "rslora")
    drv.step([("r5", PROMPT[:5], lrs["rslora"])])
    second = drv.step([("r0", [MORE[0]], lr_of("r0")), ("r1", [MORE[1]], lr_of("r1")),
                       ("r2", [MORE[2]], lr_of("r2")), ("r5", PROMPT[5:], lrs["rslora"])])
    for rid, (n, toks) in plan.items():
        path = None if n is None else tiny_adapters[n]
        ref = peft_logits(hf_tiny, path, toks + [MORE[int(rid[1])] if rid in ("r0", "r1", "r2") else 0])
        torch.testing.assert_close(first[rid], ref[:len(toks)], atol=1e-4, rtol=1e-4)
        if rid in second:
            torch.testing.assert_close(second[rid][0], ref[len(toks)], atol=1e-4, rtol=1e-4)
    ref5 = peft_logits(hf_tiny, tiny_adapters["rslora"], PROMPT)
    torch.testing.assert_close(second["r5"], ref5[5:], atol=1e-4, rtol=1e-4)


def test_steps_without_adapters_are_bit_identical(hf_tiny, tiny_adapters):
    plain = ours_from_hf(hf_tiny)
    model = ours_from_hf(hf_tiny)
    mgr = _manager(model)
    mgr.add_adapter(_req("all", 1, tiny_adapters["all"]))
    drv, ref = LoRAStepDriver(model, mgr), LoRAStepDriver(plain, None)
    for chunk in ([("a", PROMPT, None), ("b", OTHER, None)], [("a", [3], None), ("b", [4], None)]):
        got, want = drv.step(chunk), ref.step(chunk)
        assert drv.last_mapping is None
        for rid in want:
            assert torch.equal(got[rid], want[rid])


def test_slots_swap_and_cpu_cache_evicts_past_their_bounds(hf_tiny, tiny_adapters):
    """Two slots and a CPU cache of two for four adapters used in turn: slots are reused (least
    recently used first), evicted adapters are read from disk again, results stay exact."""
    model = ours_from_hf(hf_tiny)
    mgr = _manager(model, max_loras=2, max_cpu_loras=2)
    drv = LoRAStepDriver(model, mgr)
    names = ["all", "rslora", "qv", "pattern"]
    lrs = [_req(n, i + 1, tiny_adapters[n]) for i, n in enumerate(names)]
    for rnd in range(2):
        for i, lr in enumerate(lrs):
            got = drv.step([(f"{rnd}-{i}", PROMPT, lr)])[f"{rnd}-{i}"]
            torch.testing.assert_close(got, peft_logits(hf_tiny, lr.lora_path, PROMPT), atol=1e-4, rtol=1e-4)
            st = mgr.stats()
            assert st["cpu_cache_adapters"] <= 2 and st["active_slots"] <= 2
    assert mgr.stats()["loads"] == 8  # each adapter read twice: the cache of 2 never holds it a round
    assert mgr.stats()["slot_swaps"] == 8
    assert len(mgr.list_adapters()) == 2
    # two adapters in one step use both slots; a third distinct one is a scheduler bug
    drv.step([("x", PROMPT, lrs[0]), ("y", OTHER, lrs[1])])
    with pytest.raises(RuntimeError, match="max_loras"):
        drv.step([("p", PROMPT, lrs[0]), ("q", OTHER, lrs[1]), ("r", PROMPT, lrs[2])])


def test_remove_adapter_frees_cache_and_slot(hf_tiny, tiny_adapters):
    model = ours_from_hf(hf_tiny)
    mgr = _manager(model, max_loras=1)
    lr = _req("all", 3, tiny_adapters["all"])
    LoRAStepDriver(model, mgr).step([("a", PROMPT, lr)])
    assert mgr.list_adapters() == [3] and mgr.slot_ids == [3]
    assert mgr.remove_adapter(3) is True
    assert mgr.list_adapters() == [] and mgr.slot_ids == [None]
    assert all(w is None for layer in mgr.layers.values() for w in layer.slot_weights)
    assert mgr.remove_adapter(3) is False
