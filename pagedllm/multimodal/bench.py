"""``pagedllm bench image``: repeated-image workload on an image-text checkpoint, run with the encoder
cache and prefix caching on, with only the encoder cache, and with both off.

Workload: ``--num-images`` distinct random RGB images (``--image-size`` px square, seeded), and
``--num-prompts`` requests, request ``i`` using image ``i % num_images`` first and then its own
random ``--question-len``-token question; greedy, ``--output-len`` tokens each (EOS ignored).
Two passes per mode on a fresh engine: sequential (one request at a time, as turns of a chat
about the same images: TTFT median) and concurrent (all submitted at once: output tokens/s and total
time). Figures are seconds and tokens/s on this machine; the report includes ``machine_report()``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

MODES = {"cache_on": dict(enable_prefix_caching=True, encoder_cache_size=None),
         "encoder_cache_only": dict(enable_prefix_caching=False, encoder_cache_size=None),
         "cache_off": dict(enable_prefix_caching=False, encoder_cache_size=0)}


def add_image_parser(sub: argparse._SubParsersAction) -> None:
    """``pagedllm bench image``."""
    from pagedllm.entrypoints.bench import _common

    p = sub.add_parser("image", help="repeated-image workload: TTFT and throughput, encoder cache and prefix "
                                     "caching on vs off",
                       description="Repeated images on an image-text model: encoder cache + prefix caching on "
                                   "vs off.")
    _common(p)
    p.add_argument("--num-prompts", type=int, default=16, help="number of requests")
    p.add_argument("--num-images", type=int, default=2, help="distinct images the requests cycle through")
    p.add_argument("--image-size", type=int, default=224, help="side of the square random images (px)")
    p.add_argument("--question-len", type=int, default=16, help="random question tokens after the image")
    p.add_argument("--output-len", type=int, default=16, help="output tokens per request")


def _images(n: int, size: int, seed: int) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB") for _ in range(n)]


def _prompts(llm: Any, args: argparse.Namespace) -> list[dict]:
    ip = llm.llm_engine.input_processor.image_processor
    if ip is None:
        raise ValueError(f"{args.model}: this model does not take images")
    tok = llm.get_tokenizer()
    rng = random.Random(args.seed)
    hi = max(4, min(len(tok), 32000) - 64)
    imgs = _images(args.num_images, args.image_size, args.seed)
    out = []
    for i in range(args.num_prompts):
        q = tok.decode([rng.randrange(3, hi) for _ in range(args.question_len)], skip_special_tokens=True)
        out.append({"prompt": f"{ip.placeholder} {q}", "multi_modal_data": {"image": imgs[i % len(imgs)]}})
    return out


def _pass(eng: Any, prompts: list[dict], output_len: int, concurrent: bool) -> dict:
    from pagedllm import SamplingParams
    from pagedllm.entrypoints.bench import run_batch
    from pagedllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    ttft: list[float] = []
    cached = 0
    t0 = time.perf_counter()
    batches = [prompts] if concurrent else [[p] for p in prompts]
    for batch in batches:
        first, n = run_batch(eng, batch, sp)
        ttft += first
        cached += n
    total = time.perf_counter() - t0
    return {"total_s": total, "ttft_median_s": statistics.median(ttft),
            "output_tokens_per_s": len(prompts) * output_len / total, "cached_tokens": cached}


def run_image(args: argparse.Namespace) -> dict:
    """Each mode of ``MODES`` on a fresh engine: a warm-up request, then the sequential and the
    concurrent pass. Ratios are ``cache_off / cache_on`` (TTFT, total time).

    Raises:
        ValueError: the model takes no images.
    """
    from pagedllm import LLM
    from pagedllm.entrypoints.bench import _engine_kwargs

    res: dict = {"num_requests": args.num_prompts, "num_images": args.num_images, "image_size": args.image_size,
                 "question_len": args.question_len, "output_len": args.output_len}
    for mode, over in MODES.items():
        kw = _engine_kwargs(args)
        kw.update({k: v for k, v in over.items() if v is not None or k != "encoder_cache_size"})
        llm = LLM(args.model, **kw)
        prompts = _prompts(llm, args)
        eng = llm.llm_engine
        warm = dict(prompts[0], multi_modal_data={"image": _images(1, args.image_size, args.seed + 99)[0]})
        _pass(eng, [warm], 2, False)  # first-call costs outside the figures
        for name, conc in (("sequential", False), ("concurrent", True)):
            r = _pass(eng, prompts, args.output_len, conc)
            res.update({f"{mode}_{name}_{k}": v for k, v in r.items()})
        ec = eng.core._encoder_cache_stats().get("encoder_cache", {})
        res[f"{mode}_encoder_cache_hits"] = ec.get("hits", 0)
        res[f"{mode}_encoder_cache_queries"] = ec.get("queries", 0)
        del llm, eng
    for name in ("sequential", "concurrent"):
        res[f"ratio_{name}_ttft_median_off_over_on"] = (res[f"cache_off_{name}_ttft_median_s"]
                                                        / res[f"cache_on_{name}_ttft_median_s"])
        res[f"ratio_{name}_total_off_over_on"] = res[f"cache_off_{name}_total_s"] / res[f"cache_on_{name}_total_s"]
    return res
