# examples/openai_responses.py — the Responses API: a stored response continued by id, and streaming
import os

from openai import OpenAI

base_url = os.environ.get("PAGEDLLM_URL", "http://127.0.0.1:8000") + "/v1"
client = OpenAI(base_url=base_url, api_key="unused")
first = client.responses.create(model="SmolLM2-135M-Instruct", input="Name a large city in France.",
                                instructions="Answer in a few words.", max_output_tokens=24,
                                temperature=0, store=True)
print(first.id, first.status, repr(first.output_text))
second = client.responses.create(model="SmolLM2-135M-Instruct", input="And one in Italy?",
                                 previous_response_id=first.id, max_output_tokens=24, temperature=0)
print(repr(second.output_text), second.usage.input_tokens, "input tokens")

with client.responses.stream(model="SmolLM2-135M-Instruct", input="Count to five.",
                             max_output_tokens=24, temperature=0) as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
print()
