# examples/openai_tools.py — a tool call and its round trip. Start the server with:
#   pagedllm serve SmolLM2-135M-Instruct --enable-auto-tool-choice --tool-call-parser hermes \
#     --chat-template tool_chat_template_smollm2_hermes
import json
import os

from openai import OpenAI

base_url = os.environ.get("PAGEDLLM_URL", "http://127.0.0.1:8000") + "/v1"
client = OpenAI(base_url=base_url, api_key="unused")
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]
# One call, greedy: a small model asked for "one or more" calls may repeat its call (or sample a
# long argument) until max_tokens cuts the JSON short, and an unfinished array holds no call.
resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                      tools=tools, tool_choice="required", max_tokens=64,
                                      parallel_tool_calls=False, temperature=0)
call = resp.choices[0].message.tool_calls[0]
print(call.function.name, json.loads(call.function.arguments))
# Send the call back with its result (only the fields the API defines: role, content, tool_calls).
messages += [resp.choices[0].message.model_dump(include={"role", "content", "tool_calls"}),
             {"role": "tool", "tool_call_id": call.id, "content": "18 C, light rain"}]
final = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                       tools=tools, max_tokens=64)
print(final.choices[0].message.content)
