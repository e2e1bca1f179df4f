"""``osd serve``: load the pair, bind the port, and run the app of :mod:`osd.server.app`
under uvicorn with the HTTP limits of :mod:`osd.server.limits`.

``osd.cli`` imports this module only when ``osd serve`` runs, so ``osd --help`` and the
CLI's other commands do not pay for uvicorn and fastapi.
"""

import os
import socket

import torch
import uvicorn

import osd
from osd import zoo
from osd.models.quant import own_quant_layers
from osd.server.app import build_app
from osd.cli.serve_options import kv_dtype, quantized_mode
from osd.server.limits import Limits, limit_logs, uvicorn_config
from osd.spec import describe


def serve(args) -> int:
    """``osd serve``: load the pair, then run uvicorn until interrupted.

    The port is bound before the (slow) model load, so a busy port fails at once with one
    error line."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype
    ]
    target, draft, name = args.target, args.draft, args.model_name
    if target is None:
        # The chat pair when its target is already cached (never download at start-up),
        # else the built-in pair shipped with the package.
        if zoo.chat.cached_target() is not None:
            target, chat_draft = zoo.chat_pair()
            name = name or "SmolLM2-135M-Instruct"
        else:
            target, chat_draft = zoo.default_pair()
            name = name or "osd-zoo"
        draft = None if args.no_draft else (draft or chat_draft)
    # Otherwise the target's file or directory name, without ".gguf".
    name = name or os.path.basename(os.path.normpath(str(target))).removesuffix(".gguf")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    # No speculation flag with a draft: spec=None lets from_pretrained take the draft's
    # recommended settings (its serving.json; the chat drafts carry one) or a chain of 4.
    flags = [getattr(args, f, None) for f in ("k", "lookup_tokens", "lookup_tree_below")]
    spec = None
    if args.prompt_lookup or (
        draft is not None
        and (
            any(f is not None for f in flags)
            or getattr(args, "auto_k", False)
            or getattr(args, "lookup_history", 0)
        )
    ):
        k = 4 if args.k is None else args.k
        lookup_tokens = getattr(args, "lookup_tokens", None) or 0
        # Without a draft model the n-gram drafter is the lookup: its chains are lookup's.
        spec = osd.SpecConfig(
            num_draft_tokens=k if draft is not None else lookup_tokens or k,
            drafter="model" if draft is not None else "ngram",
            prompt_lookup=args.prompt_lookup and draft is not None,
            lookup_tokens=lookup_tokens if draft is not None else 0,
            lookup_history=getattr(args, "lookup_history", 0) if args.prompt_lookup else 0,
            lookup_tree_below=getattr(args, "lookup_tree_below", None) or 0
            if args.prompt_lookup and draft is not None
            else 0,
            auto_k=getattr(args, "auto_k", False),
        )
    if args.online and draft is None:
        raise ValueError("--online needs a draft model to learn (--draft)")
    limits = limits_from_args(args)
    stream_interval = stream_interval_s(args)
    online = osd.OnlineConfig() if args.online else None
    threads = torch_threads(args, online is not None)
    if threads:
        torch.set_num_threads(threads)
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only when
    # the listening socket's protocol is TCP; without it a stream's first event waits for
    # the client's delayed ACK on a kept-alive connection.
    sock = socket.socket(
        socket.AF_INET6 if ":" in args.host else socket.AF_INET,
        socket.SOCK_STREAM,
        socket.IPPROTO_TCP,
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    try:
        ae = osd.AsyncEngine.from_pretrained(
            target,
            draft=draft,
            stream_interval=stream_interval,
            device=args.device,
            dtype=dtype,
            spec=spec,
            online=online,
            max_batch_size=args.max_batch_size,
            max_seq_len=args.max_seq_len,
            quantized=quantized_mode(args),
            kv_dtype=kv_dtype(args),
            prefix_cache=getattr(args, "prefix_cache", 0),
            quantize_draft=getattr(args, "quantize_draft", None),
        )
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(ae, name, limits)
        print(
            f"osd serve: {name} (target {target}, draft {draft or 'none'}) on "
            f"http://{args.host}:{args.port}/v1",
            flush=True,
        )
        if limits.api_key is None and args.host not in ("127.0.0.1", "::1", "localhost"):
            print(
                f"osd serve: warning: {args.host} is reachable from other machines and no "
                "API key is set (--api-key or OSD_API_KEY)",
                flush=True,
            )
        if ae.engine.spec is not None:
            drafts = ae.engine.drafts
            formats = {m.fmt for d in drafts for m in own_quant_layers(d).values()}
            kept = f"; draft in {', '.join(sorted(formats)) or 'float'}" if drafts else ""
            print(f"osd serve: speculation {describe(ae.engine.spec)}{kept}", flush=True)
        config = uvicorn_config(app, limits, log_level=args.log_level)
        limit_logs()
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its clean shutdown
            pass
    finally:
        ae.close()
        sock.close()
    return 0


def torch_threads(args, online: bool, cores: int | None = None) -> int | None:
    """torch's intra-op threads for ``osd serve``: ``--threads`` when given; with
    ``--online`` on the CPU, half the cores (at least 1), since torch's thread count is
    the process's and the learner's training runs on as many threads as serving: at all
    the cores each, the two contend for every core (``bench/bench_online_threads.py``,
    docs/online.md); otherwise None (torch's default, every core)."""
    if args.threads:
        return args.threads
    if online and str(getattr(args, "device", "cpu")).startswith("cpu"):
        return max(1, (cores or os.cpu_count() or 2) // 2)
    return None


def stream_interval_s(args) -> float:
    """``--stream-interval`` in seconds; by default 20 ms on the CPU, where the server's
    event loop and its clients take turns with the decoding threads on the same cores,
    and 0 (every step's tokens at once) on a GPU."""
    ms = getattr(args, "stream_interval", None)
    if ms is None:
        ms = 20.0 if str(getattr(args, "device", "cpu")).startswith("cpu") else 0.0
    if not ms >= 0:
        raise ValueError(f"--stream-interval must be >= 0 milliseconds, got {ms}")
    return ms / 1e3


def limits_from_args(args) -> Limits:
    """:class:`Limits` from ``osd serve``'s flags (the API key also from ``OSD_API_KEY``)."""
    origins = tuple(
        o.strip() for o in (getattr(args, "allowed_origins", None) or "").split(",") if o.strip()
    )
    given = {
        f: getattr(args, f)
        for f in (
            "max_body_bytes",
            "max_prompt_chars",
            "max_waiting",
            "keep_alive_timeout",
            "header_timeout",
            "body_timeout",
            "max_connections",
        )
        if getattr(args, f, None) is not None
    }
    key = getattr(args, "api_key", None) or os.environ.get("OSD_API_KEY") or None
    return Limits(api_key=key, allowed_origins=origins, **given)
