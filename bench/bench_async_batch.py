"""Speculation against plain decoding under continuous batching, in process: 8 clients.

The chat pair as ``osd serve`` loads it (``Engine.from_pretrained(target, draft=draft,
max_batch_size=8)``: beside the quantized target, prompt lookup alone, from the draft's
``serving.json``) and the target alone, each behind an :class:`osd.AsyncEngine`; 8
concurrent clients, client j sending conversations j, j + 8, ... of the evaluation set (4
per workload) one after another, 96 new tokens each, greedy, EOS ignored, so requests
arrive and leave at staggered times as in a server, without HTTP. Tokens/s over the
whole load, per round, the two engines alternating which goes first; the speculative
engine's drafted and accepted tokens and target forwards beside, and each engine's time
in its steps outside the target's forwards (ms per forward: the host work speculation
adds, which the noisy tokens/s of a shared machine do not resolve). Each round starts with
an empty history of finished requests (prompt lookup would otherwise find the earlier
rounds' answers to the same conversations).

    .venv/bin/python bench/bench_async_batch.py --rounds 2
"""

import osd  # first: osd sets the OpenMP wait policy before torch loads libgomp

import argparse  # noqa: E402
import asyncio  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from osd.chat_template import apply_chat_template  # noqa: E402
from osd.evaluate import settle_memory  # noqa: E402
from osd.zoo.workloads import evaluation_set  # noqa: E402

CLIENTS = 8
NEW_TOKENS = 96


async def _client(ae, prompts, params) -> int:
    n = 0
    for p in prompts:
        out = None
        async for out in ae.generate(p, params):
            pass
        n += len(out.token_ids)
    return n


async def _load(ae, prompts, params, clients) -> float:
    start = time.perf_counter()
    counts = await asyncio.gather(
        *[_client(ae, prompts[j::clients], params) for j in range(clients)]
    )
    return sum(counts) / (time.perf_counter() - start)


def run(rounds: int, prompts_per_workload: int = 4, clients: int = CLIENTS, log=print) -> dict:
    torch.set_num_threads(2)
    target, draft = osd.zoo.chat_pair()
    engines = {
        "speculative": osd.AsyncEngine.from_pretrained(target, draft, max_batch_size=clients),
        "plain": osd.AsyncEngine.from_pretrained(target, max_batch_size=clients),
    }
    settle_memory()  # neither engine favoured by being built last
    tok = engines["plain"].tokenizer
    prompts = [
        apply_chat_template(tok, [list(p)])[0]
        for w in evaluation_set(n=prompts_per_workload)
        for p in w.prompts
    ]
    params = osd.SamplingParams(NEW_TOKENS, ignore_eos=True)
    rates: dict = {name: [] for name in engines}
    hosts: dict = {name: [] for name in engines}
    try:
        for r in range(rounds):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                ae = engines[name]
                ae.engine.reset_stats()
                if ae.engine.lookup_history is not None:
                    # each round as a fresh server: not the answers of the rounds before
                    ae.engine.lookup_history.clear()
                rate = asyncio.run(_load(ae, prompts, params, clients))
                rates[name].append(rate)
                st = ae.engine.stats
                host = host_ms_per_step(st["time_s"], st["target_forwards"])
                hosts[name].append(host)
                log(
                    f"round {r + 1} {name:12s} {rate:6.1f} tokens/s  target forwards "
                    f"{st['target_forwards']}, drafted {st['drafted']}, accepted "
                    f"{st['accepted']}, outside the forwards {host:.2f} ms a step"
                )
    finally:
        for ae in engines.values():
            ae.close()
    ratios = [s / p for s, p in zip(rates["speculative"], rates["plain"])]
    log("speculative / plain per round: " + ", ".join(f"{x:.2f}x" for x in ratios))
    return {"rates": rates, "ratios": ratios, "host_ms_per_step": hosts}


def host_ms_per_step(time_s: dict, forwards: int) -> float:
    """The engine's time in its steps outside the target's forwards (drafting, sampling,
    commit and read-back, listeners), ms per target forward: the host work speculation
    adds to a step, which wall-clock rates on a noisy machine do not resolve."""
    outside = sum(v for k, v in time_s.items() if k not in ("prefill", "verify"))
    return 1e3 * outside / max(forwards, 1)


def test_async_batch():
    if osd.zoo.chat.cached_target() is None or osd.zoo.chat_pair()[1] is None:
        import pytest  # only here: the script runs without pytest

        pytest.skip("the chat pair is not available (osd.zoo.chat.fetch_target())")
    print()
    run(rounds=1, prompts_per_workload=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="conversations per workload")
    ap.add_argument("--clients", type=int, default=CLIENTS)
    args = ap.parse_args()
    run(args.rounds, args.prompts, args.clients)


if __name__ == "__main__":
    main()
