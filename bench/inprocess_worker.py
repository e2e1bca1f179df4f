"""The in-process rows of ``bench/bench_serve_llamacpp.py``: an ``osd.Engine`` in a
process of its own, driven as a user's script drives it (``import osd`` first, then
``Engine.from_pretrained`` and one conversation at a time).

A process of its own because ``import osd`` sets libgomp's spin count
(``GOMP_SPINCOUNT=1000``) only for an OpenMP runtime not yet loaded: in a pytest process
(``bench/conftest.py`` imports torch first) libgomp's threads would spin long, which on a
shared CPU slows decoding many times over and would make the reference row meaningless.

    python -m bench.inprocess_worker TARGET DRAFT|- THREADS

Protocol, one JSON object per line prefixed with ``bench.chat_load.PREFIX``: the worker
writes ``{"ready": true}`` once loaded; then for each ``{"convs": [...], "max_tokens": N}``
read from stdin it writes ``{"wall_s": ..., "results": [...], "engine_wall_s": ...}``
(the fields of ``bench.chat_load.run_load``'s results; times from ``time.perf_counter``
in this process; the engine's step time so far, ``Engine.stats["wall_s"]``). An empty
line or end of input ends it.
"""

import osd  # first: sets GOMP_SPINCOUNT before torch loads libgomp

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.chat_load import PREFIX  # noqa: E402
from osd.chat_template import apply_chat_template  # noqa: E402


def run(eng: osd.Engine, convs: list, max_tokens: int) -> dict:
    """Each conversation through ``Engine.run`` (what ``Engine.generate`` runs), one at a
    time; the first step that yields a token gives the TTFT."""
    params = osd.SamplingParams(max_tokens, ignore_eos=True)
    results = []
    t_start = time.perf_counter()
    for msgs in convs:
        t0 = time.perf_counter()
        ids = apply_chat_template(eng.tokenizer, [msgs])[0]
        (req,) = eng.requests([ids], params)
        t_first = None
        with eng._exclusive():  # as Engine.generate: hold the engine, step to the end
            for _ in eng.run([req]):
                if t_first is None and req.generated:
                    t_first = time.perf_counter()
        out = eng.output(req)
        results.append(
            dict(
                t0=t0,
                t_first=t_first,
                t_end=time.perf_counter(),
                text=out.text,
                chunks=1,
                finish=out.finish_reason,
                completion_tokens=len(out.token_ids),
                prompt_tokens=len(ids),
            )  # fmt: skip
        )
    wall = time.perf_counter() - t_start
    return dict(wall_s=wall, results=results, engine_wall_s=eng.stats["wall_s"])


def main(argv) -> int:
    target, draft, threads = argv[0], argv[1], int(argv[2])
    torch.set_num_threads(threads)
    eng = osd.Engine.from_pretrained(target, draft=None if draft == "-" else draft)
    print(PREFIX + json.dumps({"ready": True, "engine_wall_s": eng.stats["wall_s"]}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        print(PREFIX + json.dumps(run(eng, job["convs"], job["max_tokens"])), flush=True)
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
