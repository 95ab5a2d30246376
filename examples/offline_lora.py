# examples/offline_lora.py — multi-LoRA offline: python examples/offline_lora.py SQL_ADAPTER PIRATE_ADAPTER
# (each a PEFT directory with adapter_config.json and adapter_model.safetensors for SmolLM2-135M-Instruct)
import sys

from pagedllm import LLM, LoRARequest, SamplingParams

sql_path, pirate_path = sys.argv[1], sys.argv[2]
llm = LLM("SmolLM2-135M-Instruct", enable_lora=True, max_loras=2, max_lora_rank=16)
sql = LoRARequest("sql", 1, sql_path)              # name, unique id >= 1, PEFT directory
pirate = LoRARequest("pirate", 2, pirate_path)
params = SamplingParams(temperature=0, max_tokens=16)
prompts = ["The capital of France is", "The sea is"]
outs = llm.generate(prompts, params, lora_request=sql)              # every prompt on one adapter
outs = llm.generate(prompts, params, lora_request=[pirate, None])   # one per prompt; None = base
outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, lora_request=pirate)
print(outs[0].outputs[0].text)
