"""OpenTelemetry request spans (--otlp-traces-endpoint) through the server on a tiny random model:
the engine's real BatchSpanProcessor path with an in-process InMemorySpanExporter in place of the
OTLP exporter; vLLM's attribute names and values; an incoming ``traceparent`` is the parent."""
from __future__ import annotations

import sys

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from obs_helpers import TINY_KW
import pagedllm.tracing as tracing
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_one_span_per_request_with_vllm_attributes(tiny_model, monkeypatch):
    exporter = InMemorySpanExporter()
    seen = []
    monkeypatch.setattr(tracing, "get_span_exporter", lambda endpoint: (seen.append(endpoint), exporter)[1])
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model, otlp_traces_endpoint="localhost:4317",
                                                  served_model_name="tiny", **TINY_KW))
    assert seen == ["localhost:4317"]
    try:
        with TestClient(build_app(engine)) as client:
            r1 = client.post("/v1/completions", json={
                "prompt": [5, 17, 3, 88, 42], "max_tokens": 6, "temperature": 0.5, "top_p": 0.9,
                "ignore_eos": True}, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            r2 = client.post("/v1/completions", json={"prompt": [9, 8, 7], "max_tokens": 3,
                                                      "ignore_eos": True})
        assert r1.status_code == 200 and r2.status_code == 200
        engine.engine.tracer._pagedllm_provider.force_flush()
        spans = exporter.get_finished_spans()
    finally:
        engine.shutdown()
    assert len(spans) == 2
    by_id = {s.attributes["gen_ai.request.id"]: s for s in spans}
    s1 = by_id[r1.json()["id"] + "-0"]
    s2 = by_id[r2.json()["id"] + "-0"]
    for s, r, max_tokens in ((s1, r1.json(), 6), (s2, r2.json(), 3)):
        a = s.attributes
        assert s.name == "llm_request" and s.kind == SpanKind.SERVER
        assert a["gen_ai.response.model"] == "tiny"
        assert a["gen_ai.usage.prompt_tokens"] == r["usage"]["prompt_tokens"]
        assert a["gen_ai.usage.completion_tokens"] == r["usage"]["completion_tokens"] == max_tokens
        assert a["gen_ai.request.max_tokens"] == max_tokens and a["gen_ai.request.n"] == 1
        assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
        e2e = a["gen_ai.latency.e2e"]
        assert abs((s.end_time - s.start_time) / 1e9 - e2e) < 1e-5  # the span covers arrival..finish
        q, ttft = a["gen_ai.latency.time_in_queue"], a["gen_ai.latency.time_to_first_token"]
        assert 0 <= q <= ttft <= e2e
        assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(ttft - q, abs=1e-6)
        assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(e2e - ttft, abs=1e-6)
        assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(e2e - q, abs=1e-6)
    assert s1.attributes["gen_ai.request.temperature"] == 0.5
    assert s1.attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    # traceparent: same trace, the client's span as remote parent; without it a new root trace.
    assert s1.context.trace_id == int(TRACE_ID, 16)
    assert s1.parent is not None and s1.parent.span_id == int(PARENT_ID, 16) and s1.parent.is_remote
    assert s2.parent is None and s2.context.trace_id != int(TRACE_ID, 16)


def test_missing_sdk_is_a_clear_startup_error(monkeypatch):
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser, normalize_args

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails
    with pytest.raises(ValueError, match="OpenTelemetry is not installed"):
        tracing.init_tracer("localhost:4317")
    args = make_arg_parser().parse_args(["--otlp-traces-endpoint", "localhost:4317"])
    with pytest.raises(ValueError, match="--otlp-traces-endpoint: OpenTelemetry is not installed"):
        normalize_args(args)
    assert normalize_args(make_arg_parser().parse_args([])).otlp_traces_endpoint is None  # serving without it


def test_unknown_protocol(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="unsupported OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        tracing.get_span_exporter("localhost:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    assert isinstance(tracing.get_span_exporter("http://127.0.0.1:4318/v1/traces"), OTLPSpanExporter)


def test_real_otlp_http_export(tiny_model, monkeypatch):
    """The real OTLP/HTTP exporter (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf) posting to an
    in-process collector: the protobuf body decodes to one ``llm_request`` span per request."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    bodies: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    from pagedllm import LLM, SamplingParams
    llm = LLM(tiny_model, otlp_traces_endpoint=f"http://127.0.0.1:{srv.server_address[1]}/v1/traces", **TINY_KW)
    try:
        outs = llm.generate([{"prompt_token_ids": [5, 17, 3]}, {"prompt_token_ids": [9, 8]}],
                            SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()  # flushes the batch
        srv.shutdown()
    spans = []
    for body in bodies:
        req = ExportTraceServiceRequest.FromString(body)
        spans += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert sorted(s.name for s in spans) == ["llm_request", "llm_request"]
    ids = set()
    for s in spans:
        attrs = {a.key: a.value for a in s.attributes}
        ids.add(attrs["gen_ai.request.id"].string_value)
        assert attrs["gen_ai.usage.completion_tokens"].int_value == 4
    assert ids == {o.request_id for o in outs}
