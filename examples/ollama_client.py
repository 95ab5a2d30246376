# examples/ollama_client.py — the ollama Python client against pagedllm's /api routes
import os

import ollama

client = ollama.Client(host=os.environ.get("PAGEDLLM_URL", "http://127.0.0.1:8000"))
r = client.chat(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi!"}],
                options={"temperature": 0, "num_predict": 32})
print(r.message.content, r.eval_count, r.eval_count / r.eval_duration * 1e9, "tok/s")
for part in client.generate(model="SmolLM2-135M-Instruct:latest", prompt="Why is the sky blue?",
                            stream=True, options={"num_predict": 32}):
    print(part.response, end="", flush=True)
print()
