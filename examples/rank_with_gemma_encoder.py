"""Rank candidate actions for a state with a Gemma 3 encoder served by pagedllm.

The recipe (a fine-tuned Gemma 3 270M used as a joint encoder, "GemmaDecision"):

1. each whole "state + question + candidate" text is ONE input;
2. the engine returns the raw last-token hidden state: LAST pooling and ``use_activation=False``
   (vLLM's one switch for a pooler's output activation, which for an embedding model is the L2
   normalisation: without it the vector is the final-normed hidden state itself);
3. the client converts the vector to float32, L2-normalizes it and passes it through a small
   trained head: LayerNorm -> Linear -> GELU -> Linear -> one scalar per candidate;
4. candidates are ranked by that scalar (highest first).

The head lives in a safetensors file with the tensors ``norm.weight``, ``norm.bias``
(LayerNorm), ``fc1.weight``, ``fc1.bias`` (hidden -> inner), ``fc2.weight``, ``fc2.bias``
(inner -> 1). If the head was saved beside the encoder in the model directory, skip it when
loading the encoder with ``ignore_patterns=["head.safetensors"]`` (``--ignore-patterns``).

Offline:
    python examples/rank_with_gemma_encoder.py --model gemma-3-270m.gguf --head head.safetensors
HTTP, against the encoder directory ``export_gemma_encoder.py`` writes, served exactly as the
recipe serves it on vLLM:
    python examples/export_gemma_encoder.py enc/
    pagedllm serve enc/ --runner pooling --convert embed --dtype bfloat16 \
        --pooler-config '{"pooling_type":"LAST","use_activation":false}' --max-model-len 3072 \
        --gpu-memory-utilization 0.20
    python examples/rank_with_gemma_encoder.py --url http://localhost:8000 --head head.safetensors
Add --write-random-head to create a random head file first (for trying the pipeline).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import urllib.request
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def build_input(state: str, question: str, candidate: str) -> str:
    """One encoder input: the whole state + question + candidate text."""
    return f"State: {state}\nQuestion: {question}\nCandidate: {candidate}"


class RankingHead(torch.nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear -> scalar, float32."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, inner)
        self.fc2 = torch.nn.Linear(inner, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x)))).squeeze(-1)


def load_head(path: str) -> RankingHead:
    """The head from a safetensors file (float32)."""
    from safetensors.torch import load_file

    sd = load_file(path)
    head = RankingHead(sd["fc1.weight"].shape[1], sd["fc1.weight"].shape[0])
    head.load_state_dict({k: v.float() for k, v in sd.items()})
    return head.float().eval()


def write_random_head(path: str, hidden: int = 640, inner: int = 256, seed: int = 0) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    head = RankingHead(hidden, inner)
    with torch.no_grad():
        head.norm.weight.add_(0.1 * torch.randn(hidden))
        head.norm.bias.add_(0.1 * torch.randn(hidden))
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, path)


@torch.no_grad()
def head_scores(vectors: torch.Tensor, head: RankingHead) -> torch.Tensor:
    """Raw float32 vectors ``[N, hidden]`` -> L2-normalize -> head -> scores ``[N]``."""
    return head(F.normalize(vectors.float(), p=2, dim=-1))


def make_encoder(model: str, **kwargs):
    """A pagedllm LLM serving ``model`` as an encoder: LAST pooling, raw (unnormalized) float32 vectors."""
    from pagedllm import LLM, PoolerConfig

    kwargs.setdefault("dtype", "float32")
    return LLM(model, runner="pooling", convert="embed",
               pooler_config=PoolerConfig(pooling_type="LAST", use_activation=False), **kwargs)


def rank_offline(llm, head: RankingHead, state: str, question: str, candidates: Sequence[str]):
    """(scores [N], order: candidate indices best first) with an offline encoder (``make_encoder``)."""
    outs = llm.embed([build_input(state, question, c) for c in candidates], use_tqdm=False)
    vecs = torch.stack([o.outputs.data for o in outs])
    scores = head_scores(vecs, head)
    return scores, torch.argsort(scores, descending=True).tolist()


def embed_http(url: str, inputs: Sequence, model: Optional[str] = None, timeout: float = 600.0) -> torch.Tensor:
    """Vectors of ``inputs`` (texts, or token-id lists used exactly as given) from a server's
    ``POST /v1/embeddings`` as float32 ``[N, hidden]``, in input order.

    Asks for ``encoding_format: "base64"`` (little-endian float32: no float->text->float round
    trip). The activation is the server's: started with ``"use_activation": false`` in
    ``--pooler-config`` the vectors are raw.
    """
    import numpy as np

    body: dict = {"input": list(inputs), "encoding_format": "base64"}
    if model:
        body["model"] = model
    req = urllib.request.Request(url.rstrip("/") + "/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = json.load(r)["data"]
    return torch.stack([torch.from_numpy(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").copy())
                        for d in sorted(data, key=lambda d: d["index"])])


def rank_http(url: str, head: RankingHead, state: str, question: str, candidates: Sequence[str],
              model: Optional[str] = None):
    """The same over HTTP (``POST /v1/embeddings``, base64 float32 vectors)."""
    vecs = embed_http(url, [build_input(state, question, c) for c in candidates], model)
    scores = head_scores(vecs, head)
    return scores, torch.argsort(scores, descending=True).tolist()


EXAMPLE_STATE = "The kettle is on the stove and the water is boiling; a mug with a tea bag is on the table."
EXAMPLE_QUESTION = "What should be done next?"
EXAMPLE_CANDIDATES = [
    "Pour the boiling water into the mug.",
    "Put the kettle in the fridge.",
    "Turn off the stove.",
    "Add cold milk to the empty kettle.",
    "Wait for the tea to steep for three minutes.",
    "Throw the tea bag away unused.",
    "Open the window.",
    "Fill the mug with sand.",
]


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="encoder (GGUF file / HF dir) for the offline way; "
                                                  "default: the Gemma 3 270M GGUF")
    ap.add_argument("--url", default=None, help="a pagedllm server (the HTTP way)")
    ap.add_argument("--head", default="head.safetensors")
    ap.add_argument("--write-random-head", action="store_true")
    ap.add_argument("--ignore-patterns", nargs="*", default=[])
    args = ap.parse_args(argv)
    if args.write_random_head or not os.path.exists(args.head):
        write_random_head(args.head)
    head = load_head(args.head)
    if args.url:
        scores, order = rank_http(args.url, head, EXAMPLE_STATE, EXAMPLE_QUESTION, EXAMPLE_CANDIDATES)
    else:
        model = args.model
        if model is None:
            from pagedllm.loader import get_gemma3_gguf_path
            model = get_gemma3_gguf_path()
        llm = make_encoder(model, ignore_patterns=args.ignore_patterns)
        scores, order = rank_offline(llm, head, EXAMPLE_STATE, EXAMPLE_QUESTION, EXAMPLE_CANDIDATES)
    for rank, i in enumerate(order, 1):
        print(f"{rank}. {scores[i]: .4f}  {EXAMPLE_CANDIDATES[i]}")


if __name__ == "__main__":
    main()
