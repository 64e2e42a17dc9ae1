"""``reshard serve`` under load: latency and throughput measured at an HTTP client, beside the engine's own.

    python bench/serve.py                                   # 4 ranks: tp, dp-groups, shift, dejavu
    python bench/serve.py --nproc 2 --layouts tp,dp-groups --rates 1,2 --requests 16 --png bench/serve

For each layout of ``--layouts`` a server is started (``reshard serve --nproc N --port 0`` on a
seeded Llama of ``bench/online.py``'s sizes, with a tokenizer) and, for each arrival rate of
``--rates``, a load generator sends ``--requests`` seeded requests as a Poisson process (one
asyncio task per request, ``httpx`` streaming ``/v1/completions``): token-id prompts uniform over
``--prompt-lens``, ``max_tokens`` uniform over ``--budgets``, EOS ignored, greedy. At the client:
TTFT (request sent -> its first token's event), TPOT ((last - first token) / (tokens - 1)),
end-to-end latency and normalized latency (latency / tokens), p50/p90/p99, and throughput (output
tokens over the wall time of the rate's run). Then ``bench/online.py`` runs the same workload in
process (``torchrun``, the same layouts and rates), so the server's own overhead shows as the
ratio of the two. ``--png PREFIX`` writes one plot per metric (``PREFIX-<metric>.png``). Measure
on a quiet machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import add_sizes, fill_sizes, llama_sizes, parser, rerun_command

SIZES = {
    "hidden": 256,
    "intermediate": 768,
    "layers": 4,
    "heads": 8,
    "kv_heads": 4,
    "vocab": 8000,
    "requests": 24,
    "rates": [1, 2, 4],
    "prompt_lens": [16, 256],
    "budgets": [8, 48],
    "batch": 8,
    "seed": 0,
    "nproc": 4,
}
SMALL = {**SIZES, "hidden": 64, "intermediate": 128, "layers": 2, "vocab": 512, "requests": 8, "rates": [2], "nproc": 2}
LAYOUTS = ("tp", "dp-groups", "shift", "dejavu")


def layout_overrides(layout: str, nproc: int) -> list[str]:
    """The server's overrides for ``layout`` on ``nproc`` ranks (``bench/online.py``'s layouts)."""
    half = nproc // 2  # dejavu: prompts on half the ranks, tokens on the rest, a group per rank
    dejavu = ["parallel=dejavu", f"parallel.prompt_ranks={half}", f"parallel.prompt.dp={half}"]
    return {
        "tp": [],
        "dp-groups": ["parallel.tp=1"],
        "shift": ["parallel=shift", "parallel.sp=2"],
        "dejavu": [*dejavu, f"parallel.token.dp={nproc - half}"],
        "seesaw": ["parallel=seesaw"],  # (bench/serve_chat.py's; the strategy's default layouts)
    }[layout]


METRICS = ("ttft", "tpot", "latency", "normalized")


def checkpoint(args) -> Path:
    """The seeded Llama of ``args``' sizes, with a tokenizer (a server takes and returns text)."""
    from reshard.parallel.model.tiny_models import cached_checkpoint

    name, overrides = llama_sizes(args, "serve")
    return cached_checkpoint(name, overrides, tokenizer=True)


def workload(args, rate: float) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt token ids, max_tokens) per request, as ``bench/online.py`` draws them."""
    import torch

    from reshard.parallel.engine.workload import poisson_arrivals

    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_lens
    lengths = torch.randint(lo, hi + 1, (args.requests,), generator=gen).tolist()
    prompts = [torch.randint(3, args.vocab, (n,), generator=gen).tolist() for n in lengths]
    arrivals = poisson_arrivals(args.requests, rate, args.seed)
    budgets = torch.randint(args.budgets[0], args.budgets[1] + 1, (args.requests,), generator=gen).tolist()
    return list(zip(arrivals, prompts, budgets))


# ---- the server and the client ------------------------------------------------------------------------
def start(layout: str, path: Path, args, run_dir: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """A server of ``layout`` (``extra``: more overrides) and its URL once it listens."""
    max_len = args.prompt_lens[1] + args.budgets[1]
    cmd = [sys.executable, "-m", "reshard.recipes.cli", "serve", "--nproc", str(args.nproc), "--port", "0"]
    cmd += [f"model.path={path}", "serve.model_name=bench", f"engine.max_batch_size={args.batch}"]
    cmd += [f"engine.max_seq_len={max_len}", "serve.max_waiting=100000", *layout_overrides(layout, args.nproc)]
    cmd += [f"hydra.run.dir={run_dir}", *extra]
    proc = subprocess.Popen(cmd, stdout=(run_dir.parent / f"{layout}.log").open("w"), stderr=subprocess.STDOUT)
    while proc.poll() is None:
        info = run_dir / "server.json"
        url = json.loads(info.read_text()).get("url") if info.exists() else None
        if url:
            return proc, url
        time.sleep(0.2)
    log = (run_dir.parent / f"{layout}.log").read_text()[-2000:]
    raise SystemExit(f"{layout}: the server exited {proc.returncode}:\n{log}")


async def one(http, url: str, start: float, arrival: float, prompt: list[int], budget: int) -> dict:
    """One streamed request sent at ``start + arrival``: when it was sent and each token's event."""
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    body = {"model": "bench", "prompt": prompt, "max_tokens": budget, "ignore_eos": True, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    sent, marks, tokens = time.perf_counter(), [], 0
    async with http.stream("POST", f"{url}/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"]:
                marks.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    assert tokens == budget, (tokens, budget)
    return {"sent": sent, "marks": marks, "tokens": tokens}


async def load(url: str, requests: list) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(http, url, start, *r) for r in requests))
        return results, time.perf_counter() - start


def figures(results: list[dict], seconds: float) -> dict:
    """TTFT, TPOT, latency and normalized latency percentiles, throughput (the engine's names)."""
    from reshard.parallel.engine.metrics import percentiles

    ttft = [r["marks"][0] - r["sent"] for r in results]
    last = [r["marks"][-1] - r["sent"] for r in results]
    tpot = [(r["marks"][-1] - r["marks"][0]) / max(r["tokens"] - 1, 1) for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "ttft": percentiles(ttft),
        "tpot": percentiles(tpot),
        "latency": percentiles(last),
        "normalized": percentiles([t / r["tokens"] for t, r in zip(last, results)]),
        "requests_per_s": len(results) / seconds,
        "output_tokens_per_s": tokens / seconds,
    }


def in_process(args, layouts: list[str], out: Path) -> dict:
    """``bench/online.py``'s figures for the same workload (``{layout: {rate: figures}}``)."""
    flags = ["--layouts", ",".join(layouts), "--rates", ",".join(str(int(r)) for r in args.rates), "--json", str(out)]
    for key in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "requests", "batch", "seed"):
        flags += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    flags += ["--prompt-lens", ",".join(map(str, args.prompt_lens)), "--budgets", ",".join(map(str, args.budgets))]
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(args.nproc), "bench/online.py", *flags]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    return {
        layout: {float(rate): f for rate, f in by_rate.items()}
        for layout, by_rate in json.loads(out.read_text()).items()
    }


def line(layout: str, rate: float, where: str, f: dict, ratio: float | None) -> str:
    pcts = "  ".join(f"{m} {f[m]['p50'] * 1e3:7.1f}/{f[m]['p99'] * 1e3:7.1f}" for m in ("ttft", "tpot", "normalized"))
    vs = "" if ratio is None else f" ({ratio:4.2f}x in-process)"
    return f"{layout:10s} {rate:4.1f}/s {where:10s} {f['output_tokens_per_s']:7.1f} tok/s{vs:20s} {pcts}  (ms p50/p99)"


def plot(prefix: str, table: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for metric in (*METRICS, "output_tokens_per_s"):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for (layout, where), by_rate in table.items():
            rates = sorted(by_rate)
            values = [
                by_rate[r][metric] if metric == "output_tokens_per_s" else by_rate[r][metric]["p50"] for r in rates
            ]
            ax.plot(rates, values, marker="o" if where == "http" else "x", ls="-" if where == "http" else "--")
            ax.lines[-1].set_label(f"{layout} ({where})")
        ax.set(xlabel="arrival rate (requests/s)", ylabel=metric + ("" if metric.endswith("_s") else " [s, p50]"))
        ax.set_title(f"reshard serve: {metric}, {args.nproc} gloo ranks, client-side vs in-process", fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{prefix}-{metric}.png", dpi=100)
        plt.close(fig)


def main() -> None:
    p = parser(__doc__)
    add_sizes(p, SIZES, SMALL)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {list(LAYOUTS)}")
    p.add_argument("--png", default=None, help="write PREFIX-<metric>.png plots")
    p.add_argument("--no-in-process", action="store_true", help="skip bench/online.py's run")
    args = fill_sizes(p.parse_args(), SIZES, SMALL)
    layouts = [x for x in args.layouts.split(",") if x]
    path = checkpoint(args)
    table: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            proc, url = start(layout, path, args, Path(tmp) / layout)
            try:
                asyncio.run(load(url, workload(args, args.rates[0])[:2]))  # warm-up
                for rate in args.rates:
                    results, seconds = asyncio.run(load(url, workload(args, rate)))
                    table.setdefault((layout, "http"), {})[rate] = f = figures(results, seconds)
                    print(line(layout, rate, "http", f, None), file=sys.stderr, flush=True)  # kept if a later one fails
            finally:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(300) == 0, f"{layout}: the server did not drain cleanly"
        inner = {} if args.no_in_process else in_process(args, layouts, Path(tmp) / "online.json")
    for layout, by_rate in inner.items():
        table[layout, "in-process"] = by_rate
    for rate in args.rates:
        print(f"\n-- rate {rate}/s, {args.requests} requests, {args.nproc} ranks")
        for layout in layouts:
            http, own = table[layout, "http"][rate], table.get((layout, "in-process"), {}).get(rate)
            ratio = None if own is None else http["output_tokens_per_s"] / own["output_tokens_per_s"]
            print(line(layout, rate, "http", http, ratio))
            if own is not None:
                print(line(layout, rate, "in-process", own, None))
    if args.png:
        plot(args.png, table, args)
    print(f"\ncommand: {rerun_command('serve.py', None)}")


if __name__ == "__main__":
    main()
