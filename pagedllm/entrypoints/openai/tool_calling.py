"""Request-side tool calling, shared by Chat Completions, Responses and Messages: checks the
tools, ``tool_choice`` and the tool turns of the history (bad input is an ``OpenAIError`` 400
naming the field), and builds the JSON schema that constrains a forced call.

``tool_choice`` (OpenAI / vLLM): ``"none"`` (tools are shown to the template, no parsing),
``"auto"`` (the server's ``--tool-call-parser`` finds calls in free text), ``"required"`` (the
output is constrained to a non-empty JSON array of ``{"name", "parameters"}`` objects, vLLM's
schema) or ``{"type": "function", "function": {"name": N}}`` (the output is constrained to
N's parameters schema). Without ``tool_choice``, requests with tools mean ``"auto"`` (vLLM);
any choice but ``"none"`` without tools is a 400 (OpenAI, vLLM).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import OpenAIError

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

TOOL_CHOICE_WITHOUT_TOOLS_MESSAGE = "When using `tool_choice`, `tools` must be set."  # vLLM's

AUTO_TOOL_CHOICE_FLAGS_MESSAGE = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
    "(e.g. `pagedllm serve MODEL --enable-auto-tool-choice --tool-call-parser hermes`)")


def _check_schema(schema: Any, where: str) -> None:
    """Raises OpenAIError 400 if ``schema`` is not a valid JSON schema (its own ``$schema``
    draft, else 2020-12)."""
    import jsonschema
    from jsonschema.validators import validator_for

    if not isinstance(schema, dict):
        raise OpenAIError(f"`{where}` must be a JSON schema object, got "
                          f"{type(schema).__name__}.", 400, "tools")
    try:
        validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path)
        raise OpenAIError(f"`{where}` is not a valid JSON schema: {e.message}"
                          + (f" (at {path})" if path else ""), 400, "tools") from None
    except Exception as e:  # an unknown $schema URI, a broken $ref, ...
        raise OpenAIError(f"`{where}` is not a valid JSON schema: {e}", 400, "tools") from None


def validate_tools(tools: Optional[list[Any]], field: str = "tools") -> list[dict[str, Any]]:
    """Chat Completions tools as ``{"type": "function", "function": {"name", "description"?,
    "parameters"}}`` dicts (``parameters`` defaulted to an empty object schema).

    Raises:
        OpenAIError: 400 for a non-function tool, a missing/empty/duplicate name or parameters
            that are not a valid JSON schema.
    """
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, t in enumerate(tools or []):
        t = t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else t
        where = f"{field}[{i}]"
        if not isinstance(t, dict):
            raise OpenAIError(f"`{where}` must be an object.", 400, "tools")
        if t.get("type", "function") != "function":
            raise OpenAIError(f"`{where}.type` {t.get('type')!r} is not supported; only "
                              "\"function\" tools are.", 400, "tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise OpenAIError(f"`{where}.function` must be an object with a `name`.", 400,
                              "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError(f"`{where}.function.name` must be a non-empty string.", 400,
                              "tools")
        if name in seen:
            raise OpenAIError(f"`{where}.function.name` {name!r} is used by two tools.", 400,
                              "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None:
            _check_schema(params, f"{where}.function.parameters")
        fn = dict(fn)
        fn["parameters"] = params if params is not None else copy.deepcopy(EMPTY_PARAMETERS)
        out.append({"type": "function", "function": fn})
    return out


@dataclass
class ToolChoice:
    """A resolved ``tool_choice``: ``mode`` is "none", "auto", "required" or "named";
    ``name`` is the function of a named choice."""

    mode: str
    name: Optional[str] = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def resolve_tool_choice(tool_choice: Any, tools: list[dict[str, Any]], given: bool
                        ) -> ToolChoice:
    """The request's choice (``given``: whether the request set ``tool_choice``).

    Raises:
        OpenAIError: 400 (param "tool_choice") for a choice other than "none" without tools
            (``tools`` absent or empty), an unknown string, a malformed named
            choice or a name that is not among the tools.
    """
    if not given or tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if hasattr(tool_choice, "model_dump"):
        tool_choice = tool_choice.model_dump()
    if tool_choice == "none":
        return ToolChoice("none")
    if not tools:
        # OpenAI and vLLM: 400 for any other choice (a forced one would otherwise be plain text)
        raise OpenAIError(TOOL_CHOICE_WITHOUT_TOOLS_MESSAGE, 400, "tool_choice")
    if tool_choice in ("auto", "required"):
        return ToolChoice(tool_choice)
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    if not isinstance(tool_choice, dict):
        raise OpenAIError(f"Invalid value for `tool_choice`: {tool_choice!r}! Only named tools, "
                          '"none", "auto" or "required" are supported.', 400, "tool_choice")
    fn = tool_choice.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise OpenAIError(f"Invalid `tool_choice` {tool_choice!r}. {usage}", 400, "tool_choice")
    name = fn["name"]
    if name not in {t["function"]["name"] for t in tools}:
        raise OpenAIError(f"The tool {name!r} named in `tool_choice` is not one of the "
                          "request's `tools`.", 400, "tool_choice")
    return ToolChoice("named", name)


def _hoist_defs(params: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``params`` without its ``$defs`` / ``definitions`` (merged into ``defs``, so their
    ``#/$defs/...`` references resolve at the root of the combined schema)."""
    params = dict(params)
    for key in ("$defs", "definitions"):
        for name, schema in (params.pop(key, None) or {}).items():
            bucket = defs.setdefault(key, {})
            if name in bucket and bucket[name] != schema:
                raise OpenAIError(f"Tool definition {name!r} has multiple schemas, which is not "
                                  "supported with tool_choice \"required\".", 400, "tools")
            bucket[name] = schema
    return params


def required_tool_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of a ``tool_choice: "required"`` output (vLLM's): a non-empty array
    (at most one item without parallel calls) of ``{"name": <enum of one tool>,
    "parameters": <its parameters>}`` objects, one ``anyOf`` branch per tool."""
    defs: dict[str, Any] = {}
    branches = []
    for t in tools:
        fn = t["function"]
        branches.append({
            "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                           "parameters": _hoist_defs(fn.get("parameters") or EMPTY_PARAMETERS,
                                                     defs)},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def named_tool_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The JSON schema of a named-function output: that function's parameters."""
    for t in tools:
        if t["function"]["name"] == name:
            return t["function"].get("parameters") or copy.deepcopy(EMPTY_PARAMETERS)
    raise OpenAIError(f"The tool {name!r} is not one of the request's `tools`.", 400,
                      "tool_choice")


def forced_tool_schema(choice: ToolChoice, tools: list[dict[str, Any]], parallel: bool
                       ) -> Optional[dict[str, Any]]:
    """The schema constraining the output for a forced choice, None otherwise."""
    if choice.mode == "required":
        return required_tool_schema(tools, parallel)
    if choice.mode == "named":
        return named_tool_schema(tools, choice.name or "")
    return None


def constrain_to_json(sampling_params: Any, schema: Optional[dict[str, Any]], field: str,
                      json_object: bool = False, source: Optional[str] = None) -> None:
    """Constrain generation to ``schema`` (structured outputs: ``StructuredOutputsParams(json=
    schema)``), or to any JSON object with ``json_object``. A grammar that cannot be compiled
    later is a 400 naming ``source`` (default ``field``): the request field the schema came from
    (``tools`` for a forced tool choice), not ``structured_outputs``, which the request lacks.

    Raises:
        OpenAIError: 400 when this build has no structured outputs (never unconstrained
            output for a forced choice).
    """
    try:
        from pagedllm.sampling_params import StructuredOutputsParams  # type: ignore[attr-defined]
    except ImportError:
        raise OpenAIError(f"`{field}` needs structured outputs (constrained decoding), which "
                          "this pagedllm build does not support yet.", 400, field) from None
    try:
        params = (StructuredOutputsParams(json_object=True) if json_object
                  else StructuredOutputsParams(json=schema))
    except ValueError as e:
        raise OpenAIError(f"`{field}`: {e}", 400, field) from None
    params._source = source or field
    sampling_params.structured_outputs = params


def check_json_schema(schema: Any, where: str, param: str) -> None:
    """Raises OpenAIError 400 (``param``) if ``schema`` is not a valid JSON schema."""
    try:
        _check_schema(schema, where)
    except OpenAIError as e:
        raise OpenAIError(e.message, 400, param) from None


def prepare_tool_history(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``pagedllm.engine.chat.prepare_tool_history`` (which ``render_chat`` applies for the server
    and ``LLM.chat`` alike), its errors as OpenAIError 400 (param "messages")."""
    from pagedllm.engine.chat import prepare_tool_history as prepare

    try:
        return prepare(conv)
    except ValueError as e:
        raise OpenAIError(str(e), 400, "messages") from None
