"""A paged cache's full KV blocks found by the tokens they hold: prompts computed once.

vLLM's automatic prefix caching, per data-parallel replica of one layout. A full block's key is
``hash((parent key, its tokens))``, the first block's parent being the cache's root, which the
weights' version names: KV computed under other weights never matches (:meth:`PrefixCache.reset`
gives a new root). Every rank keeps the same books (the scheduler's decisions are the same on
every rank), so every rank shares alike.

- A request's admission matches the longest run of its prompt's full blocks that are cached
  (never the whole prompt: its last token is computed, for its logits) and holds them; its
  ``num_computed_tokens`` starts after them. Its other full prompt blocks are keyed at once but
  *pending*: a later request that would share one waits until it is computed (``n`` samples of
  one prompt: the first computes it, the others then share it).
- A block a decode fills is keyed once computed, so a chat's next turn matches its output too.
- Blocks are reference-counted; a keyed block no sequence holds stays cached (idle) until a
  block is needed and none is free: the least recently used idle block is evicted.
- The last, partial block of a sequence is never shared.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Sequence as Seq

ROUTE_BLOCK = 16  # tokens per key of the router's record of prefixes (whatever the groups' block size)
ROUTE_KEYS = 1 << 16  # keys the router keeps per group (least recently sent dropped first)

WAIT = -1  # a match that runs into a block still being computed: the request waits for it


def block_keys(tokens: Seq[int], block_size: int, count: int, parent: int, first: int = 0) -> list[int]:
    """Keys of full blocks ``first .. first + count - 1`` of ``tokens``: each
    ``hash((its parent's key, its tokens))``, block ``first - 1``'s key being ``parent``."""
    keys = []
    for i in range(first, first + count):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys


class PrefixCache:
    """Keys, reference counts and idle blocks of every replica's pool (``free``: the pool's free
    lists, shared with its :class:`reshard.parallel.engine.slots.SlotPool`)."""

    def __init__(self, free: list[list[int]], block_size: int) -> None:
        self.free, self.block_size = free, block_size
        replicas = range(len(free))
        self.blocks: list[dict[int, int]] = [{} for _ in replicas]  # key -> block
        self.keys: list[dict[int, int]] = [{} for _ in replicas]  # block -> key
        self.refs: list[defaultdict[int, int]] = [defaultdict(int) for _ in replicas]  # block -> holders
        self.idle: list[OrderedDict[int, None]] = [OrderedDict() for _ in replicas]  # least recently used first
        self.pending: list[set[int]] = [set() for _ in replicas]  # keyed, not computed yet
        self.root = hash(("reshard.prefix", 0))

    def chain(self, tokens: Seq[int], count: int, parent: int | None = None, first: int = 0) -> list[int]:
        """Keys of full blocks ``first .. first + count - 1`` of ``tokens`` (``parent``: the key
        of block ``first - 1``; the root for block 0)."""
        return block_keys(tokens, self.block_size, count, self.root if parent is None else parent, first)

    def match(self, replica: int, keys: list[int]) -> list[int] | int:
        """Blocks of the longest cached run of ``keys`` from the first; :data:`WAIT` if that run
        stops at a block still being computed."""
        found = []
        for key in keys:
            block = self.blocks[replica].get(key)
            if block is None:
                break
            if block in self.pending[replica]:
                return WAIT
            found.append(block)
        return found

    def available(self, replica: int, holding: list[int]) -> int:
        """Blocks a request holding ``holding`` (matched, not taken yet) can take: free and idle ones."""
        idle = self.idle[replica]
        return len(self.free[replica]) + len(idle) - sum(b in idle for b in holding)

    def hold(self, replica: int, blocks: list[int]) -> None:
        """A sequence shares ``blocks`` (matched): none of them is idle any more."""
        for block in blocks:
            self.refs[replica][block] += 1
            self.idle[replica].pop(block, None)

    def take(self, replica: int) -> int:
        """A block for a sequence's own KV: a free one, else the least recently used idle one
        (its key dropped)."""
        if self.free[replica]:
            block = self.free[replica].pop()
        else:
            block, _ = self.idle[replica].popitem(last=False)
            del self.blocks[replica][self.keys[replica].pop(block)]
        self.refs[replica][block] += 1
        return block

    def key(self, replica: int, block: int, key: int, *, pending: bool) -> None:
        """``block`` holds the KV of ``key`` (being computed: ``pending``); a key some other
        block holds already stays with that one."""
        if key in self.blocks[replica]:
            return
        self.blocks[replica][key], self.keys[replica][block] = block, key
        if pending:
            self.pending[replica].add(block)

    def computed(self, replica: int, blocks: Seq[int]) -> None:
        """``blocks``' KV is computed: requests that share them may run."""
        self.pending[replica].difference_update(blocks)

    def release(self, replica: int, blocks: Seq[int]) -> None:
        """A sequence gives ``blocks`` back: one no sequence holds any more stays cached (idle)
        if its KV is computed and keyed, else it is free again."""
        for block in blocks:
            self.refs[replica][block] -= 1
            if self.refs[replica][block] > 0:
                continue
            del self.refs[replica][block]
            if block in self.keys[replica] and block not in self.pending[replica]:
                self.idle[replica][block] = None
                continue
            self._unkey(replica, block)
            self.free[replica].append(block)

    def reset(self, version: int) -> None:
        """Forget every key (weights of ``version`` make other KV): idle blocks are free again."""
        for replica, idle in enumerate(self.idle):
            self.free[replica].extend(idle)
            idle.clear()
            self.blocks[replica].clear()
            self.keys[replica].clear()
            self.pending[replica].clear()
        self.root = hash(("reshard.prefix", version))

    def _unkey(self, replica: int, block: int) -> None:
        key = self.keys[replica].pop(block, None)
        if key is not None:
            del self.blocks[replica][key]
        self.pending[replica].discard(block)


class PrefixRoutes:
    """Which prompt prefixes each engine group was sent (SGLang's cache-aware routing): the
    router sends a request to the group that was sent the longest run of its prompt's first
    blocks, load permitting, where that group has most likely cached their KV."""

    def __init__(self) -> None:
        self.sent: defaultdict[str, OrderedDict[int, None]] = defaultdict(OrderedDict)
        self.routed = 0  # requests placed by a prefix some group had been sent

    def keys(self, prompt: Seq[int]) -> list[int]:
        """Keys of the prompt's full blocks of :data:`ROUTE_BLOCK` tokens, each its prefix's."""
        return block_keys(prompt, ROUTE_BLOCK, len(prompt) // ROUTE_BLOCK, parent=0)

    def matched(self, group: str, keys: list[int]) -> int:
        """How many of ``keys``, from the first, ``group`` was sent."""
        seen = self.sent[group]
        return next((i for i, key in enumerate(keys) if key not in seen), len(keys))

    def record(self, group: str, keys: list[int]) -> None:
        """``group`` was sent a prompt of ``keys``."""
        seen = self.sent[group]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > ROUTE_KEYS:
            seen.popitem(last=False)
