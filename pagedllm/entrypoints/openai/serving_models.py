"""GET /v1/models, POST /tokenize, POST /detokenize."""
from __future__ import annotations

from typing import Annotated, Any, Union

import datetime

from fastapi import APIRouter, Request
from pydantic import Discriminator, Tag
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse,
                                                  ModelCard, ModelList, ModelPermission,
                                                  TokenizeChatRequest, TokenizeCompletionRequest,
                                                  TokenizeResponse)
from pagedllm.entrypoints.openai.serving_chat import render_chat
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing


def _tokenize_kind(body: Any) -> str:
    return "tokenize[chat]" if isinstance(body, dict) and "messages" in body else "tokenize[prompt]"


# /tokenize's body: chat messages or a prompt, told apart by "messages" (so that an error names
# the field of the form the client sent, not a "messages: Field required" of the other form). The
# tags have the shape errors.format_validation_errors drops from an error's location.
TokenizeBody = Annotated[Union[Annotated[TokenizeChatRequest, Tag("tokenize[chat]")],
                               Annotated[TokenizeCompletionRequest, Tag("tokenize[prompt]")]],
                         Discriminator(_tokenize_kind)]


class OpenAIServingModels(OpenAIServing):

    def show_available_models(self) -> ModelList:
        root = str(self.engine.model_name)
        cards = [ModelCard(id=name, root=root, max_model_len=self.max_model_len, permission=[ModelPermission()])
                 for name in self.served_model_names]
        if self.loras is not None:
            cards.extend(self.loras.cards())  # LoRA adapters, each with its base model as `parent`
        return ModelList(data=cards)


class OpenAIServingTokenization(OpenAIServing):

    def tokenize(self, request: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = render_chat(self, request.messages,
                               add_generation_prompt=request.add_generation_prompt,
                               continue_final_message=request.continue_final_message,
                               chat_template=request.chat_template,
                               chat_template_kwargs=request.chat_template_kwargs,
                               tools=request.tools)
        else:
            text = request.prompt
        ids = self.encode(text, request.add_special_tokens)
        strs = None
        if request.return_token_strs:
            strs = list(self.tokenizer.convert_ids_to_tokens(ids))
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        self.check_token_ids(request.tokens, "tokens")
        try:
            text = self.tokenizer.decode(request.tokens)
        except (ValueError, OverflowError, TypeError) as e:
            raise OpenAIError(f"Could not detokenize: {e}", 400, "tokens") from e
        return DetokenizeResponse(prompt=text)


def anthropic_model(card: ModelCard) -> dict[str, Any]:
    """A model card in the Anthropic Models API's shape (``type``, ``id``, ``display_name``,
    ``created_at`` as RFC 3339)."""
    created = datetime.datetime.fromtimestamp(card.created, datetime.timezone.utc)
    return {"type": "model", "id": card.id, "display_name": card.id,
            "created_at": created.isoformat().replace("+00:00", "Z")}


def _wants_anthropic(raw_request: Request) -> bool:
    # the anthropic SDK sends this header on every call; OpenAI clients do not
    return "anthropic-version" in raw_request.headers


def build_models_router(models: OpenAIServingModels) -> APIRouter:
    """``GET /v1/models``: the served names and LoRA adapters; ``GET /v1/models/{id}``: one of them.
    A request with an ``anthropic-version`` header (the anthropic SDK's ``client.models``) gets
    the Anthropic Models API's shapes: ``{"data": [...], "has_more", "first_id", "last_id"}`` and
    an Anthropic error body for an unknown id."""
    router = APIRouter()

    @router.get("/v1/models")
    async def show_available_models(raw_request: Request):
        listing = models.show_available_models()
        if _wants_anthropic(raw_request):
            data = [anthropic_model(c) for c in listing.data]
            return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None})
        return JSONResponse(listing.model_dump(mode="json"))

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, raw_request: Request):
        """OpenAI's "retrieve model": the card of one served name or LoRA adapter; 404 otherwise."""
        for card in models.show_available_models().data:
            if card.id == model_id:
                if _wants_anthropic(raw_request):
                    return JSONResponse(anthropic_model(card))
                return JSONResponse(card.model_dump(mode="json"))
        message = f"The model `{model_id}` does not exist."
        if _wants_anthropic(raw_request):
            from pagedllm.entrypoints.openai.protocol_anthropic import anthropic_error_body
            return JSONResponse(anthropic_error_body(message, 404), status_code=404)
        raise OpenAIError(message, 404, "model")

    return router


def build_tokenization_router(serving: OpenAIServingTokenization) -> APIRouter:
    """``POST /tokenize`` (a prompt or chat messages) and ``POST /detokenize``."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: TokenizeBody):
        return JSONResponse(serving.tokenize(request).model_dump(mode="json", exclude_none=True))

    @router.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return JSONResponse(serving.detokenize(request).model_dump(mode="json"))

    return router
