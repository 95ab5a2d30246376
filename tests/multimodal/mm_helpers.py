"""A tiny random Gemma 3 image-text checkpoint (tests/arch_cases.py "gemma3-mm": 28x28 images, 4 image
tokens each) with a word-level tokenizer that knows Gemma's image markers, a ``Gemma3Processor``
and a small chat template with image parts, saved the way the Hub lays it out."""
from __future__ import annotations

import io
import os
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from arch_cases import CASES, VOCAB, build_hf  # noqa: E402

BOI, EOI, IMG_TOK = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# the words users send: w3 .. w252; w10 = user turn, w11 = model turn, w12 = end of turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ 'w10' if m['role'] == 'user' else 'w11' }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %} "
    "{% endfor %}{% endif %} w12 {% endfor %}{% if add_generation_prompt %}w11 {% endif %}")


def tiny_mm_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB - 3)] + [EOI, BOI, IMG_TOK]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (EOI, BOI, IMG_TOK)])
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                     extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMG_TOK})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_gemma3_mm_checkpoint(path: str, seed: int = 0):
    """Save the model, tokenizer and processor to ``path``; returns ``(hf model, processor)``."""
    cls, factory = CASES["gemma3-mm"]
    model = build_hf(factory(), cls, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    ip = tf.Gemma3ImageProcessor(size={"height": 28, "width": 28})
    proc = tf.Gemma3Processor(image_processor=ip, tokenizer=tiny_mm_tokenizer(), image_seq_length=4,
                              chat_template=CHAT_TEMPLATE)
    proc.save_pretrained(path)
    return model, proc


def image(seed: int, size=(40, 32)):
    """A random RGB ``PIL.Image`` (deterministic per seed)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    return Image.fromarray(arr, "RGB")


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def hf_greedy_mm(hf, proc, text: str, images: list, n: int):
    """transformers' greedy continuation of ``text`` with ``images`` (the processor's ids and pixels)."""
    inputs = proc(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    ids = inputs["input_ids"][0].tolist()
    toks = out.sequences[0, len(ids):].tolist()
    logps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, toks)]
    return ids, toks, logps


def greedy_params(n: int, **kw):
    """Greedy ``SamplingParams`` for ``n`` tokens with the chosen token's logprob (``logprobs=0``)."""
    from pagedllm import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0, **kw)


def run_greedy(llm, prompt, n: int, **kw):
    """``llm.generate(prompt)`` greedily for ``n`` tokens: (the RequestOutput, its token ids, the
    chosen tokens' logprobs)."""
    o = llm.generate(prompt, greedy_params(n, **kw), use_tqdm=False)[0]
    lps = [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
    return o, list(o.outputs[0].token_ids), lps


def runner_model(llm):
    """The model of an in-process ``LLM``'s runner."""
    return llm.llm_engine.core.executor.driver_worker.runner.model
