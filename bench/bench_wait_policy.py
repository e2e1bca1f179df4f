"""How decoding holds up when the CPU is shared: OpenMP's wait policy under load.

PyTorch's OpenMP runtime (libgomp) keeps the threads of a parallel region spinning after it
ends, waiting for the next one (300,000 rounds by default), unless ``OMP_WAIT_POLICY=PASSIVE``
puts them to sleep at once or ``GOMP_SPINCOUNT`` bounds the spinning. A decode step runs
hundreds of short parallel regions a few microseconds apart: sleeping threads pay a wake-up
at each, while long-spinning ones, when other work shares the cores (a server's event loop,
another process), take the cores the others need, and a team member that lost its core
stalls each region until the scheduler runs it again. ``import osd`` sets
``OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000`` (``spin=10000`` here).

Each measurement is a fresh process (libgomp reads the policy when torch loads) decoding
the same prompts greedily at batch 1 with 2 threads: plain and speculative (the chat pair
when cached, else the built-in pair), then plain again from a second thread (as a
server's engine loop runs it), with ``--load`` busy processes beside it. Policies
(``--policies``: ACTIVE, PASSIVE, spin=N) alternate, their order reversed every round, so
that all see the same machine.

    .venv/bin/python bench/bench_wait_policy.py --load 0 2 --rounds 2 --tokens 64

Under ``make bench`` one short round runs on the built-in pair.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

# OMP_WAIT_POLICY values, or "spin=N": OMP_WAIT_POLICY=ACTIVE with GOMP_SPINCOUNT=N (spin N
# rounds after a region, then sleep, also with more threads than cores: what ``import
# osd`` sets with N = 10000)
POLICIES = ("ACTIVE", "PASSIVE", "spin=1000", "spin=10000")

CHILD = r"""
import json, sys, threading, time, torch, osd
from osd import zoo
from osd.zoo import chat
torch.set_num_threads(2)
pair = chat.chat_pair() if sys.argv[1] == "chat" else None
if pair is None or pair[1] is None:
    target, draft = zoo.default_pair()
else:
    target, draft = pair
plain = osd.Engine.from_pretrained(target, max_batch_size=1)
spec = osd.Engine.from_pretrained(target, draft=draft, max_batch_size=1)
qs = ["Explain what numpy.argsort does, with an example.", "What does functools.lru_cache do?"]
params = osd.SamplingParams(int(sys.argv[2]))
out = {}
for name, eng in (("plain", plain), ("spec", spec)):
    ids = [eng.encode([q])[0] for q in qs]
    eng.generate([ids[0]], osd.SamplingParams(8))  # warm-up
    n, t = 0, time.perf_counter()
    for i in ids:
        n += len(eng.generate([i], params)[0].token_ids)
    out[name] = n / (time.perf_counter() - t)
# plain decoding again from a second thread, as a server's engine loop runs it: libgomp
# then manages a thread team per calling thread
def in_thread():
    ids = [plain.encode([q])[0] for q in qs]
    n, t = 0, time.perf_counter()
    for i in ids:
        n += len(plain.generate([i], params)[0].token_ids)
    out["plain_thread"] = n / (time.perf_counter() - t)
th = threading.Thread(target=in_thread)
th.start()
th.join()
print(json.dumps(out))
"""


def _spin() -> None:
    while True:
        pass


def measure(policy: str, pair: str, tokens: int) -> dict:
    """Tokens/s of plain and speculative decoding in a fresh process under ``policy``."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if policy.startswith("spin="):
        env["OMP_WAIT_POLICY"] = "ACTIVE"
        env["GOMP_SPINCOUNT"] = policy.split("=", 1)[1]
    else:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", CHILD, pair, str(tokens)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(
    loads: list[int], rounds: int, pair: str, tokens: int, policies: tuple = POLICIES
) -> list[dict]:
    rows = []
    for load in loads:
        spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(load)]
        for p in spinners:
            p.start()
        try:
            got = {p: [] for p in policies}
            for r in range(rounds):
                for policy in policies if r % 2 == 0 else policies[::-1]:
                    got[policy].append(measure(policy, pair, tokens))
                    print(f"[wait_policy] load {load} round {r + 1}/{rounds} {policy}", flush=True)
        finally:
            for p in spinners:
                p.terminate()
        for policy, runs in got.items():
            rows.append(
                {
                    "load": load,
                    "policy": policy,
                    "plain": sorted(x["plain"] for x in runs)[len(runs) // 2],
                    "spec": sorted(x["spec"] for x in runs)[len(runs) // 2],
                    "plain_thread": sorted(x["plain_thread"] for x in runs)[len(runs) // 2],
                }
            )
        time.sleep(1)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| busy processes beside | threads wait | plain tokens/s | speculative tokens/s "
        "| plain from a second thread |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['load']} | {r['policy']} | {r['plain']:.1f} | {r['spec']:.1f} "
            f"| {r['plain_thread']:.1f} |"
        )
    return "\n".join(lines)


def test_wait_policy_under_load():
    """One short round on the built-in pair, idle and beside two busy processes."""
    print("\n" + table(run([0, 2], rounds=1, pair="builtin", tokens=32)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=int, nargs="+", default=[0, 2], help="busy processes")
    ap.add_argument("--rounds", type=int, default=3, help="medians over this many runs")
    ap.add_argument("--pair", choices=("chat", "builtin"), default="chat")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), help="ACTIVE, PASSIVE, spin=N")
    args = ap.parse_args()
    rows = run(args.load, args.rounds, args.pair, args.tokens, tuple(args.policies))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
