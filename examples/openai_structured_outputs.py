# examples/openai_structured_outputs.py — output constrained to a JSON schema, and to a choice
import json
import os

from openai import OpenAI

base_url = os.environ.get("PAGEDLLM_URL", "http://127.0.0.1:8000") + "/v1"
client = OpenAI(base_url=base_url, api_key="unused")
schema = {"type": "object",
          "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                         "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["city", "country", "landmarks"]}
resp = client.chat.completions.create(
    model="SmolLM2-135M-Instruct",
    messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    max_tokens=200)
print(json.loads(resp.choices[0].message.content))

# vLLM's extra fields: one of a list of choices (also "regex", "grammar", "json").
resp = client.chat.completions.create(
    model="SmolLM2-135M-Instruct", max_tokens=4,
    messages=[{"role": "user", "content": "Is the sea salty? Answer yes or no."}],
    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
print(resp.choices[0].message.content)
