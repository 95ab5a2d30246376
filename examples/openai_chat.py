# examples/openai_chat.py — a chat completion with the openai client (server: bash scripts/serve.sh)
import os

from openai import OpenAI

base_url = os.environ.get("PAGEDLLM_URL", "http://127.0.0.1:8000") + "/v1"
client = OpenAI(base_url=base_url, api_key="unused")
resp = client.chat.completions.create(
    model="SmolLM2-135M-Instruct",
    messages=[{"role": "user", "content": "Write one sentence about the sea."}],
    max_tokens=48, temperature=0)
print(resp.choices[0].message.content)

# Streaming: the same call with stream=True yields the answer as it is generated.
for chunk in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", stream=True, max_tokens=32, temperature=0,
        messages=[{"role": "user", "content": "Name three colours."}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
