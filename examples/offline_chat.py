# examples/offline_chat.py — the offline API: no server, the engine in this process
from pagedllm import LLM, SamplingParams

llm = LLM("SmolLM2-135M-Instruct")          # or "org/name" (Hub), a .gguf path, or an HF model directory
outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                SamplingParams(temperature=0, max_tokens=32))
print(outs[0].outputs[0].text)
outs = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0, max_tokens=8))
for out in outs:
    print(repr(out.prompt), "->", repr(out.outputs[0].text))
