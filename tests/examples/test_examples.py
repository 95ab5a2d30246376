"""Every README code block is a file under examples/, and each example runs as written.

The README's ```python blocks start with ``# examples/NAME.py`` and must equal that file; the
online examples run against one real ``pagedllm serve`` of the embedded default model (with the
Hermes tool template, which SmolLM2's chat also uses without tools), the offline ones in their own
process. ``PAGEDLLM_URL`` points an example at the test server's port (default
http://127.0.0.1:8000, as in the README)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.server_helpers import serve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
MODEL = "SmolLM2-135M-Instruct"


def _readme_python_blocks() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_every_readme_python_block_is_an_example_file():
    blocks = _readme_python_blocks()
    assert len(blocks) >= 8
    for block in blocks:
        first = block.splitlines()[0]
        m = re.match(r"# (examples/[\w.]+\.py)\b", first)
        assert m, f"README python block does not start with '# examples/NAME.py': {first!r}"
        with open(os.path.join(ROOT, m.group(1)), encoding="utf-8") as f:
            assert f.read() == block, f"README block differs from {m.group(1)}"


def _run(name: str, *args: str, url: str | None = None, timeout: float = 240) -> str:
    env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if url:
        env["PAGEDLLM_URL"] = url
    # Run from a scratch directory: the examples must not depend on the repository as cwd.
    p = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], env=env, cwd="/",
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{name} failed:\n{p.stdout}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def server():
    # The README's tool-calling command, with the template named as the README names it.
    with serve([MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--chat-template", "pagedllm/entrypoints/openai/chat_templates/tool_chat_template_smollm2_hermes.jinja",
                "--max-model-len", "2048", "--kv-cache-memory", "256M"]) as (base, _proc):
        yield base


@pytest.mark.slow
def test_openai_chat(server):
    out = _run("openai_chat.py", url=server).strip().splitlines()
    assert len(out) >= 2 and len(out[0]) > 10 and len(out[-1]) > 0


@pytest.mark.slow
def test_openai_completions(server):
    first, top = _run("openai_completions.py", url=server).strip().splitlines()[:2]
    assert "length" in first and "8 tokens" in first and "Paris" in first
    assert top.count(":") == 2                     # two top logprobs for the first token


@pytest.mark.slow
def test_openai_structured_outputs(server):
    lines = _run("openai_structured_outputs.py", url=server).strip().splitlines()
    obj = eval(lines[0], {})                        # the printed dict of the parsed JSON
    assert set(obj) >= {"city", "country", "landmarks"} and len(obj["landmarks"]) <= 3
    assert lines[1] in ("yes", "no")


@pytest.mark.slow
def test_openai_tools(server):
    lines = _run("openai_tools.py", url=server).strip().splitlines()
    name, args = lines[0].split(" ", 1)
    assert name == "get_weather" and "city" in eval(args, {})
    assert len(lines) >= 2


@pytest.mark.slow
def test_openai_responses(server):
    lines = _run("openai_responses.py", url=server).strip().splitlines()
    rid, status, _ = lines[0].split(" ", 2)
    assert rid.startswith("resp") and status in ("completed", "incomplete")   # incomplete: max_output_tokens
    assert int(lines[1].rsplit(" ", 3)[-3]) > 10    # the continued response saw the earlier turn
    assert len(lines[2]) > 0


@pytest.mark.slow
def test_anthropic_messages(server):
    out = _run("anthropic_messages.py", url=server).strip()
    # the first print is "<text> <stop_reason> <output_tokens>"; the sampled text (temperature 1,
    # the API's default) may itself hold newlines, so find the line that ends the first answer
    lines = out.splitlines()
    ends = [i for i, ln in enumerate(lines) if re.search(r"(?:^| )(end_turn|max_tokens) (\d+)$", ln)]
    assert ends, out
    tokens = int(lines[ends[0]].rsplit(" ", 1)[1])
    assert 0 < tokens <= 32
    assert len(lines) > ends[0] + 1 and len(lines[-1]) > 0     # the streamed answer follows


@pytest.mark.slow
def test_ollama_client(server):
    lines = _run("ollama_client.py", url=server).strip().splitlines()
    assert "tok/s" in lines[0] and len(lines) >= 2


@pytest.mark.slow
def test_offline_chat():
    lines = _run("offline_chat.py").strip().splitlines()
    # (The chat answer's first token is a near tie for this model: float32 picks "The" over "L" by
    # 0.08 nats, transformers' bf16 by 0.13, so its text depends on the dtype; not asserted.)
    assert len(lines) == 3 and len(lines[0]) > 3
    assert "'The capital of France is' ->" in lines[1] and "Paris" in lines[1]
    assert "'1, 2, 3,' ->" in lines[2] and "4" in lines[2]


@pytest.mark.slow
def test_offline_speculative():
    out = _run("offline_speculative.py")
    assert "quick brown fox" in out


def _write_adapter(path: str, seed: int) -> str:
    """A random PEFT LoRA adapter (q_proj, v_proj; rank 4) for SmolLM2-135M's shapes."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(30):
        for mod, out in (("q_proj", 576), ("v_proj", 192)):
            pre = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[pre + ".lora_A.weight"] = torch.randn(4, 576, generator=g) * 0.05
            tensors[pre + ".lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.05
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                   "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
                   "base_model_name_or_path": MODEL}, f)
    return path


@pytest.mark.slow
def test_offline_lora(tmp_path):
    out = _run("offline_lora.py", _write_adapter(str(tmp_path / "sql"), 1),
               _write_adapter(str(tmp_path / "pirate"), 2))
    assert len(out.strip()) > 0


def test_chat_template_names_a_shipped_template_from_any_directory(tmp_path, monkeypatch):
    from pagedllm.engine.chat import load_chat_template
    monkeypatch.chdir(tmp_path)
    shipped = os.path.join(ROOT, "pagedllm", "entrypoints", "openai", "chat_templates",
                           "tool_chat_template_smollm2_hermes.jinja")
    text = open(shipped, encoding="utf-8").read()
    assert load_chat_template("tool_chat_template_smollm2_hermes") == text
    assert load_chat_template("pagedllm/entrypoints/openai/chat_templates/tool_chat_template_smollm2_hermes.jinja") == text
    (tmp_path / "tool_chat_template_smollm2_hermes.jinja").write_text("{{ 'own' }}")
    assert load_chat_template("tool_chat_template_smollm2_hermes.jinja") == "{{ 'own' }}"   # a real file wins
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_template("no_such_template.jinja")
