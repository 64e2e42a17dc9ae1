"""Multi-turn chat sessions through ``reshard serve``: TTFT per turn with the prefix cache on and off.

    python bench/serve_chat.py                      # 4 sessions x 4 turns, a 200-word system prompt, 1 rank
    python bench/serve_chat.py --sessions 8 --turns 6 --nproc 2
    python bench/serve_chat.py --layout dejavu --nproc 2   # DejaVu's prompt side keeps prompts (contiguous)
    python bench/serve_chat.py --layout seesaw --nproc 2   # Seesaw's CPU tier keeps prompts

A server is started twice on ``bench/serve.py``'s seeded Llama (with a tokenizer), a paged cache
of 16-token blocks (``engine.kv_block_size=16``), once with ``engine.prefix_caching=true`` and
once ``false``. ``--sessions`` sessions run at once, each ``--turns`` turns in order: a turn's
prompt is the session's text so far (a seeded system prompt of ``--system-len`` words, then each
earlier turn's user words and the reply the server streamed) and ``--user-len`` new words; the
reply is ``--reply`` tokens (greedy, EOS ignored), streamed from ``/v1/completions``. At the client:
TTFT of each turn (request sent -> its first token's event), median over the sessions; from
``/metrics``: the prompt tokens the prefix cache was asked for and held. Later turns resend the
conversation, so with the cache they compute only the new words. ``--layout``: one of
``bench/serve.py``'s layouts (``dejavu``: contiguous caches, its prompt side keeps computed
prompts in their slots; no ``engine.kv_block_size``; ``seesaw``: its CPU tier keeps them). Measure on a quiet machine.
"""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
import time
from pathlib import Path

from _common import add_sizes, fill_sizes, med, parser, rerun_command
from serve import LAYOUTS, SIZES, checkpoint, start

CHAT = {**SIZES, "sessions": 4, "turns": 4, "system_len": 200, "user_len": 24, "reply": 16, "nproc": 1}


def words(count: int, seed: int, vocab: int) -> str:
    """``count`` seeded words of the tokenizer's (``w<i>``, a few tokens each)."""
    import torch

    ids = torch.randint(3, vocab - 1, (count,), generator=torch.Generator().manual_seed(seed)).tolist()
    return "".join(f" w{i}" for i in ids)


async def turn(http, url: str, prompt: str, budget: int) -> tuple[float, str]:
    """One streamed completion: its TTFT (s) and the reply's text."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": budget, "ignore_eos": True, "temperature": 0}
    sent, first, reply = time.perf_counter(), None, []
    async with http.stream("POST", f"{url}/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter()
                reply += [c["text"] for c in json.loads(line[6:])["choices"]]
    return first - sent, "".join(reply)


async def session(http, url: str, index: int, args) -> list[float]:
    """One session's turns in order; each turn's TTFT."""
    text, ttfts = words(args.system_len, 1000 + index, args.vocab), []
    for t in range(args.turns):
        text += words(args.user_len, 10_000 * index + t, args.vocab)
        ttft, reply = await turn(http, url, text, args.reply)
        ttfts.append(ttft)
        text += reply
    return ttfts


async def sessions(url: str, args) -> list[list[float]]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        await turn(http, url, words(32, 7, args.vocab), 4)  # warm-up
        return await asyncio.gather(*(session(http, url, i, args) for i in range(args.sessions)))


def counters(url: str) -> tuple[float, float]:
    """The server's prefix-cache queries and hits so far (prompt tokens)."""
    import httpx

    lines = httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=60).text.splitlines()

    def total(name: str) -> float:  # summed over the engine groups (``name{group="g"} value``)
        return sum(float(line.split()[-1]) for line in lines if line.split("{")[0].split()[0] == name)

    return total("reshard_prefix_cache_queries_total"), total("reshard_prefix_cache_hits_total")


def run(cached: bool, path: Path, args, tmp: Path) -> tuple[list[list[float]], tuple[float, float]]:
    """Every session's TTFTs and the server's counters, the prefix cache on or off."""
    name = f"cache-{'on' if cached else 'off'}-{time.monotonic_ns()}"
    paged = () if args.layout == "dejavu" else ("engine.kv_block_size=16",)  # (DejaVu's caches are contiguous)
    extra = (*paged, f"engine.prefix_caching={str(cached).lower()}")
    extra += (f"workload.prompt_len_max={args.prompt_lens[1]}", f"generation.max_new_tokens={args.reply}")
    proc, url = start(args.layout, path, args, tmp / name, extra)
    try:
        return asyncio.run(sessions(url, args)), counters(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(300) == 0, f"{name}: the server did not drain cleanly"


def main() -> None:
    p = parser(__doc__)
    add_sizes(p, CHAT)
    p.add_argument(
        "--layout", default="tp", choices=(*LAYOUTS, "seesaw"), help="the server's layout (bench/serve.py's)"
    )
    args = fill_sizes(p.parse_args(), CHAT)
    # tokens of the longest prompt: a word is up to 5 tokens, a reply's text may re-tokenize longer
    longest = 5 * (args.system_len + args.turns * args.user_len + 32) + 3 * args.turns * args.reply
    args.prompt_lens, args.budgets = [0, longest], [0, args.reply]  # (bench/serve.py's start sizes slots by them)
    path = checkpoint(args)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {cached: run(cached, path, args, Path(tmp)) for cached in (True, False)}
    print(f"# {rerun_command('serve_chat.py', None)}")
    print(f"{'turn':>4} {'TTFT on ms':>11} {'TTFT off ms':>12} {'off/on':>7}")
    for t in range(args.turns):
        on, off = (1e3 * med([s[t] for s in runs[c][0]]) for c in (True, False))
        print(f"{t + 1:>4} {on:>11.1f} {off:>12.1f} {off / on:>7.2f}")
    for cached in (True, False):
        queries, hits = runs[cached][1]
        print(
            f"prefix cache {'on ' if cached else 'off'}: {hits:.0f} of {queries:.0f} prompt tokens held",
        )


if __name__ == "__main__":
    main()
