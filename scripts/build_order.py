"""Does an in-process engine's speed depend on when it was built? Identical engines built
one after another in one process, then run in turns.

``--engines`` engines of the chat pair as ``Engine.from_pretrained(target, draft=draft)``
builds them (``--threads`` torch threads) are built one after another; then, optionally,
``--ballast GB`` of fresh memory is touched and freed (``osd.evaluate.settle_memory``),
or ``--sleep`` seconds pass, or one more engine is built and never used
(``--throwaway``). The engines then answer ``--requests`` "explain" requests of
``osd.zoo.workloads.stream`` (128 new tokens, greedy), taking turns request by request
in a rotated order. Printed per engine, in the order they were built: the wall seconds
and the seconds in target forwards, and each as a ratio to the last built engine's.

Identical engines doing identical work in turns should take the same time; on the 2-core
Intel VM the engine built last often ran a few percent faster than the ones built before
it, and a gigabyte of other memory touched after building them, or a few minutes' wait,
evened them out in most runs, which is why side-by-side comparisons call
``settle_memory`` after building their engines.

    .venv/bin/python scripts/build_order.py --engines 2
    .venv/bin/python scripts/build_order.py --engines 2 --ballast 1
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import osd  # noqa: E402  (first: osd sets the OpenMP wait policy before torch loads)
import torch  # noqa: E402

from osd.chat_template import encode_chat  # noqa: E402
from osd.evaluate import settle_memory  # noqa: E402
from osd.zoo.workloads import stream  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ballast", type=float, default=0.0, help="GB to touch and free")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after building")
    p.add_argument("--throwaway", action="store_true", help="build one more engine, unused")
    args = p.parse_args(argv)
    if osd.zoo.chat.cached_target() is None or osd.zoo.chat_pair()[1] is None:
        print("needs the chat GGUF cached (osd.zoo.chat.fetch_target()) and the chat draft")
        return 1
    torch.set_num_threads(args.threads)
    target, draft = osd.zoo.chat_pair()
    engines = []
    for j in range(args.engines):
        print(f"building engine {j + 1}/{args.engines}", flush=True)
        engines.append(osd.Engine.from_pretrained(target, draft=draft, max_batch_size=1))
    spare = osd.Engine.from_pretrained(target, draft=draft) if args.throwaway else None
    if args.ballast > 0:
        settle_memory(args.ballast)
    time.sleep(args.sleep)
    prompts = encode_chat(engines[0].tokenizer, [list(c) for c in stream("explain", args.requests)])
    params = osd.SamplingParams(128)
    n = len(engines)
    walls, forwards = [0.0] * n, [0.0] * n
    for i, ids in enumerate(prompts):
        for j in [(i + m) % n for m in range(n)]:
            before = engines[j].stats["time_s"]["verify"]
            t0 = time.perf_counter()
            engines[j].generate([ids], params)
            walls[j] += time.perf_counter() - t0
            forwards[j] += engines[j].stats["time_s"]["verify"] - before
        if (i + 1) % 10 == 0:
            print(f"request {i + 1}/{len(prompts)} done", flush=True)
    for j in range(n):
        print(
            f"built #{j + 1}: wall {walls[j]:.2f} s ({walls[-1] / walls[j]:.3f}x the last "
            f"built's speed), target forwards {forwards[j]:.2f} s "
            f"({forwards[-1] / forwards[j]:.3f}x)"
        )
    for e in engines + ([spare] if spare is not None else []):
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
