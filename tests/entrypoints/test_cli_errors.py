"""``pagedllm`` CLI: a user mistake is ONE line ``pagedllm <cmd>: error: ...`` and exit status 2
(argparse's own errors too), caught before the model loads; ``--max-model-len`` suffixes;
``--help=<group|keyword>``; every flag has a help line with its default (issue 31)."""
from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.cli_utils import human_readable_int, show_filtered_help

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> tuple[int, str, str, float]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout, p.stderr, time.perf_counter() - t0


def _one_line_error(args: tuple[str, ...], expected: str, env: dict | None = None) -> float:
    rc, out, err, secs = _cli(*args, env=env)
    assert rc == 2, (rc, out, err)
    # Python < 3.12.8 quotes argparse's "choose from" list ('a', 'b'), later ones do not.
    err = re.sub(r"\(choose from ([^)]*)\)", lambda m: "(choose from " + m.group(1).replace("'", "") + ")", err)
    assert err.splitlines() == [expected], err
    assert "Traceback" not in out + err
    return secs


# ----------------------------------------------------------------------------- suffix parser
@pytest.mark.parametrize("text,value", [
    ("4096", 4096), (" 4096 ", 4096), ("32k", 32_000), ("32K", 32_768), ("1m", 1_000_000), ("1M", 1_048_576),
    ("25.6k", 25_600), ("2g", 2_000_000_000), ("2G", 2 * 2**30), ("1t", 10**12), ("1T", 2**40), ("0", 0),
])
def test_human_readable_int(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text,msg", [
    ("2.5K", "decimals are not allowed with binary suffixes like 'K' in '2.5K'; did you mean 2.5k?"),
    ("abc", "expected an integer such as 4096, 32k (32,000) or 32K (32,768), got 'abc'"),
    ("32kb", "expected an integer such as 4096, 32k (32,000) or 32K (32,768), got '32kb'"),
])
def test_human_readable_int_rejects(text, msg):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        human_readable_int(text)
    assert str(e.value) == msg


def test_serve_parses_suffixed_lengths():
    sub = build_parser().subcommand_parsers["serve"]
    args = sub.parse_args(["--max-model-len", "32K", "--max-num-batched-tokens", "8k"])
    assert (args.max_model_len, args.max_num_batched_tokens) == (32_768, 8_000)
    bench = build_parser().subcommand_parsers["bench throughput"]
    assert bench.parse_args(["--max-model-len", "1k"]).max_model_len == 1000


# ----------------------------------------------------------------------------- argparse errors, one line
@pytest.mark.parametrize("args,expected", [
    (("serve", "--bogus"),
     "pagedllm serve: error: unrecognized arguments: --bogus (see 'pagedllm serve --help')"),
    (("serve", "--max-model-len", "abc"),
     "pagedllm serve: error: argument --max-model-len: expected an integer such as 4096, 32k (32,000) or 32K "
     "(32,768), got 'abc' (see 'pagedllm serve --help')"),
    (("serve", "--max-model-len", "0"),
     "pagedllm serve: error: argument --max-model-len: expected a positive integer, got '0' "
     "(see 'pagedllm serve --help')"),
    (("bench", "latency", "--input-len", "-1"),
     "pagedllm bench latency: error: argument --input-len: expected a positive integer, got '-1' "
     "(see 'pagedllm bench latency --help')"),
    (("bench", "throughput", "--num-prompts", "0"),
     "pagedllm bench throughput: error: argument --num-prompts: expected a positive integer, got '0' "
     "(see 'pagedllm bench throughput --help')"),
    (("serve", "--port", "70000"),
     "pagedllm serve: error: argument --port: expected a port number (1-65535), got 70000 "
     "(see 'pagedllm serve --help')"),
    (("serve", "--kv-cache-memory", "lots"),
     "pagedllm serve: error: argument --kv-cache-memory: invalid size 'lots' (expected e.g. 2GiB, 512MiB, "
     "1073741824) (see 'pagedllm serve --help')"),
    (("serve", "--dtype", "int3"),
     "pagedllm serve: error: argument --dtype: invalid choice: 'int3' (choose from auto, float32, bfloat16, "
     "float16, half, float, bf16, fp32, fp16) (see 'pagedllm serve --help')"),
    (("serve", "--allowed-origins", "*"),
     "pagedllm serve: error: argument --allowed-origins: invalid JSON '*': Expecting value: line 1 column 1 "
     "(char 0) (see 'pagedllm serve --help')"),
    (("chat", "--bogus"), "pagedllm chat: error: unrecognized arguments: --bogus (see 'pagedllm chat --help')"),
    (("complete", "--max-tokens", "x"),
     "pagedllm complete: error: argument --max-tokens: invalid int value: 'x' (see 'pagedllm complete --help')"),
    (("bench", "throughput", "--zzz"),
     "pagedllm bench throughput: error: unrecognized arguments: --zzz (see 'pagedllm bench throughput --help')"),
    (("frob",),
     "pagedllm: error: argument {serve,chat,complete,run,run-batch,bench,simulate,router,disagg-proxy}: invalid choice: 'frob' "
     "(choose from serve, chat, complete, run, run-batch, bench, simulate, router, disagg-proxy) (see 'pagedllm --help')"),
    # `pagedllm run` checks the server's flags before it starts anything (no "starting ..." line)
    (("run", "--bogus"), "pagedllm run: error: unrecognized arguments: --bogus (see 'pagedllm run --help' and "
     "'pagedllm serve --help')"),
    (("run", "SmolLM2-135M-Instruct", "--max-num-seqs", "0"),
     "pagedllm serve: error: argument --max-num-seqs: expected a positive integer, got '0' "
     "(see 'pagedllm serve --help')"),
    (("run-batch", "-i", "in.jsonl"),
     "pagedllm run-batch: error: the following arguments are required: -o/--output-file "
     "(see 'pagedllm run-batch --help')"),
])
def test_argparse_errors_are_one_line(args, expected):
    _one_line_error(args, expected)


def test_no_subcommand_prints_help_and_exits_0():
    rc, out, err, _ = _cli()  # as `vllm` and `ollama` with no arguments
    assert rc == 0, (rc, out, err)
    assert out.startswith("usage: pagedllm") and "serve" in out and err == ""


# ----------------------------------------------------------------------------- checked before the model loads
def test_missing_model_path(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    secs = _one_line_error(("serve", missing),
                           f"pagedllm serve: error: cannot resolve model {missing!r}: no such file or directory, and "
                           "not a known model name (known: SmolLM2-135M-Instruct, gemma-3-270m; installed: "
                           "SmolLM2-135M-Instruct, gemma-3-270m)")
    assert secs < 30  # no model load (a busy 2-core machine: the interpreter start alone takes seconds)


def test_directory_without_config(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    _one_line_error(("serve", str(tmp_path)),
                    f"pagedllm serve: error: model {str(tmp_path)!r}: the directory {tmp_path} has no config.json "
                    "(it holds 'm.gguf': pass that file)")


def test_bad_chat_template(tmp_path):
    _one_line_error(("serve", "--chat-template", str(tmp_path / "none.jinja")),
                    f"pagedllm serve: error: --chat-template: {str(tmp_path / 'none.jinja')!r} is not a readable "
                    "file (nor a Jinja template: it has no '{' or newline)")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n")
    _one_line_error(("serve", "--chat-template", str(bad)),
                    f"pagedllm serve: error: --chat-template: {bad} line 2: unexpected '}}'")


def test_max_model_len_over_context():
    # SmolLM2-135M-Instruct's GGUF says llama.context_length = 8192; 32k = 32,000.
    _one_line_error(("serve", "--max-model-len", "32k"),
                    "pagedllm serve: error: --max-model-len 32000 is larger than the model's context length 8192 "
                    "(llama.context_length of SmolLM2-135M-Instruct.Q4_1.gguf); use --max-model-len 8192 or less")


def test_bad_sizes():
    _one_line_error(("serve", "--kv-cache-memory", "0"),
                    "pagedllm serve: error: argument --kv-cache-memory: size must be positive, got '0' "
                    "(see 'pagedllm serve --help')")
    _one_line_error(("serve", "--gpu-memory-utilization", "1.5"),
                    "pagedllm serve: error: --gpu-memory-utilization: must be in (0, 1], got 1.5")


def test_contradicting_parallel_backends():
    _one_line_error(("serve", "-dp", "2", "--data-parallel-backend", "ray", "--distributed-executor-backend", "mp"),
                    "pagedllm serve: error: --data-parallel-backend ray runs every replica's ranks as Ray actors; "
                    "--distributed-executor-backend mp contradicts it (drop it, or use --data-parallel-backend mp)")


@pytest.mark.parametrize("flags,named", [
    (["-dp", "2", "--data-parallel-backend", "ray"], "--data-parallel-backend ray"),
    (["--distributed-executor-backend", "ray", "-tp", "2"], "--distributed-executor-backend ray"),
])
def test_ray_backend_without_ray(monkeypatch, flags, named):
    """Checked before the model loads (in process: Ray is installed here, so its absence is simulated)."""
    import importlib.util

    from pagedllm.entrypoints.openai.preflight import check_parallel

    args = build_parser().parse_args(["serve", *flags])
    if importlib.util.find_spec("ray") is not None:
        check_parallel(args)  # Ray is found: no error
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError) as e:
        check_parallel(args)
    assert str(e.value) == f"{named} needs Ray, which is not installed (pip install ray)"
    # Without a Ray backend nothing is asked of Ray.
    check_parallel(build_parser().parse_args(["serve", "-dp", "2", "-tp", "2"]))


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        secs = _one_line_error(("serve", "--port", str(port)),
                               f"pagedllm serve: error: cannot listen on 127.0.0.1:{port}: address already in use "
                               "(another server is running there? pick another --port)")
    assert secs < 30


def test_unreachable_hub_fails_fast(tmp_path):
    # No network here; a closed local port stands in for an unreachable Hub either way.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    cache = str(tmp_path / "hub")
    env = {"HF_HUB_CACHE": cache, "HF_ENDPOINT": f"http://127.0.0.1:{dead}", "HF_HUB_OFFLINE": ""}
    rc, out, err, secs = _cli("serve", "someorg/some-model", env=env)
    assert rc == 2, err
    assert err.splitlines() == [
        f"pagedllm serve: error: model 'someorg/some-model' is not in the Hugging Face cache ({cache}) and the Hub "
        f"(http://127.0.0.1:{dead}) cannot be reached (Connection refused). Connect to the network, or set "
        "HF_HUB_OFFLINE=1 to use only the cache (--download-dir or HF_HUB_CACHE names another one), or pass a "
        "local path: a .gguf file or a model directory with config.json"]
    # The check itself: in-process, no interpreter start-up; a name that cannot be looked up too.
    from pagedllm.loader.hub import check_hub_reachable

    for endpoint in (f"http://127.0.0.1:{dead}", "https://no-such-host.invalid"):
        os.environ["HF_ENDPOINT"] = endpoint
        try:
            t0 = time.perf_counter()
            with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1"):
                check_hub_reachable("someorg/some-model", cache)
            assert time.perf_counter() - t0 < 5
        finally:
            del os.environ["HF_ENDPOINT"]


def test_offline_hub_names_cache(tmp_path):
    cache = str(tmp_path / "hub")
    _one_line_error(("serve", "someorg/some-model"),
                    f"pagedllm serve: error: model 'someorg/some-model': repository 'someorg/some-model' is not in "
                    f"the Hugging Face cache {cache}, and HF_HUB_OFFLINE is set (no download)",
                    env={"HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"})


# ----------------------------------------------------------------------------- help
def _help(*args: str) -> tuple[int, str]:
    rc, out, err, _ = _cli(*args)
    return rc, out


def test_help_listgroup_and_group():
    rc, out = _help("serve", "--help=listgroup")
    assert rc == 0
    groups = [ln.strip()[2:] for ln in out.splitlines() if ln.startswith("  - ")]
    assert groups == ["options", "Server", "CORS", "Tool calling and reasoning", "Model", "Structured outputs",
                      "Speculative decoding", "LoRA adapters", "Scheduler and KV cache", "KV cache tiers",
                      "Observability", "Parallelism",
                      "Device"]
    rc, out = _help("serve", "--help=cors")
    assert rc == 0
    flags = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  --")]
    assert flags == ["--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials"]


def test_help_keyword():
    parser = build_parser().subcommand_parsers["serve"]
    import io

    buf = io.StringIO()
    assert show_filtered_help(parser, "max-num", buf) == 0
    flags = [ln.split()[0] for ln in buf.getvalue().splitlines() if ln.startswith("  --")]
    assert flags == ["--max-num-seqs", "--max-num-batched-tokens"]
    rc, out = _help("serve", "--help=nothing-like-this")
    assert rc == 1
    assert out.strip() == ("pagedllm serve: no flag group or flag matching 'nothing-like-this' "
                           "(`pagedllm serve --help=listgroup` lists the groups)")


def test_every_flag_has_help_and_default():
    parser = build_parser()
    missing = []
    for name, sub in parser.subcommand_parsers.items():
        fmt = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = fmt._get_help_string(action) if action.help else ""
            if not text.strip() or (action.option_strings and "default" not in text.lower()):
                missing.append(f"{name} {action.option_strings or action.dest}")
    assert missing == []
    help_text = parser.subcommand_parsers["serve"].format_help()
    assert "(default: 128)" in help_text  # --max-num-seqs: "Max requests scheduled in one step (default: 128)."


def test_bench_serve_without_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, out, err, _ = _cli("bench", "serve", "--port", str(port), "--num-prompts", "1")
    assert rc == 1
    assert err.splitlines() == [
        f"pagedllm bench serve: error: cannot reach the server at http://127.0.0.1:{port} (All connection attempts "
        "failed); start one with 'pagedllm serve' or pass --base-url / --host / --port"]


def test_kv_tier_flag_errors():
    _one_line_error(("serve", "--kv-transfer-config", '{"kv_connector": "Nope"}'),
                    "pagedllm serve: error: kv_transfer_config.kv_connector: unknown connector 'Nope'; "
                    "registered: ['OffloadingConnector', 'P2pConnector']")
    _one_line_error(("serve", "--kv-offloading-size", "0"),
                    "pagedllm serve: error: argument --kv-offloading-size: expected a positive number, got '0' "
                    "(see 'pagedllm serve --help')")
    _one_line_error(("serve", "--kv-offloading-size", "1", "--no-enable-prefix-caching"),
                    "pagedllm serve: error: kv_transfer_config: needs prefix caching (blocks are addressed by "
                    "their prefix-cache hash); drop --no-enable-prefix-caching")


def test_engine_arg_flags_take_engine_args_defaults():
    """Flags generated from ``EngineArgs`` fields (``cli_args.add_engine_args``): the default is
    the dataclass field's, the help's ``%(default)s`` renders it, aliases and types still work."""
    import dataclasses

    from pagedllm.config import EngineArgs
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    p = make_arg_parser()
    ns = p.parse_args(["m"])
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    generated = ["max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_dtype", "enable_prefix_caching",
                 "prefix_caching_hash_algo", "scheduling_policy", "tensor_parallel_size", "pipeline_parallel_size",
                 "data_parallel_size", "distributed_executor_backend", "structured_outputs_config", "speculative_config",
                 "kv_events_config"]
    assert {k: getattr(ns, k) for k in generated} == {k: defaults[k] for k in generated}
    text = p.format_help()
    assert "Max requests scheduled in one step (default: 128)." in text
    assert "Hash of prefix-cache blocks (default: sha256)." in text
    ns = p.parse_args(["m", "-tp", "2", "--max-num-batched-tokens", "4k", "--no-enable-prefix-caching"])  # k = 1000
    assert (ns.tensor_parallel_size, ns.max_num_batched_tokens, ns.enable_prefix_caching) == (2, 4000, False)


def test_flag_parsing_does_not_import_torch():
    """Building the parser and a flag error stay light (no torch): ``--quantization``'s choices are
    the built-in names until the quantization registry is imported, and those are exactly what the
    registry holds once it is."""
    code = ("import sys\n"
            "from pagedllm.config import QUANTIZATION_CHOICES\n"
            "from pagedllm.entrypoints.cli import build_parser\n"
            "p = build_parser().subcommand_parsers['serve']\n"
            "before = list(QUANTIZATION_CHOICES)\n"
            "assert p.parse_args(['m', '--quantization', 'int8']).quantization == 'int8'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "from pagedllm.quantization.base import registered_methods\n"
            "assert before == [*registered_methods(), 'none'] == list(QUANTIZATION_CHOICES), before\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr


def test_bench_input_range_and_vllm_flags(capsys):
    """`bench throughput` with --input-len-min > --input-len-max is one line naming both (it said
    "empty range for randrange()"); vLLM's `--input-len` (throughput) and `--num-iters-warmup`
    (latency) parse."""
    from pagedllm.entrypoints.cli import build_parser, main

    assert main(["bench", "throughput", "SmolLM2-135M-Instruct", "--input-len-min", "64",
                 "--input-len-max", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pagedllm bench throughput: error: --input-len-min (64) is larger than --input-len-max (16)"]
    p = build_parser()
    a = p.parse_args(["bench", "throughput", "m", "--input-len", "16"])
    assert a.input_len == 16
    a = p.parse_args(["bench", "latency", "m", "--num-iters-warmup", "2"])
    assert a.num_iters_warmup == 2
