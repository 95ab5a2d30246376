"""GET /v1/models, POST /tokenize, POST /detokenize."""
from __future__ import annotations

from typing import Annotated, Any, Union

from fastapi import APIRouter
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


def build_models_router(models: OpenAIServingModels) -> APIRouter:
    """``GET /v1/models``: the served names and LoRA adapters; ``GET /v1/models/{id}``: one of them."""
    router = APIRouter()

    @router.get("/v1/models")
    async def show_available_models():
        return JSONResponse(models.show_available_models().model_dump(mode="json"))

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        """OpenAI's "retrieve model": the card of one served name or LoRA adapter; 404 otherwise."""
        for card in models.show_available_models().data:
            if card.id == model_id:
                return JSONResponse(card.model_dump(mode="json"))
        raise OpenAIError(f"The model `{model_id}` does not exist.", 404, "model")

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
