"""``pagedllm serve`` checks that run BEFORE the model loads, so that a mistake is a one-line
error within a second instead of a traceback after the weights are read:

* the model: a path that does not exist, a file that is not GGUF, a directory without
  config.json, an unknown name, a Hub id that is not cached while the Hub cannot be reached;
* ``--chat-template``: unreadable file, or a template that does not compile;
* ``--max-model-len`` larger than the model's context length (read from the GGUF header or
  config.json, ``--hf-overrides`` applied);
* sizes: ``--gpu-memory-utilization`` outside (0, 1] (``--kv-cache-memory`` and the token
  counts are checked by their argparse types);
* parallelism: ``--data-parallel-backend ray`` beside ``--distributed-executor-backend mp``/``uni``, a
  Ray backend without Ray installed;
* the listening address: ``bind_listen_socket`` binds ``--host``/``--port`` up front.

Every check raises ``ValueError`` with the message to print after ``pagedllm serve: error:``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Optional


def _resolve_local_model(args: argparse.Namespace) -> Optional[str]:
    """The local file or directory ``args.model`` names (a path or a known name), the Hub
    snapshot path for a Hub id (cached, else downloaded: ``hub.resolve_hub_model`` fails fast
    when the Hub cannot be reached), or raises ValueError."""
    from pagedllm.loader.hub import parse_model_ref, resolve_hub_model
    from pagedllm.loader.resolve import resolve_model_path

    model = args.model
    try:
        return resolve_model_path(model)
    except ValueError:
        if os.path.exists(model) or parse_model_ref(model) is None:
            raise
    hub = resolve_hub_model(model, getattr(args, "revision", None), getattr(args, "download_dir", None),
                            getattr(args, "load_format", "auto") or "auto")
    return hub.path


def _context_length(path: str, args: argparse.Namespace) -> Optional[tuple[int, str]]:
    """(the model's context length, where it comes from), or None when it cannot be read
    cheaply (e.g. ``--hf-config-path``)."""
    overrides = getattr(args, "hf_overrides", None) or {}
    if "max_position_embeddings" in overrides:
        return int(overrides["max_position_embeddings"]), "--hf-overrides max_position_embeddings"
    if getattr(args, "hf_config_path", None):
        return None
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        from pagedllm.loader.gguf_file import GGUFFile

        gf = GGUFFile(path)
        try:
            n = gf.arch_get("context_length")
        finally:
            gf.close()
        return (int(n), f"{gf.architecture}.context_length of {os.path.basename(path)}") if n else None
    cfg_path = os.path.join(path, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        for c in (cfg, cfg.get("text_config") or {}):
            if isinstance(c, dict) and c.get("max_position_embeddings"):
                return int(c["max_position_embeddings"]), "max_position_embeddings in config.json"
    return None


def check_chat_template(value: Optional[str]) -> None:
    """``--chat-template``: a readable file or template text that compiles as Jinja.

    Raises:
        ValueError: the file cannot be read, or the template has a syntax error (line named).
    """
    if value is None:
        return
    from pagedllm.engine.chat import load_chat_template

    try:
        text = load_chat_template(value)
    except ValueError as e:
        raise ValueError(f"--chat-template: {value!r} is not a readable file (nor a Jinja template: it has no "
                         "'{' or newline)") from e
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        where = value if len(value) < 200 and os.path.isfile(value) else "the template"
        raise ValueError(f"--chat-template: {where} line {e.lineno}: {e.message}") from None


def check_sizes(args: argparse.Namespace) -> None:
    """Flag values that parse but cannot work.

    Raises:
        ValueError: ``--gpu-memory-utilization`` outside (0, 1].
    """
    gmu = getattr(args, "gpu_memory_utilization", None)
    if gmu is not None and not 0 < gmu <= 1:
        raise ValueError(f"--gpu-memory-utilization: must be in (0, 1], got {gmu}")


def check_parallel(args: argparse.Namespace) -> None:
    """Parallelism flags that contradict each other or need a missing package.

    Raises:
        ValueError: ``--data-parallel-backend ray`` (with ``--data-parallel-size`` > 1) beside an explicit
            ``--distributed-executor-backend`` other than ray (the replicas' ranks would silently become Ray
            actors anyway); Ray not installed for either Ray backend.
    """
    import importlib.util

    dp_ray = int(getattr(args, "data_parallel_size", 1) or 1) > 1 and getattr(args, "data_parallel_backend", "mp") == "ray"
    backend = getattr(args, "distributed_executor_backend", None)
    if dp_ray and backend not in (None, "ray"):
        raise ValueError(f"--data-parallel-backend ray runs every replica's ranks as Ray actors; "
                         f"--distributed-executor-backend {backend} contradicts it (drop it, or use "
                         f"--data-parallel-backend mp)")
    if (dp_ray or backend == "ray") and importlib.util.find_spec("ray") is None:
        flag = "--data-parallel-backend ray" if dp_ray else "--distributed-executor-backend ray"
        raise ValueError(f"{flag} needs Ray, which is not installed (pip install ray)")


def check_model(args: argparse.Namespace) -> None:
    """The model exists (resolving a Hub id, downloading it if needed, fails fast when the Hub
    cannot be reached) and ``--max-model-len`` fits its context length.

    Raises:
        ValueError: worded for ``pagedllm serve: error: <message>``.
    """
    path = _resolve_local_model(args)
    if os.path.isdir(path) and not getattr(args, "hf_config_path", None) \
            and not os.path.isfile(os.path.join(path, "config.json")):
        gguf = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        hint = f" (it holds {gguf[0]!r}: pass that file)" if gguf else ""
        raise ValueError(f"model {args.model!r}: the directory {path} has no config.json{hint}")
    if getattr(args, "mmproj", None):
        from pagedllm.loader.gguf_mmproj import check_mmproj_arg
        check_mmproj_arg(path, args.mmproj)
    mml = getattr(args, "max_model_len", None)
    if mml is not None:
        ctx = _context_length(path, args)
        if ctx is not None and mml > ctx[0]:
            raise ValueError(f"--max-model-len {mml} is larger than the model's context length {ctx[0]} "
                             f"({ctx[1]}); use --max-model-len {ctx[0]} or less")


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (SO_REUSEADDR, as uvicorn), not yet listening: uvicorn
    listens on it once the model is loaded (``uvicorn.Server.run(sockets=[sock])``).

    Raises:
        ValueError: the address is in use, not available here, or not permitted (the message
            names it and what to do).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    # NOTE: proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        import errno

        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"cannot listen on {host}:{port}: address already in use (another server is "
                             f"running there? pick another --port)") from None
        if e.errno == errno.EACCES:
            raise ValueError(f"cannot listen on {host}:{port}: permission denied (ports below 1024 need "
                             "root; pick another --port)") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock



def prepare_serve(args: argparse.Namespace) -> socket.socket:
    """Everything ``pagedllm serve`` checks before the model loads, in order: ``normalize_args``,
    the tool-call / reasoning parser flags, ``--lora-modules`` adapter configs, ``check_sizes``,
    ``check_parallel``, ``check_chat_template``, the listening socket (``bind_listen_socket``: an address in use
    fails at once), then ``check_model``.

    Returns:
        The bound socket, for ``run_server(args, sock)``.

    Raises:
        ValueError: the first mistake (the socket is closed then).
    """
    from pagedllm.entrypoints.openai.cli_args import normalize_args, resolve_parsers

    normalize_args(args)
    resolve_parsers(args)
    if getattr(args, "lora_modules", None):
        from pagedllm.lora.peft_loader import read_adapter_config

        for m in args.lora_modules:
            read_adapter_config(m.path, m.name)
    check_sizes(args)
    check_parallel(args)
    check_chat_template(getattr(args, "chat_template", None))
    sock = bind_listen_socket(getattr(args, "host", None) or "127.0.0.1", int(getattr(args, "port", 8000)))
    try:
        check_model(args)  # NOTE: after the bind: a Hub download may take long
    except BaseException:
        sock.close()
        raise
    return sock
