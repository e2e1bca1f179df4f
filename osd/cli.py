"""The ``osd`` command line: ``osd demo``, ``osd generate``, ``osd serve``, ``osd bench``.

Errors in what the user asked for (bad paths, bad parameters, over-long prompts) print
one ``error:`` line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# Each command imports its own modules inside its function: `osd --help` and a command's
# argument errors answer at once, without importing torch, transformers or uvicorn.


def _demo(args) -> int:
    from osd.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        pair=args.pair,
        requests=args.requests,
        baseline_requests=args.baseline,
        static_requests=args.static,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.k,
        out_dir=args.out,
        seed=args.seed,
        threads=args.threads,
        draft=args.draft,
        lookup_history=args.lookup_history,
        lookup_tokens=args.lookup_tokens,
        lookup_min_match=args.lookup_min_match,
        lookup_tree_below=args.lookup_tree_below,
        adaptive=args.adaptive,
        quantized=args.quantized,
        quantize_draft=args.quantize_draft,
        prefix_cache=args.prefix_cache,
        plain_every=args.plain_every,
    )
    run_demo(cfg)
    if args.pair == "chat" and args.workload_prompts:
        # imported here, as every command's own modules are: `osd --help` stays fast
        from osd.demo_workloads import workloads_report
        from osd.zoo import chat

        target, draft = chat.chat_pair()
        workloads_report(
            target,
            chat.chat_eagle() if args.draft == "eagle" else draft,
            args.out,
            prompts=args.workload_prompts,
        )
    return 0


def _generate(args) -> int:
    import torch

    import osd

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype
    ]
    if args.target is None:  # the chat pair (fetched on first use)
        from osd import zoo

        args.target, chat_draft = zoo.chat_pair()
        if args.draft is None and args.drafter == "model":
            args.draft = chat_draft
    # No speculation flag: spec=None lets from_pretrained take the draft's recommended
    # settings (its serving.json; the chat drafts carry one) or a chain of 4.
    spec = None
    flags = (args.k, args.lookup_tokens, args.lookup_tree_below)
    if (args.draft and (args.prompt_lookup or flags != (None,) * 3)) or args.drafter != "model":
        spec = osd.SpecConfig(
            num_draft_tokens=4 if args.k is None else args.k,
            drafter=args.drafter,
            prompt_lookup=args.prompt_lookup,
            lookup_tokens=args.lookup_tokens or 0,
            lookup_tree_below=args.lookup_tree_below or 0,
        )
    online = osd.OnlineConfig(background=False) if args.online else None
    engine = osd.Engine.from_pretrained(
        args.target,
        draft=args.draft,
        device=args.device,
        dtype=dtype,
        spec=spec,
        online=online,
        max_batch_size=1,
        max_seq_len=args.max_seq_len,
        quantized=args.quantized,
        quantize_draft=_draft_format(args.quantize_draft),
    )
    params = osd.SamplingParams(
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop or None,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    prompt = args.prompt
    if engine.tokenizer is None:
        prompt = [int(t) for t in prompt.split()]
    elif getattr(engine.tokenizer, "chat_template", None) and not args.raw:
        from osd.chat import apply_chat_template

        prompt = apply_chat_template(engine.tokenizer, [[{"role": "user", "content": prompt}]])[0]
    tokens = []
    for chunk in engine.stream(prompt, params):
        tokens += chunk
        if engine.tokenizer is not None:
            sys.stdout.write(engine.tokenizer.decode(chunk))
        else:
            sys.stdout.write(" ".join(map(str, chunk)) + " ")
        sys.stdout.flush()
    sys.stdout.write("\n")
    st = engine.stats
    if engine.spec is not None:
        alpha = st["alpha"]
        print(
            f"[{len(tokens)} tokens, {st['tokens_per_s'] or 0:.1f} tok/s, "
            f"acceptance {st['acceptance_rate'] or 0:.2f}"
            + (f", alpha {alpha:.3f}" if alpha is not None else "")
            + "]",
            file=sys.stderr,
        )
    engine.close()
    return 0


def _draft_format(value: str | None) -> str | None:
    """``--quantize-draft``'s value for ``from_pretrained``: "none" is None (float)."""
    return None if value == "none" else value


def _serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(
            f"error: osd serve needs fastapi and uvicorn ({exc.name} is missing): "
            "pip install osd[serve]",
            file=sys.stderr,
        )
        return 2
    # imported here, after the check above: the server needs the serve extra (fastapi,
    # uvicorn), and the CLI's other commands do not pay for importing it
    from osd.server.run import serve

    args.quantize_draft = _draft_format(args.quantize_draft)
    return serve(args)


def _bench(args) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench_dir = os.path.join(root, "bench")
    if not os.path.isdir(bench_dir):
        raise FileNotFoundError(
            f"benchmarks live in the source tree; {bench_dir!r} not found "
            "(run `osd bench` from a checkout)"
        )
    target = os.path.join(bench_dir, f"bench_{args.only}.py") if args.only else bench_dir
    if not os.path.exists(target):
        raise FileNotFoundError(f"no benchmark {target!r}")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        target,
        f"--benchmark-json={args.json}",
    ]
    print("osd bench:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=root)


def _draft_eval(args) -> int:
    # imported here, as every command's own modules are: `osd --help` stays fast
    import json

    import torch

    from osd.evaluate import evaluate, table
    from osd.zoo.workloads import evaluation_set

    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = {} if args.temperature == 0 else dict(temperature=args.temperature, top_p=args.top_p)
    kw = {} if args.quantized is None else {"quantized": args.quantized}
    rows = evaluate(
        args.target,
        args.draft,
        workloads=evaluation_set(n=args.prompts),
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        engine_kwargs=dict(kw, max_seq_len=args.max_seq_len),
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="osd", description="Online speculative decoding.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo",
        help="serve a shifted query stream with online speculative decoding and write a report",
        description="Serve a shifted stream at batch 1: the target alone, a "
        "static draft, and an online draft; show rolling alpha, tokens/s and "
        "speedup; write markdown + PNG plots. --pair chat (default): "
        "SmolLM2-135M-Instruct and its draft on HumanEval chat requests; "
        "--pair builtin: the built-in pair on stdlib code queries.",
    )
    d.add_argument("--pair", default="chat", choices=["chat", "builtin"])
    d.add_argument("--requests", type=int, default=200, help="queries served (default 200)")
    d.add_argument(
        "--baseline",
        type=int,
        default=None,
        help="first queries also served by the target alone, for the live "
        "progress and the plots (chat 8, builtin 40)",
    )
    d.add_argument(
        "--static",
        type=int,
        default=None,
        help="last queries served side by side by the online and the static "
        "draft (chat 50, builtin all)",
    )
    d.add_argument(
        "--plain-every",
        type=int,
        default=2,
        metavar="N",
        help="in that window the target alone serves one query in N: the "
        "speedups' queries (default 2)",
    )
    d.add_argument("--max-new-tokens", type=int, default=None, help="chat 48, builtin 32")
    d.add_argument(
        "-k", type=int, default=None, help="draft tokens per step (chat default 3, builtin 4)"
    )
    d.add_argument(
        "--draft",
        default=None,
        choices=["model", "eagle"],
        help="chat pair: the standalone draft (model) or the EAGLE draft on the "
        "target's features (eagle)",
    )
    d.add_argument(
        "--lookup-history",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prompt lookup also over this many tokens of earlier answers "
        "(chat default 65536; 0, the builtin default: each request's own text)",
    )
    d.add_argument(
        "--lookup-tokens",
        type=int,
        default=None,
        metavar="N",
        help="most drafts of a step drafted by prompt lookup alone "
        "(SpecConfig.lookup_tokens; chat default 8, builtin 0: k)",
    )
    d.add_argument(
        "--lookup-min-match",
        type=int,
        default=None,
        metavar="N",
        help="shortest suffix prompt lookup matches (SpecConfig.ngram_min, 1-3; "
        "chat default 2: with a lookup history, the draft model drafts the "
        "positions a single token's match would guess; builtin 1)",
    )
    d.add_argument(
        "--lookup-tree-below",
        type=int,
        default=None,
        metavar="N",
        help="steps whose lookup match is shorter than N tokens verify it beside "
        "the draft model's chain in one tree (SpecConfig.lookup_tree_below; "
        "chat default 4: every match, builtin 0: off)",
    )
    d.add_argument(
        "--adaptive",
        action="store_true",
        help="the draft model's chains stop where it is unsure (SpecConfig."
        "adaptive); -k is then the longest chain",
    )
    d.add_argument(
        "--quantized", action="store_true", help="the chat target keeps its GGUF weights quantized"
    )
    d.add_argument(
        "--quantize-draft",
        default=None,
        choices=["Q8_0", "Q4_1", "Q4_0", "none"],
        help="serve the draft in this block format (it learns in float32; each "
        "update is quantized): cheaper drafting, the same output (chat default "
        "Q8_0; none: float32)",
    )
    d.add_argument(
        "--prefix-cache",
        type=int,
        default=0,
        metavar="TOKENS",
        help="keep the target's K/V of up to this many prompt tokens across "
        "requests, for prompts that start alike (default 0: none)",
    )
    d.add_argument("--seed", type=int, default=0, help="query-stream seed")
    d.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default 1: serving and the learner thread each use one core)",
    )
    d.add_argument("--out", default="reports/demo", help="report directory")
    d.add_argument(
        "--workload-prompts",
        type=int,
        default=3,
        help="chat pair: after the stream, the speedup on each workload of the "
        "evaluation set with this many prompts each (0: skip)",
    )
    d.set_defaults(func=_demo)

    g = sub.add_parser(
        "generate",
        help="generate a continuation of one prompt",
        description="Generate from a local checkpoint: an HF directory or a "
        "GGUF file (Llama, Mistral, Qwen2, Qwen3, Granite, OLMo-2, Phi-3, SmolLM3, "
        "Gemma 2, Gemma 3); "
        "without --target, the chat pair "
        "(SmolLM2-135M-Instruct and its draft, osd.zoo.chat_pair). With a "
        "draft, speculative decoding; with --online, the draft learns while "
        "serving. Tokens are streamed as they are accepted. A tokenizer with a "
        "chat template gets the prompt as a user message (--raw: as plain "
        "text). Without a tokenizer, the prompt is space-separated token ids.",
    )
    g.add_argument("prompt", help="the prompt text (or token ids without a tokenizer)")
    g.add_argument(
        "--target",
        default=None,
        help="target checkpoint directory or .gguf file (default: the chat pair)",
    )
    g.add_argument("--draft", default=None, help="draft checkpoint directory or .gguf file")
    g.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as plain text, without the chat template",
    )
    g.add_argument(
        "--drafter",
        default="model",
        choices=["model", "self", "ngram"],
        help="who drafts: a draft model, the target with skipped layers, or prompt lookup",
    )
    g.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="with a draft model: draft by prompt lookup when the context repeats, "
        "and run the draft model only when it does not",
    )
    g.add_argument(
        "--lookup-tokens",
        type=int,
        default=None,
        metavar="N",
        help="with --prompt-lookup: most drafts of a step drafted by lookup (0: k)",
    )
    g.add_argument(
        "--lookup-tree-below",
        type=int,
        default=None,
        metavar="N",
        help="with --prompt-lookup: matches shorter than N tokens are verified "
        "beside the draft model's chain in one tree (0: off; the chat demo uses 3)",
    )
    g.add_argument("--online", action="store_true", help="let the draft learn while serving")
    g.add_argument(
        "-k",
        type=int,
        default=None,
        help="draft tokens per step (default 4; without -k, --prompt-lookup or "
        "--lookup-*, the draft's recommended settings when it has them)",
    )
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop once the output holds TEXT (repeatable)",
    )
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument(
        "--quantized",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a GGUF target's block-quantized weights (Q4_0 to Q6_K) "
        "quantized: the same model, fewer bytes read per token (default: "
        "on the CPU in float32; --no-quantized dequantizes to --dtype)",
    )
    g.add_argument(
        "--quantize-draft",
        default="auto",
        choices=["auto", "Q8_0", "Q4_1", "Q4_0", "none"],
        help="keep the draft's layers and head in this block format (CPU, "
        "float32; with --online it learns in float32 and each update is "
        "quantized): cheaper drafting, the same output. auto: the draft's "
        "recommended format (the chat drafts: Q8_0), none: float",
    )
    g.set_defaults(func=_generate)

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
        "quantized (default: on the CPU in float32; --no-quantized "
        "dequantizes to --dtype)",
    )
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
    s.set_defaults(func=_serve)

    dr = sub.add_parser("draft", help="work with draft models").add_subparsers(
        dest="draft_command", required=True
    )
    e = dr.add_parser(
        "eval",
        help="speedup, α, c and tokens per forward of a draft per workload",
        description="Plain against speculative decoding (the "
        "draft's own serving.json settings) on each workload of the evaluation "
        "set (osd.zoo.workloads), interleaved prompt by prompt, batch 1.",
    )
    e.add_argument("--target", required=True, help="target checkpoint directory or .gguf file")
    e.add_argument("--draft", required=True, help="draft checkpoint directory")
    e.add_argument("--prompts", type=int, default=6, help="prompts per workload")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--max-seq-len", type=int, default=2048)
    e.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    e.add_argument("--top-p", type=float, default=0.9, help="with --temperature")
    e.add_argument(
        "--quantized",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a GGUF target quantized (default: on the CPU in float32)",
    )
    e.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    e.add_argument("--json", default=None, help="also write the rows here")
    e.set_defaults(func=_draft_eval)
    # `osd draft build`: its options, help and run live in osd.draft_build.cli, imported
    # here as every command's own modules are (it loads only argparse and the recipe)
    from osd.draft_build import cli as draft_build

    db = dr.add_parser("build", **draft_build.PARSER_KWARGS)
    draft_build.add_arguments(db)
    db.set_defaults(func=draft_build.run)

    b = sub.add_parser(
        "bench",
        help="run the benchmarks (pytest-benchmark)",
        description="Run bench/ from a source checkout and write JSON results.",
    )
    b.add_argument("--only", default=None, help="one benchmark, e.g. e2e or rejection_sample")
    b.add_argument("--json", default="bench_results.json", help="results file")
    b.set_defaults(func=_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
