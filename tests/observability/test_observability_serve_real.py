"""``pagedllm serve`` (a real process) on SmolLM2 with every flag of this feature at once:
--scheduling-policy priority, --enable-log-requests/--enable-log-outputs, --otlp-traces-endpoint
(OTLP/HTTP to an in-process collector) and --kv-events-config (a real ZMQ SUB socket)."""
from __future__ import annotations

import http.server
import json
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from server_helpers import free_port, serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def test_serve_with_priority_logs_traces_and_kv_events(monkeypatch):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    bodies: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    col = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=col.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    kv_port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{kv_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    prompt = ("The history of the Roman empire begins with the founding of the city of Rome in 753 BC, "
              "according to the legend of the twin brothers Romulus and Remus, who")
    try:
        with serve([MODEL, "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                    "--disable-log-stats", "--scheduling-policy", "priority", "--enable-log-requests",
                    "--enable-log-outputs", "--otlp-traces-endpoint",
                    f"http://127.0.0.1:{col.server_address[1]}/v1/traces",
                    "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "topic": "kv",
                                                      "endpoint": f"tcp://*:{kv_port}"})]) as (base, proc):
            # The PUB drops messages until our subscription arrives: reset until one comes through.
            deadline = time.time() + 30
            while not sub.poll(100):
                assert httpx.post(base + "/reset_prefix_cache").status_code == 200
                assert time.time() < deadline
            while sub.poll(200):
                sub.recv_multipart()
            r = httpx.post(base + "/v1/completions", timeout=60, headers={
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
                json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "priority": -3})
            assert r.status_code == 200, r.text
            body = r.json()
            frames = []
            while sub.poll(1000):
                frames.append(sub.recv_multipart())
            proc.terminate()
            out = proc.communicate(timeout=60)[0]
    finally:
        sub.close(linger=0)
        col.shutdown()
    assert proc.returncode == 0, out[-3000:]
    # Logs: the request and its output (the text the client got).
    assert f"Received request {body['id']}-0: prompt: {prompt!r}" in out
    assert f"output: {body['choices'][0]['text']!r}" in out
    # KV events: the prompt's full 16-token blocks were stored (vLLM's wire format).
    events = [e for f in frames for e in msgspec.msgpack.decode(f[2])[1]]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored and stored[0]["block_size"] == 16 and stored[0]["parent_block_hash"] is None
    n_prompt = body["usage"]["prompt_tokens"]
    assert n_prompt >= 32
    assert sum(len(e["token_ids"]) for e in stored) == 16 * ((n_prompt + 5) // 16)  # full blocks by the end
    # Trace: one span, child of the client's span, with the response's token counts.
    spans = [s for b in bodies for rs in ExportTraceServiceRequest.FromString(b).resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    assert len(spans) == 1 and spans[0].name == "llm_request"
    assert spans[0].trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert spans[0].parent_span_id.hex() == "00f067aa0ba902b7"
    attrs = {a.key: a.value for a in spans[0].attributes}
    assert attrs["gen_ai.usage.prompt_tokens"].int_value == n_prompt
    assert attrs["gen_ai.usage.completion_tokens"].int_value == body["usage"]["completion_tokens"]
