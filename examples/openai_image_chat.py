# examples/openai_image_chat.py — an image in a chat with the openai client (server: pagedllm serve of
# a Gemma 3 image-text checkpoint, e.g. `pagedllm serve google/gemma-3-4b-it`); usage: python
# examples/openai_image_chat.py photo.png
import base64
import os
import sys

from openai import OpenAI

base_url = os.environ.get("PAGEDLLM_URL", "http://127.0.0.1:8000") + "/v1"
model = os.environ.get("PAGEDLLM_MODEL", "google/gemma-3-4b-it")
client = OpenAI(base_url=base_url, api_key="unused")
b64 = base64.b64encode(open(sys.argv[1], "rb").read()).decode()
r = client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
    {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
        {"type": "text", "text": "What is in this picture?"}]}])
print(r.choices[0].message.content)
