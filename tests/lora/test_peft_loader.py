"""Adapters that cannot be served are refused with an error naming the adapter (and what is
wrong); a refused adapter leaves the manager as it was."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import make_peft_adapter, ours_from_hf
from pagedllm.lora import LoRAAdapterError, LoRARequest
from pagedllm.lora.model_manager import LoRAModelManager
from pagedllm.lora.peft_loader import pattern_key


@pytest.fixture
def manager(hf_tiny):
    model = ours_from_hf(hf_tiny)
    return LoRAModelManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=2, dtype=torch.float32,
                            device=torch.device("cpu"))


def _copy(src: str, dst: str, config_update=None, tensors_fn=None) -> str:
    shutil.copytree(src, dst)
    if config_update:
        p = os.path.join(dst, "adapter_config.json")
        cfg = json.load(open(p))
        cfg.update(config_update)
        json.dump(cfg, open(p, "w"))
    if tensors_fn:
        p = os.path.join(dst, "adapter_model.safetensors")
        t = tensors_fn(load_file(p))
        save_file(t, p)
    return dst


def _refused(manager, path, *fragments):
    with pytest.raises(LoRAAdapterError) as ei:
        manager.add_adapter(LoRARequest("bad-one", 9, path))
    msg = str(ei.value)
    assert "'bad-one'" in msg, msg
    for f in fragments:
        assert f in msg, msg
    assert manager.list_adapters() == [] and manager.stats()["loads"] == 0
    return msg


def test_missing_adapter(manager, tmp_path):
    _refused(manager, str(tmp_path / "nope"), "No adapter found")
    (tmp_path / "empty").mkdir()
    _refused(manager, str(tmp_path / "empty"), "No adapter found", "adapter_config.json")


@pytest.mark.parametrize("update,fragment", [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias='all'"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"r": 4}, "rank 8 but adapter_config.json says 4"),
])
def test_unsupported_settings(manager, tiny_adapters, tmp_path, update, fragment):
    _refused(manager, _copy(tiny_adapters["all"], str(tmp_path / "a"), update), fragment)


def test_wrong_shape_names_module_and_expected_shape(manager, tiny_adapters, tmp_path):
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"

    def cut(t):
        t[key] = t[key][:-1].contiguous()
        return t

    _refused(manager, _copy(tiny_adapters["all"], str(tmp_path / "a"), tensors_fn=cut),
             "model.layers.1.self_attn.k_proj", "lora_B [32, r]")


def test_missing_b_matrix(manager, tiny_adapters, tmp_path):
    def drop(t):
        del t["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
        return t

    _refused(manager, _copy(tiny_adapters["all"], str(tmp_path / "a"), tensors_fn=drop),
             "model.layers.0.mlp.up_proj", "lora_B missing")


def test_unknown_target_modules(hf_tiny, manager, tmp_path):
    head = make_peft_adapter(hf_tiny, str(tmp_path / "head"), r=4, targets=["lm_head"])
    _refused(manager, head, "unknown target module 'lm_head'", "q_proj", "down_proj")
    emb = make_peft_adapter(hf_tiny, str(tmp_path / "emb"), r=4, targets=["embed_tokens"])
    _refused(manager, emb, "embedding LoRA")


def test_layer_outside_the_model(manager, tiny_adapters, tmp_path):
    def extra(t):
        t["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 64)
        t["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 8)
        return t

    _refused(manager, _copy(tiny_adapters["all"], str(tmp_path / "a"), tensors_fn=extra),
             "unknown target module 'model.layers.7.self_attn.q_proj'")


def test_rank_over_the_limit(hf_tiny, tmp_path):
    model = ours_from_hf(hf_tiny)
    mgr = LoRAModelManager(model, max_loras=1, max_lora_rank=4, max_cpu_loras=1, dtype=torch.float32,
                           device=torch.device("cpu"))
    path = make_peft_adapter(hf_tiny, str(tmp_path / "r16"), r=16, alpha=16)
    _refused(mgr, path, "rank 16, over max_lora_rank 4")


def test_bin_weights_load_like_safetensors(manager, tiny_adapters, tmp_path):
    d = _copy(tiny_adapters["qv"], str(tmp_path / "bin"))
    st = os.path.join(d, "adapter_model.safetensors")
    torch.save(load_file(st), os.path.join(d, "adapter_model.bin"))
    os.remove(st)
    manager.add_adapter(LoRARequest("bin", 1, d))
    manager.add_adapter(LoRARequest("st", 2, tiny_adapters["qv"]))
    a, b = manager.cpu_cache[1], manager.cpu_cache[2]
    assert set(a.weights) == set(b.weights) == {"model.layers.0.self_attn.qkv_proj",
                                                "model.layers.1.self_attn.qkv_proj"}
    for k in a.weights:
        assert torch.equal(a.weights[k].a, b.weights[k].a) and torch.equal(a.weights[k].bt, b.weights[k].bt)
        assert a.weights[k].a.shape == (2 * 2, 64)  # q and v slices, rank 2 each


def test_pattern_key_follows_peft():
    from peft.utils.other import get_pattern_key

    keys = ["down_proj", r"layers\.1\.self_attn\.q_proj", "q_proj"]
    for name in ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                 "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]:
        want = get_pattern_key(keys, name)
        assert (pattern_key(keys, name) or name) == want


def test_lora_request_validation():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/p")
    assert LoRARequest("x", 1, "/p") == LoRARequest("x", 2, "/q")  # by name, as vLLM's
    assert LoRARequest("x", 1).adapter_id == 1
