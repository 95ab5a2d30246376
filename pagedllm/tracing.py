"""OpenTelemetry request tracing (vLLM's ``--otlp-traces-endpoint``; ``vllm.tracing``).

With an endpoint, the engine exports one span per request (name ``llm_request``, kind SERVER,
from the request's arrival to its finish) to an OTLP collector, with vLLM's attribute names
(``SpanAttributes``): ``gen_ai.request.id``, ``gen_ai.response.model``, the request's
``gen_ai.request.max_tokens`` / ``temperature`` / ``top_p`` / ``n``, ``gen_ai.usage.prompt_tokens``
/ ``completion_tokens``, and the latencies in seconds: ``gen_ai.latency.time_in_queue`` (arrival to
first scheduled), ``time_to_first_token`` (arrival to first output token), ``e2e`` (arrival to
finish), ``time_in_model_prefill`` (first scheduled to first token), ``time_in_model_decode``
(first token to finish) and ``time_in_model_inference`` (first scheduled to finish). A request
whose HTTP headers carry W3C trace context (``traceparent``, ``tracestate``) gets its span as a
child of that remote span (same trace id).

The protocol follows ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` as vLLM does: "grpc" (the default:
``opentelemetry-exporter-otlp-proto-grpc``, endpoint ``host:4317``) or "http/protobuf"
(``opentelemetry-exporter-otlp-proto-http``, endpoint ``http://host:4318/v1/traces``). Spans are
exported in batches by the SDK's ``BatchSpanProcessor`` (its queue holds at most 2048 spans;
beyond that the SDK drops them). The ``opentelemetry`` packages are imported only when an
endpoint is given; without them ``init_tracer`` raises a ValueError saying what to install.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

#: The W3C trace-context headers passed from the HTTP request to the request's span.
TRACE_HEADERS = ("traceparent", "tracestate")
#: Name of the instrumentation scope (vLLM: "vllm.llm_engine").
INSTRUMENTING_MODULE = "pagedllm.llm_engine"
SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's span attribute names (``vllm.tracing.SpanAttributes``; the OpenTelemetry GenAI
    semantic conventions where they exist)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def is_otel_available() -> bool:
    """True when the OpenTelemetry SDK can be imported."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def extract_trace_headers(headers: Mapping[str, str]) -> Optional[dict]:
    """The trace-context headers present in ``headers`` (case-insensitive mapping such as
    Starlette's), or None when there are none."""
    out = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return out or None


def get_span_exporter(endpoint: str) -> Any:
    """The OTLP span exporter for ``endpoint`` and ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``.

    Raises:
        ValueError: an unknown protocol, or its exporter package is not installed.
    """
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            pkg = "opentelemetry-exporter-otlp-proto-grpc"
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            pkg = "opentelemetry-exporter-otlp-proto-http"
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore
        else:
            raise ValueError(f"otlp_traces_endpoint: unsupported OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r} "
                             "(expected 'grpc' or 'http/protobuf')")
    except ImportError as e:
        raise ValueError(f"otlp_traces_endpoint: the {protocol} OTLP exporter is not installed "
                         f"(pip install {pkg}, or set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL to the other "
                         f"protocol): {e}") from None
    return OTLPSpanExporter(endpoint=endpoint)


def init_tracer(endpoint: Optional[str], span_exporter: Any = None) -> Any:
    """A tracer exporting to ``endpoint`` over OTLP (batched), or to ``span_exporter`` when given
    (every span exported when it ends; tests pass an ``InMemorySpanExporter``).

    The tracer's provider is private to the engine (the process-wide provider is not replaced).

    Raises:
        ValueError: the OpenTelemetry SDK or the exporter is missing (the message says what to
            install), or an unknown protocol.
    """
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as e:
        raise ValueError("otlp_traces_endpoint: OpenTelemetry is not installed (pip install opentelemetry-sdk "
                         f"opentelemetry-exporter-otlp-proto-grpc, or pip install 'pagedllm[tracing]'): {e}") from None
    provider = TracerProvider()
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(get_span_exporter(endpoint)))
    tracer = provider.get_tracer(INSTRUMENTING_MODULE)
    tracer._pagedllm_provider = provider  # for shutdown (flushes the batch)
    return tracer


def shutdown_tracer(tracer: Any) -> None:
    """Flush and stop the tracer's provider (idempotent)."""
    provider = getattr(tracer, "_pagedllm_provider", None)
    if provider is not None:
        tracer._pagedllm_provider = None
        provider.shutdown()


def record_request_span(tracer: Any, *, request_id: str, model: str, trace_headers: Optional[dict],
                        sampling_params: Any, arrival_time: float, first_scheduled_time: Optional[float],
                        first_token_time: Optional[float], finish_time: float, num_prompt_tokens: int,
                        num_generation_tokens: int, finish_reason: Optional[str] = None) -> None:
    """Export one finished request's span (see the module docstring).

    Args:
        tracer: from ``init_tracer``.
        request_id: the engine's request id (``gen_ai.request.id``).
        model: the served model name (``gen_ai.response.model``).
        trace_headers: the request's ``traceparent`` / ``tracestate`` (None = a new trace).
        sampling_params: its SamplingParams (None for pooling: no sampling attributes).
        arrival_time / first_scheduled_time / first_token_time / finish_time: ``time.time()``
            seconds (None: never scheduled / no token; the latencies then count as 0).
        num_prompt_tokens / num_generation_tokens: token counts.
        finish_reason: "stop" / "length" / "abort" (attribute ``gen_ai.response.finish_reasons``).
    """
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract(trace_headers) if trace_headers else None
    A = SpanAttributes
    sched = first_scheduled_time if first_scheduled_time is not None else finish_time
    first = first_token_time if first_token_time is not None else finish_time
    attrs: dict[str, Any] = {
        A.GEN_AI_REQUEST_ID: request_id,
        A.GEN_AI_RESPONSE_MODEL: model,
        A.GEN_AI_USAGE_PROMPT_TOKENS: int(num_prompt_tokens),
        A.GEN_AI_USAGE_COMPLETION_TOKENS: int(num_generation_tokens),
        A.GEN_AI_LATENCY_TIME_IN_QUEUE: max(0.0, sched - arrival_time),
        A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: max(0.0, first - arrival_time),
        A.GEN_AI_LATENCY_E2E: max(0.0, finish_time - arrival_time),
        A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: max(0.0, first - sched),
        A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: max(0.0, finish_time - first),
        A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: max(0.0, finish_time - sched),
    }
    sp = sampling_params
    if sp is not None:
        attrs[A.GEN_AI_REQUEST_N] = int(getattr(sp, "n", 1) or 1)
        for key, name in ((A.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens"), (A.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
                          (A.GEN_AI_REQUEST_TOP_P, "top_p")):
            v = getattr(sp, name, None)
            if v is not None:
                attrs[key] = v
    if finish_reason is not None:
        attrs["gen_ai.response.finish_reasons"] = [str(finish_reason)]
    span = tracer.start_span(SPAN_NAME, context=ctx, kind=SpanKind.SERVER, attributes=attrs,
                             start_time=int(arrival_time * 1e9))
    span.end(end_time=int(finish_time * 1e9))
