"""Regenerate the built-in model pair, or measure how much online distillation helps it.

    python scripts/build_zoo.py                      # train all into osd/zoo/weights
    python scripts/build_zoo.py --only draft         # retrain one model only
    python scripts/build_zoo.py --scale 0.05 --out /tmp/zoo   # a quick smoke build
    python scripts/build_zoo.py --check-alpha        # static vs online-distilled alpha

``--check-alpha`` uses plain transformers models, outside the engine: the target
greedily continues each query of the held-out ``code`` stream; every ``--interval``
queries the draft takes ``--updates`` AdamW steps of forward KL(p || q) on the target's
distributions along the served continuations. It reports alpha = sum_x min(p(x), q(x))
averaged over the continuation positions, and greedy agreement (argmax q == argmax p):
prequentially on the served stream (each query scored before the draft learns from it)
and on a fixed set of evaluation queries (another seed of the same held-out files).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from osd import zoo  # noqa: E402
from osd.zoo import train  # noqa: E402


def _served(target, prompt: list[int], new_tokens: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(ids [1, P+n], P, target_probs [n, V])``: the target's greedy continuation of the
    prompt and its distribution at every continuation position."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=target.config.pad_token_id
        )
        logits = target(out).logits[0, len(prompt) - 1 : -1]
    return out, len(prompt), torch.softmax(logits.float(), dim=-1)


def _draft_logits(draft, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    return draft(ids).logits[0, prompt_len - 1 : -1].float()


def _score(draft, served) -> tuple[float, float, int]:
    """Summed alpha, summed greedy agreement and position count over ``served``."""
    alpha = agree = count = 0
    with torch.no_grad():
        for ids, plen, p in served:
            q = torch.softmax(_draft_logits(draft, ids, plen), dim=-1)
            alpha += torch.minimum(p, q).sum(-1).sum().item()
            agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
            count += p.shape[0]
    return alpha, agree, count


def check_alpha(args) -> None:
    base = args.out or os.path.dirname(zoo.default_pair()[0])
    target_dir, draft_dir = os.path.join(base, "target"), os.path.join(base, args.draft)
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    draft = LlamaForCausalLM.from_pretrained(draft_dir)
    stream = zoo.query_stream("code", n=args.queries, prompt_tokens=args.prompt_tokens, seed=0)
    evals = zoo.query_stream("code", n=args.eval_queries, prompt_tokens=args.prompt_tokens, seed=1)
    start = time.perf_counter()
    eval_served = [_served(target, q, args.new_tokens) for q in evals]
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    print(
        f"{'queries':>8} {'eval alpha':>10} {'eval agree':>10} {'stream alpha':>12} "
        f"{'stream agree':>12}"
    )

    def report(n_served: int, window: tuple[float, float, int]) -> None:
        a, g, c = _score(draft.eval(), eval_served)
        wa, wg, wc = window
        stream_cols = f"{wa / wc:>12.3f} {wg / wc:>12.3f}" if wc else f"{'-':>12} {'-':>12}"
        print(f"{n_served:>8} {a / c:>10.3f} {g / c:>10.3f} {stream_cols}", flush=True)

    report(0, (0, 0, 0))
    buffer, window = [], [0.0, 0.0, 0]
    for i, prompt in enumerate(stream, 1):
        served = _served(target, prompt, args.new_tokens)
        for k, v in enumerate(_score(draft.eval(), [served])):
            window[k] += v
        buffer.append(served)
        if i % args.interval == 0:
            draft.train()
            for _ in range(args.updates):
                loss = 0.0
                for ids, plen, p in buffer:
                    logq = torch.log_softmax(_draft_logits(draft, ids, plen), dim=-1)
                    loss = loss + (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1).mean()
                opt.zero_grad(set_to_none=True)
                (loss / len(buffer)).backward()
                torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
                opt.step()
            buffer = []
        if i % args.report_every == 0:
            report(i, tuple(window))
            window = [0.0, 0.0, 0]
    print(
        f"served {len(stream)} queries + {len(evals)} eval queries, learning and "
        f"evaluating, in {time.perf_counter() - start:.0f} s "
        f"({torch.get_num_threads()} threads)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--out",
        default=None,
        help="zoo directory (default: osd/zoo/weights when building, the "
        "default pair when checking)",
    )
    parser.add_argument(
        "--draft",
        default="draft",
        help="with --check-alpha: the draft's subdirectory (default: draft)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every training step count (default 1.0)"
    )
    parser.add_argument(
        "--only",
        choices=tuple(train.MODELS),
        default=None,
        help=f"retrain one model only (default: all of {', '.join(train.MODELS)})",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument(
        "--check-alpha",
        action="store_true",
        help="measure static vs online-distilled alpha instead of building",
    )
    parser.add_argument("--queries", type=int, default=200, help="served queries (default 200)")
    parser.add_argument("--eval-queries", type=int, default=40, help="evaluation queries (40)")
    parser.add_argument("--prompt-tokens", type=int, default=48, help="prompt length (48)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated (32)")
    parser.add_argument("--interval", type=int, default=8, help="queries per update (8)")
    parser.add_argument("--updates", type=int, default=2, help="AdamW steps per update (2)")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (3e-4)")
    parser.add_argument("--report-every", type=int, default=40, help="report interval (40)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.check_alpha:
        check_alpha(args)
        return 0
    start = time.perf_counter()
    roles = (args.only,) if args.only else tuple(train.MODELS)
    train.build(args.out or zoo.WEIGHTS_DIR, scale=args.scale, roles=roles)
    print(f"built {', '.join(roles)} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
