# examples/openai_completions.py — plain text completion (/v1/completions) with logprobs
import os

from openai import OpenAI

base_url = os.environ.get("PAGEDLLM_URL", "http://127.0.0.1:8000") + "/v1"
client = OpenAI(base_url=base_url, api_key="unused")
resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                 max_tokens=8, temperature=0, logprobs=2)
choice = resp.choices[0]
print(repr(choice.text), choice.finish_reason, resp.usage.completion_tokens, "tokens")
print(choice.logprobs.top_logprobs[0])          # the two likeliest first tokens and their logprobs
