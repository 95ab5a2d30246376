"""HTTP pooling endpoints (vLLM's shapes): embeddings, pooling, classify, score, rerank.

    app.include_router(build_pooling_router(engine, served_model_names))

``engine`` is an ``EngineClient`` (``pagedllm.engine.protocol``: ``AsyncLLM``, ``DPAsyncLLM``);
``encode`` runs every input through the engine's input processor, as ``LLM.embed`` does.

Routes:
    POST /v1/embeddings           OpenAI: input str | list[str] | list[int] | list[list[int]],
                                  encoding_format "float" | "base64" (little-endian float32),
                                  dimensions; data[{object "embedding", index, embedding}], usage.
    POST /pooling                 vLLM: task "encode" (default) | "embed" | "classify" | "score" |
                                  "token_embed" | "token_classify";
                                  data[{object "pooling", index, data}] (nested lists).
    POST /classify                vLLM: data[{index, label, probs, num_classes}].
    POST /score, /v1/score        vLLM: text_1/text_2 (or queries/documents, data_1/data_2);
                                  data[{index, object "score", score}].
    POST /rerank, /v1/rerank, /v2/rerank
                                  Jina/Cohere: query, documents, top_n, return_documents;
                                  results[{index, relevance_score, document{text}}] sorted by
                                  relevance_score (descending).

Activation: every request takes ``use_activation`` (vLLM's one switch: the L2 normalisation of
embeddings, the softmax/sigmoid of classifiers; default: the server's --pooler-config, else
true) and its deprecated aliases ``normalize``, ``softmax``, ``activation`` (a contradiction is
a 400). ``dimensions`` needs a Matryoshka model (400 otherwise, as vLLM). Every response id is
``{prefix}-{X-Request-Id or random}``.

Scores: an embed model scores a pair by the cosine similarity of the two embeddings; a
classify (cross-encoder) model encodes the pair as one input (``tokenizer(text_1, text_2)``).
Errors are OpenAI bodies: 400 for a generation model, an over-long or empty input, an empty
input list or a bad parameter; 404 for an unknown model name.
"""
from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Callable, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIError, value_error_to_openai
from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing

TokenIds = list[int]
EmbeddingInput = Union[str, list[str], TokenIds, list[TokenIds]]


class _Base(OpenAIBaseModel):
    """Pooling request bodies: unknown fields are ignored with a logged warning (as vLLM)."""


class _ActivationFields(_Base):
    # vLLM >= 0.11: use_activation is the one switch of every pooling task (normalisation for
    # embeddings, softmax/sigmoid for classifiers); the others are its deprecated aliases.
    use_activation: Optional[bool] = None
    normalize: Optional[bool] = None
    softmax: Optional[bool] = None
    activation: Optional[bool] = None


class EmbeddingRequest(_ActivationFields):
    """``input`` (texts or token ids), or ``messages`` rendered with the chat template (vLLM's
    chat embedding request: no generation prompt, no special tokens added by default)."""

    model: Optional[str] = None
    input: Optional[EmbeddingInput] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: Optional[bool] = None  # default: True for input, False for messages

    @model_validator(mode="after")
    def _one_input(self) -> "EmbeddingRequest":
        if (self.input is None) == (self.messages is None):
            raise ValueError("input: Field required (or messages, a chat to render; not both)"
                             if self.input is None else "messages: give input or messages, not both")
        return self


class PoolingRequest(EmbeddingRequest):
    task: Optional[Literal["embed", "classify", "score", "encode", "token_embed", "token_classify"]] = None


class ClassificationRequest(_ActivationFields):
    model: Optional[str] = None
    input: EmbeddingInput
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: bool = True
    user: Optional[str] = None


ScoreSide = Union[str, list[str]]


class ScoreRequest(_ActivationFields):
    model: Optional[str] = None
    text_1: Optional[ScoreSide] = None
    text_2: Optional[ScoreSide] = None
    queries: Optional[ScoreSide] = None
    documents: Optional[ScoreSide] = None
    data_1: Optional[ScoreSide] = None
    data_2: Optional[ScoreSide] = None
    truncate_prompt_tokens: Optional[int] = None
    user: Optional[str] = None


class RerankDocumentIn(_Base):
    text: str


class RerankRequest(_ActivationFields):
    model: Optional[str] = None
    query: str
    documents: list[Union[str, RerankDocumentIn]]
    top_n: Optional[int] = Field(default=None)
    return_documents: bool = True
    truncate_prompt_tokens: Optional[int] = None
    user: Optional[str] = None


# ---------------------------------------------------------------------------------------- helpers
def encode_base64(values: Any) -> str:
    """base64 of the little-endian float32 bytes of ``values`` (a tensor or nested list)."""
    import numpy as np

    arr = values.detach().cpu().float().numpy() if hasattr(values, "detach") else np.asarray(values)
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<f4").tobytes()).decode("ascii")


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def to_prompts(inp: Any, param: str = "input") -> list:
    """Request ``input`` -> engine prompts (texts or ``{"prompt_token_ids": ids}``).

    Raises:
        OpenAIError: an empty list (400).
    """
    if isinstance(inp, str):
        return [inp]
    if not isinstance(inp, list) or not inp:
        raise OpenAIError(f"{param}: the input list is empty; give at least one input", 400, param)
    if _is_token_ids(inp):
        return [{"prompt_token_ids": list(inp)}]
    if all(isinstance(x, str) for x in inp):
        return list(inp)
    if all(_is_token_ids(x) for x in inp):
        return [{"prompt_token_ids": list(x)} for x in inp]
    raise OpenAIError(f"{param}: must be a string, a list of strings, a list of token ids or a list of "
                      "token-id lists", 400, param)


def _use_activation(req: Any) -> Optional[bool]:
    """The request's ``use_activation`` with its deprecated aliases folded in.

    Raises:
        OpenAIError: 400 on contradicting values.
    """
    from pagedllm.pooling_params import resolve_use_activation

    try:
        return resolve_use_activation(req.use_activation, normalize=req.normalize, softmax=req.softmax,
                                      activation=req.activation)
    except ValueError as e:
        raise OpenAIError(str(e), 400, "use_activation") from None


def _usage(n: int) -> dict:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


class OpenAIServingPooling(OpenAIServing):
    """The pooling endpoints' handler: the model check (a served name or a served LoRA adapter,
    as for generation), concurrent ``engine.encode`` calls and pair scoring
    (``entrypoints.score_utils``, shared with ``LLM.score``)."""

    @property
    def served(self) -> list[str]:
        return self.served_model_names

    # ---- checks
    def check(self, model: Optional[str], what: str) -> str:
        """The response's ``model`` for a request naming ``model``.

        Raises:
            OpenAIError: 404 for an unknown model name; 400 for a generation model.
        """
        self.check_model(model)
        if self.engine.runner != "pooling" or self.engine.pooler is None:
            raise OpenAIError(
                f"This model does not support the {what} API: it is a generation model (started with "
                f"--runner {self.engine.runner}); serve a pooling model with --runner pooling.", 400, "model")
        return self.response_model_name(model)

    @property
    def pooler(self) -> Any:
        return self.engine.pooler

    # ---- engine calls
    async def run(self, prompts: list, params_fn, task: str, base: str, add_special_tokens: bool = True,
                  model: Optional[str] = None) -> list:
        """Encode every prompt concurrently (engine ids ``{base}-{i}``; with the LoRA adapter
        ``model`` names, if any); the first error cancels (aborts) the rest."""
        lora = self.lora_request(model)
        extra = {"lora_request": lora} if lora is not None else {}
        tasks = [asyncio.ensure_future(self.engine.encode(p, params_fn(), f"{base}-{i}", task=task,
                                                          add_special_tokens=add_special_tokens, **extra))
                 for i, p in enumerate(prompts)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException as e:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if isinstance(e, ValueError):
                raise value_error_to_openai(e, "input") from None
            raise

    async def scores(self, q: list[str], d: list[str], truncate: Optional[int], use_act: Optional[bool],
                     base: str, model: Optional[str] = None) -> tuple[list[float], int]:
        """One score per (q[i], d[i]) and the prompt tokens used."""
        from pagedllm.entrypoints.score_utils import PairScoring
        from pagedllm.pooling_params import PoolingParams

        # NOTE: cosine similarity (embed models) does not depend on the embeddings'
        # normalisation, so use_activation changes nothing there (accepted, as vLLM does).
        plan = PairScoring(self.pooler.task, q, d, self.engine.tokenizer)
        outs = await self.run(plan.inputs, lambda: PoolingParams(truncate_prompt_tokens=truncate,
                                                                 use_activation=use_act), plan.task, base,
                              model=model)
        return [o.outputs.score for o in plan.results(outs)], plan.prompt_tokens(outs)


#: The name older callers import.
_Handler = OpenAIServingPooling


def _pair_lists(a: Any, b: Any, pa: str, pb: str) -> tuple[list[str], list[str]]:
    from pagedllm.entrypoints.score_utils import broadcast_pairs

    q = [a] if isinstance(a, str) else list(a or [])
    d = [b] if isinstance(b, str) else list(b or [])
    if not q:
        raise OpenAIError(f"{pa}: empty; give at least one text", 400, pa)
    if not d:
        raise OpenAIError(f"{pb}: empty; give at least one text", 400, pb)
    pairs = broadcast_pairs(q, d)
    if pairs is None:
        raise OpenAIError(f"{pa} has {len(q)} texts and {pb} {len(d)}: give one {pa}, or as many as {pb}",
                          400, pa)
    return pairs


def _request_id(raw_request: Request, prefix: str) -> str:
    """``{prefix}-{client X-Request-Id or random}``, recorded for the X-Request-Id response header."""
    from pagedllm.entrypoints.openai.serving_engine import base_request_id, record_request_id

    rid = f"{prefix}-{base_request_id(raw_request)}"
    record_request_id(raw_request, rid)
    return rid


def _wrap(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    return value_error_to_openai(e, "input")


# ---------------------------------------------------------------------------------------- router
def build_pooling_router(engine: EngineClient, served_model_names: Optional[list[str]] = None,
                         loras: Any = None, chat: Any = None) -> APIRouter:
    """FastAPI router with the pooling endpoints for ``engine`` (see the module docstring);
    ``loras``: the server's ``LoRARegistry`` (a request's ``model`` may name an adapter), or
    None; ``chat``: the server's chat serving, whose template renders ``messages`` inputs (None:
    the tokenizer's template)."""
    from pagedllm.pooling_params import PoolingParams

    names = served_model_names or [str(engine.model_name)]
    h = OpenAIServingPooling(engine, [names] if isinstance(names, str) else list(names))
    h.loras = loras
    router = APIRouter()

    async def guarded(coro_fn):
        try:
            return await coro_fn()
        except OpenAIError as e:
            return e.to_response()
        except ValueError as e:
            return _wrap(e).to_response()

    async def pool_list(request: Any, raw_request: Request, prefix: str, what: str, task: str,
                        item: Callable[[Any], dict], **params: Any) -> JSONResponse:
        """One pooling run of ``request.input`` for ``task``, answered as an OpenAI list:
        ``{"index": i, **item(output)}`` a prompt, and the prompt tokens as usage."""
        rid = _request_id(raw_request, prefix)
        model = h.check(request.model, what)
        messages = getattr(request, "messages", None)
        prompts = to_prompts(request.input) if messages is None else [render_messages(request)]
        add_special = request.add_special_tokens
        if add_special is None:
            add_special = messages is None
        for i, p in enumerate(prompts):  # an empty input fails the request before any input runs
            if p == "" or (isinstance(p, dict) and not p["prompt_token_ids"]):
                if isinstance(p, dict) or not h.engine.input_processor.tokenize("", add_special):
                    where = "input" if len(prompts) == 1 else f"input[{i}]"
                    raise OpenAIError(f"{where}: The prompt cannot be empty.", 400, "input")
        use_act = _use_activation(request)
        mk = lambda: PoolingParams(use_activation=use_act,  # noqa: E731
                                   truncate_prompt_tokens=request.truncate_prompt_tokens, **params)
        mk()  # parameter errors before any work
        outs = await h.run(prompts, mk, task, rid, add_special, model=request.model)
        data = [{"index": i, **item(o)} for i, o in enumerate(outs)]
        n = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse({"id": rid, "object": "list", "created": int(time.time()),
                             "model": model, "data": data, "usage": _usage(n)})

    def render_messages(request: Any) -> str:
        """A chat embedding request's ``messages`` through the chat template."""
        from pagedllm.entrypoints.openai.protocol import ChatMessageParam
        from pagedllm.entrypoints.openai.serving_chat import render_chat

        if not request.messages:
            raise OpenAIError("messages: must contain at least one message", 400, "messages")
        try:
            msgs = [ChatMessageParam(**m) for m in request.messages]
        except (TypeError, ValueError) as e:
            raise OpenAIError(f"messages: {e}", 400, "messages") from None
        text = render_chat(chat if chat is not None else h, msgs,
                           add_generation_prompt=request.add_generation_prompt,
                           continue_final_message=request.continue_final_message,
                           chat_template=request.chat_template, chat_template_kwargs=request.chat_template_kwargs)
        return str(text)

    def vector(request: Any) -> Callable[[Any], Any]:
        """An output's vector as the request's ``encoding_format`` asks (base64 or a list)."""
        if request.encoding_format == "base64":
            return lambda o: encode_base64(o.outputs.data)
        return lambda o: o.outputs.data.tolist()

    def classification(o: Any) -> dict:
        probs = o.outputs.data.float().reshape(-1).tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        return {"label": h.pooler.label(best), "probs": probs, "num_classes": len(probs)}

    @router.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request):
        vec = vector(request)
        return await guarded(lambda: pool_list(
            request, raw_request, "embd", "embeddings", "embed",
            lambda o: {"object": "embedding", "embedding": vec(o)}, dimensions=request.dimensions))

    @router.post("/pooling")
    async def create_pooling(request: PoolingRequest, raw_request: Request):
        vec = vector(request)
        return await guarded(lambda: pool_list(
            request, raw_request, "pool", "pooling", request.task or "encode",
            lambda o: {"object": "pooling", "data": vec(o)}, dimensions=request.dimensions))

    @router.post("/classify")
    async def create_classify(request: ClassificationRequest, raw_request: Request):
        return await guarded(lambda: pool_list(request, raw_request, "classify", "classification", "classify",
                                               classification))

    async def score(request: ScoreRequest, raw_request: Request):
        async def go():
            rid = _request_id(raw_request, "score")
            model = h.check(request.model, "score")
            if request.text_1 is not None or request.text_2 is not None:
                a, b, pa, pb = request.text_1, request.text_2, "text_1", "text_2"
            elif request.queries is not None or request.documents is not None:
                a, b, pa, pb = request.queries, request.documents, "queries", "documents"
            else:
                a, b, pa, pb = request.data_1, request.data_2, "data_1", "data_2"
            q, d = _pair_lists(a, b, pa, pb)
            res, n = await h.scores(q, d, request.truncate_prompt_tokens, _use_activation(request), rid, request.model)
            data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(res)]
            return JSONResponse({"id": rid, "object": "list", "created": int(time.time()),
                                 "model": model, "data": data, "usage": _usage(n)})
        return await guarded(go)

    async def rerank(request: RerankRequest, raw_request: Request):
        async def go():
            rid = _request_id(raw_request, "rerank")
            model = h.check(request.model, "rerank")
            docs = [x if isinstance(x, str) else x.text for x in request.documents]
            if not docs:
                raise OpenAIError("documents: empty; give at least one document", 400, "documents")
            if request.top_n is not None and request.top_n < 0:
                raise OpenAIError(f"top_n: must be >= 0, got {request.top_n}", 400, "top_n")
            res, n = await h.scores([request.query] * len(docs), docs, request.truncate_prompt_tokens,
                                    _use_activation(request), rid, request.model)
            order = sorted(range(len(docs)), key=lambda i: res[i], reverse=True)
            if request.top_n:
                order = order[:request.top_n]
            results = []
            for i in order:
                r: dict = {"index": i, "relevance_score": res[i]}
                if request.return_documents:
                    r["document"] = {"text": docs[i]}
                results.append(r)
            return JSONResponse({"id": rid, "model": model,
                                 "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results})
        return await guarded(go)

    for path in ("/score", "/v1/score"):
        router.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"])
    return router
