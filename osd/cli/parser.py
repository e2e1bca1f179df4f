"""The ``osd`` command line's arguments: one subparser per command, each dispatching to
its function in ``osd.cli.commands``."""

from __future__ import annotations

import argparse

from osd.cli.commands import _bench, _demo, _draft_eval, _generate, _serve
from osd.cli.serve_options import add_kv_dtype_option, add_serve_parser


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
        "quantized: fewer bytes read per token, multiplied by int8 activations where "
        "the CPU has AVX-512 VNNI (default: on the CPU in float32; --no-quantized "
        "dequantizes to --dtype)",
    )
    g.add_argument(
        "--exact-quantized",
        action="store_true",
        help="with a quantized target, float32 activations: the dequantized model's "
        "logits bit for bit, slower verify forwards",
    )
    add_kv_dtype_option(g)
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

    s = add_serve_parser(sub)
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
    e.add_argument(
        "--plot", default=None, help="also draw the speedup per workload to this PNG file"
    )
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
