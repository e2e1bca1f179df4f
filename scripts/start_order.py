"""Does a process's speed depend on when it started? Identical in-process engines started
one after another, then run in turns.

``--engines`` workers of ``bench/inprocess_worker.py`` (the chat pair as
``Engine.from_pretrained(target, draft=draft)`` builds it, ``--threads`` threads) start one
after another; each then answers the evaluation set's conversations (``--prompts`` per
workload, 96 new tokens, greedy, EOS ignored), the workers taking turns conversation by
conversation in a rotated order, so a burst of other load hits them alike. Printed per
worker, in the order they started: the engine's seconds in its steps and the wall seconds.
Identical processes doing identical work in turns should take the same time; on the
2-core Intel VM the later started ran the faster, which is why the serving benchmark
alternates the order it starts its providers in (``bench_serve_llamacpp.start_order``).
``--ballast GB`` first touches and frees that much memory in this process, to see whether
memory just freed makes the next process slower.

    .venv/bin/python scripts/start_order.py --engines 3
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import chat_load  # noqa: E402
from osd import zoo  # noqa: E402
from osd.zoo.workloads import evaluation_set  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2, help="conversations per workload")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ballast", type=float, default=0.0, help="GB to touch and free first")
    args = p.parse_args(argv)
    if zoo.chat.cached_target() is None or zoo.locate.find("chat_draft") is None:
        print("needs the chat GGUF cached (osd.zoo.chat.fetch_target()) and the chat draft")
        return 1
    target, draft = zoo.chat_pair()
    convs = [list(c) for w in evaluation_set(n=args.prompts) for c in w.prompts]
    if args.ballast > 0:
        ballast = bytearray(int(args.ballast * 2**30))  # zero-filled: every page touched
        del ballast
    workers = []
    try:
        for j in range(args.engines):
            print(f"starting worker {j + 1}/{args.engines}", flush=True)
            workers.append(chat_load.InProcess(target, draft, args.threads))
        for w in workers:
            w.run(convs[:1], 8)  # warm-up
        start = [w.engine_wall_s() for w in workers]
        walls = [0.0] * len(workers)
        for i, conv in enumerate(convs):
            n = len(workers)
            for j in [(i + m) % n for m in range(n)]:
                walls[j] += workers[j].run([conv], 96)[0]
            print(f"conversation {i + 1}/{len(convs)} done", flush=True)
        for j, w in enumerate(workers):
            print(
                f"started #{j + 1}: engine {w.engine_wall_s() - start[j]:.3f} s in its steps, "
                f"wall {walls[j]:.3f} s"
            )
    finally:
        for w in workers:
            w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
