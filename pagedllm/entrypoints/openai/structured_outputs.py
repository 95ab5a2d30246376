"""Request fields -> ``StructuredOutputsParams``: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` and older ``guided_*`` extra fields."""
from __future__ import annotations

from typing import Any, Optional

from pagedllm.structured_output.params import (BACKEND_NAMES, CONSTRAINT_KINDS,
                                               StructuredOutputsParams)

# vLLM's guided_* fields -> StructuredOutputsParams constraint fields.
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"), ("structural_tag", "structural_tag"))
# Options vLLM accepted after the backend name ("xgrammar:disable-any-whitespace").
_BACKEND_OPTIONS = {"disable-any-whitespace": "disable_any_whitespace",
                    "no-additional-properties": "disable_additional_properties"}


def structured_outputs_from_request(req: Any) -> Optional[StructuredOutputsParams]:
    """The request's constraint, or None when it asks for none.

    Sources, as vLLM: ``structured_outputs`` (an object with vLLM's fields), the older
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` /
    ``structural_tag`` / ``guided_whitespace_pattern``, and ``response_format``
    (``json_object``, ``json_schema`` with ``json_schema.schema``, ``structural_tag``;
    ``text`` asks for nothing). Options (``disable_any_whitespace``, ...) may come from one
    source and the constraint from another; two constraints are refused.
    ``guided_decoding_backend`` picks the backend for this request.

    Raises:
        ValueError: naming the request field: two constraints, a malformed one (empty choice
            list, schema that is not an object, ...), an unknown backend or option.
    """
    fields: dict[str, Any] = {}
    source: dict[str, str] = {}  # constraint kind -> request field it came from

    def put(kind: str, value: Any, field_name: str) -> None:
        if value is None:
            return
        others = [source[k] for k in CONSTRAINT_KINDS if k in source]
        if others:
            raise ValueError(f"{field_name}: only one structured-output constraint per request, but "
                             f"{others[0]} is also set")
        fields[kind] = value
        source[kind] = field_name

    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise ValueError("structured_outputs: must be an object")
        for k, v in so.items():
            if k in CONSTRAINT_KINDS:
                put(k, v, f"structured_outputs.{k}")
            else:
                fields[k] = v
    for name, kind in _GUIDED:
        put(kind, getattr(req, name, None), name)
    ws = getattr(req, "guided_whitespace_pattern", None)
    if ws is not None:
        fields["whitespace_pattern"] = ws
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            put("json_object", True, "response_format")
        elif rf.type == "json_schema":
            js = rf.json_schema
            if js is None or js.schema_ is None:
                raise ValueError("response_format: type 'json_schema' needs `json_schema` with a `schema` "
                                 "(the JSON schema the output must follow)")
            put("json", js.schema_, "response_format")
        elif rf.type == "structural_tag":
            put("structural_tag", rf.model_dump(exclude_none=True), "response_format")
    if not fields:
        return None
    backend = getattr(req, "guided_decoding_backend", None)
    if backend is not None:
        name, _, opts = str(backend).partition(":")
        if name not in BACKEND_NAMES:
            raise ValueError(f"guided_decoding_backend: must be one of {list(BACKEND_NAMES)}, got {name!r}")
        for opt in filter(None, opts.split(",")):
            if opt not in _BACKEND_OPTIONS:
                raise ValueError(f"guided_decoding_backend: unknown option {opt!r} (known: "
                                 f"{sorted(_BACKEND_OPTIONS)})")
            fields[_BACKEND_OPTIONS[opt]] = True
    try:
        params = StructuredOutputsParams.from_dict(fields)
    except ValueError as e:
        msg = str(e)
        for kind, src in source.items():
            msg = msg.replace(f"structured_outputs.{kind}", src, 1)
        raise ValueError(msg) from None
    params._source = source[params.kind]
    if backend is not None:
        params._backend = name
    return params
