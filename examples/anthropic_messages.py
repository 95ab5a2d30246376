# examples/anthropic_messages.py — the Anthropic Messages API (/v1/messages) with the anthropic client
import os

import anthropic

client = anthropic.Anthropic(base_url=os.environ.get("PAGEDLLM_URL", "http://127.0.0.1:8000"),
                             api_key="unused")         # the client needs a key; the server ignores it
msg = client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=32,
                             system="Answer in one short sentence.",
                             messages=[{"role": "user", "content": "What is the capital of France?"}])
print(msg.content[0].text, msg.stop_reason, msg.usage.output_tokens)

with client.messages.stream(model="SmolLM2-135M-Instruct", max_tokens=24,
                            messages=[{"role": "user", "content": "Say hello."}]) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()
