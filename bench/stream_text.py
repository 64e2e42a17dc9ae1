"""A stream's text side in ``reshard serve``: CPU per streamed token of one choice's
:class:`TextCursor` (one event per token, as a decode step sends), decoding the output's tail
(ours, :class:`GrowingText`) against decoding the whole output at every event (the baseline: the
server before it), with and without stop strings, on the built-in byte-level BPE tokenizer.

    python bench/stream_text.py [--lengths 256,1024,4096] [--repeats 3]

Random token ids (characters split across tokens included); the stream's text must equal the
offline text in both. Run it in a session of its own (``setsid``) on a quiet machine.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_sizes, fill_sizes, med, parser, rerun_command

DEFAULTS = {"lengths": [256, 1024, 4096], "repeats": 3}
SMALL = {"lengths": [64, 256], "repeats": 1}
STOPS = ["zq#", "\n\n\n"]  # (strings the random text hardly holds: every event checks them)


def stream(text, prompt: list[int], out: list[int], stop: list[str] | None, whole: bool) -> tuple[float, str]:
    """Seconds to stream ``out`` a token an event (``whole``: every event decodes the whole output)
    and the stream's text."""
    from reshard.parallel import SamplingParams
    from reshard.parallel.serve.text import TextCursor

    cursor = TextCursor(text, SamplingParams(max_tokens=len(out), stop=stop), prompt)
    if whole:
        cursor.growing = cursor.decode
    sent, items = [], []
    t0 = time.perf_counter()
    for token in out:
        items.append((token, None))
        sent.append(cursor.advance(items, None)[0])
    sent.append(cursor.advance(items, "length")[0])
    return time.perf_counter() - t0, "".join(sent)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_sizes(p, DEFAULTS, SMALL)
    args = fill_sizes(p.parse_args(argv), DEFAULTS, SMALL)
    from transformers import AutoTokenizer

    from reshard.parallel.model.tiny_models import save_tokenizer
    from reshard.parallel.serve.text import Text

    directory = Path(tempfile.mkdtemp(prefix="stream-text-"))
    save_tokenizer(directory, 8000)
    text = Text(AutoTokenizer.from_pretrained(directory))
    rng = random.Random(0)
    print(f"# {rerun_command('stream_text.py', one_thread=False, argv=argv)}")
    print(f"{'tokens':>7} {'stops':>6} {'ours us/tok':>12} {'whole us/tok':>13} {'whole/ours':>11}")
    for n in args.lengths:
        prompt, out = [rng.randrange(3, 8000) for _ in range(32)], [rng.randrange(3, 8000) for _ in range(n)]
        for stop in (None, STOPS):
            times: dict[bool, list[float]] = {False: [], True: []}
            texts = set()
            for _ in range(args.repeats):
                for whole in (False, True):
                    seconds, sent = stream(text, prompt, out, stop, whole)
                    times[whole].append(seconds)
                    texts.add(sent)
            assert len(texts) == 1, "the two streams' texts differ"
            ours, base = (1e6 * med(times[w]) / n for w in (False, True))
            print(f"{n:>7} {'yes' if stop else 'no':>6} {ours:>12.1f} {base:>13.1f} {base / ours:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
