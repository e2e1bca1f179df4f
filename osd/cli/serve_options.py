"""``osd serve``'s arguments (the server itself: ``osd.server``)."""

from __future__ import annotations

import argparse


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``sub`` (an ``add_subparsers`` object)."""
    s = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions (streaming "
        "too), /v1/models, /health and /metrics (Prometheus) with continuous "
        "batching and speculative decoding. Without --target: the chat pair "
        "when its GGUF is already cached, else the built-in pair. See "
        "docs/serving.md.",
    )
    s.add_argument(
        "--target",
        default=None,
        help="target checkpoint directory or .gguf file (default: the chat pair "
        "if cached, else the built-in pair)",
    )
    s.add_argument(
        "--draft",
        default=None,
        help="draft checkpoint directory (default: the default pair's draft; "
        "with --target, none: plain decoding)",
    )
    s.add_argument(
        "--no-draft", action="store_true", help="serve the default target without its draft"
    )
    s.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="prompt lookup first, the draft model when it finds nothing (without "
        "a draft: prompt lookup alone)",
    )
    s.add_argument(
        "--lookup-history",
        type=int,
        default=0,
        metavar="TOKENS",
        help="with --prompt-lookup: also look up in this many tokens of earlier "
        "answers (0: each request's own text only)",
    )
    s.add_argument(
        "--lookup-tokens",
        type=int,
        default=None,
        metavar="N",
        help="with --prompt-lookup: most drafts of a step drafted by lookup (0: k)",
    )
    s.add_argument(
        "--lookup-tree-below",
        type=int,
        default=None,
        metavar="N",
        help="with --prompt-lookup and a draft: matches shorter than N tokens are "
        "verified beside the draft model's chain in one tree (0: off)",
    )
    s.add_argument("--online", action="store_true", help="let the draft learn while serving")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--model-name",
        default=None,
        help="the model id clients send (default: the target's file name)",
    )
    s.add_argument(
        "-k",
        "--k",
        type=int,
        default=None,
        dest="k",
        help="draft tokens per step (default 4; without -k, --prompt-lookup, "
        "--lookup-* or --auto-k, the draft's recommended settings when it has them)",
    )
    s.add_argument(
        "--auto-k",
        action="store_true",
        help="choose the draft tokens per step (0 to k) from measured goodput",
    )
    s.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="requests decoded together (continuous batching)",
    )
    s.add_argument(
        "--max-seq-len", type=int, default=2048, help="context per request, prompt included"
    )
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument(
        "--quantized",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a GGUF target's block-quantized weights (Q4_0 to Q6_K) "
        "quantized, multiplied by int8 activations where the CPU has AVX-512 VNNI "
        "(default: on the CPU in float32; --no-quantized dequantizes to --dtype)",
    )
    s.add_argument(
        "--exact-quantized",
        action="store_true",
        help="with a quantized target, float32 activations: the dequantized model's "
        "logits bit for bit, slower verify forwards",
    )
    add_kv_dtype_option(s)
    s.add_argument(
        "--quantize-draft",
        default="auto",
        choices=["auto", "Q8_0", "Q4_1", "Q4_0", "none"],
        help="keep the draft's layers and head in this block format (CPU, "
        "float32; with --online it learns in float32 and each update is "
        "quantized): cheaper drafting, the same output. auto: the draft's "
        "recommended format (the chat drafts: Q8_0), none: float",
    )
    s.add_argument(
        "--prefix-cache",
        type=int,
        default=0,
        metavar="TOKENS",
        help="keep the target's K/V of up to this many prompt tokens across "
        "requests: a shared system prompt or a chat's earlier turns are not "
        "prefilled again (default 0: none)",
    )
    s.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    s.add_argument(
        "--stream-interval",
        type=float,
        default=None,
        metavar="MS",
        help="send a streamed request's new tokens at most every MS milliseconds (its "
        "first token and its end at once); fewer, larger events leave a CPU's cores "
        "to decoding (default: 20 on the CPU, 0 on a GPU)",
    )
    s.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    lim = s.add_argument_group("limits", 'what one client may take (docs/serving.md, "Limits")')
    lim.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: the "
        "OSD_API_KEY environment variable; unset: no key)",
    )
    lim.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="comma-separated origins browsers may call the API from (CORS; "
        "default: none, no CORS headers)",
    )
    lim.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="largest request body (default 8388608: 8 MiB; larger: 413)",
    )
    lim.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        metavar="CHARS",
        help="longest prompt (all messages for chat), refused before "
        "tokenizing (default 32 x --max-seq-len)",
    )
    lim.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        metavar="N",
        help="generations queued beyond the batch rows; more get 429 with "
        "Retry-After (default 1024)",
    )
    lim.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open connections; further ones are closed at once (default 1024)",
    )
    lim.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="close a kept-alive connection idle this long (default 5)",
    )
    lim.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="close a connection whose request headers are not complete this "
        "long after it opened or after the previous response (default 10)",
    )
    lim.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="answer 408 and close when a request body takes longer (default 30)",
    )
    return s


def add_kv_dtype_option(group) -> None:
    """``--kv-dtype`` (``osd serve``, ``osd generate``)."""
    group.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "float32", "float16"],
        help="the target's K/V cache (auto: float16 beside int8 activations, which halves "
        "what attention reads a key; else the model's dtype)",
    )


def kv_dtype(args: argparse.Namespace) -> str | None:
    """``Engine.from_pretrained``'s ``kv_dtype`` from ``--kv-dtype`` (auto: None)."""
    value = getattr(args, "kv_dtype", "auto")
    return None if value == "auto" else value


def quantized_mode(args: argparse.Namespace) -> bool | str | None:
    """``Engine.from_pretrained``'s ``quantized`` from ``--quantized`` /
    ``--no-quantized`` / ``--exact-quantized``: None (the default: int8 activations on the
    CPU where they run), ``"int8"``, True (float32 activations) or False."""
    if args.quantized is False:
        return False
    if getattr(args, "exact_quantized", False):
        return True
    return "int8" if args.quantized else None
