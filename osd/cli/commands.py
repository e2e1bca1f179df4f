"""What each ``osd`` command runs (``osd.cli.parser`` maps the arguments here)."""

from __future__ import annotations

import os
import subprocess
import sys

from osd.cli.serve_options import kv_dtype, quantized_mode

# Each command imports its own modules inside its function: `osd --help` and a command's
# argument errors answer at once, without importing torch, transformers or uvicorn.


def _demo(args) -> int:
    from osd.demo import DemoConfig, run_demo  # lazy: a command imports its own modules

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
        from osd.demo.workloads import workloads_report
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
    # lazy: a command imports its own modules (torch only when a command needs it)
    import torch

    import osd

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype
    ]
    if args.target is None:  # the chat pair (fetched on first use)
        from osd import zoo  # lazy: a command imports its own modules

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
        quantized=quantized_mode(args),
        kv_dtype=kv_dtype(args),
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
        from osd.chat_template import apply_chat_template  # lazy: a command imports its own modules

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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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

    from osd.evaluate import evaluate, plot, table
    from osd.zoo.workloads import evaluation_set

    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = {} if args.temperature == 0 else dict(temperature=args.temperature, top_p=args.top_p)
    mode = quantized_mode(args)
    kw = {} if mode is None else {"quantized": mode}
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
    if args.plot:
        mode = "greedy" if not sampling else f"T {args.temperature}, top-p {args.top_p}"
        plot(
            {mode: rows},
            args.plot,
            title=f"{os.path.basename(args.draft.rstrip('/'))}: "
            f"speedup per workload (t/f: tokens per target forward)",
        )
        print(f"plot written to {args.plot}")
    return 0
