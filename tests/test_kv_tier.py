"""CPU KV tier: KV written under one head layout is read under another (re-sharding in the swap)."""

import pytest
import torch

from tests import dist_harness

LAYERS = 2
HEADS = 4
HD = 8
TOKENS = 13


def _global_kv(request_id: int) -> torch.Tensor:
    """(layers, 2, heads, tokens, hd): the KV a request would have, seeded by its id."""
    g = torch.Generator().manual_seed(request_id)
    return torch.randn(LAYERS, 2, HEADS, TOKENS, HD, generator=g)


def _cache(heads_per_rank: int, rank: int):
    from reshard.kv import KVCache, KVSpec

    spec = KVSpec(
        num_layers=LAYERS,
        num_slots=2,
        num_heads=heads_per_rank,
        max_seq_len=32,
        head_dim=HD,
        head_start=(rank * heads_per_rank) % HEADS,
    )
    return KVCache(spec)


def _reshard_through_tier(path: str):
    """TP4 ranks (one KV head each) swap out two requests; TP2 caches (two heads) swap them in."""
    import torch.distributed as dist

    from reshard.kv import CPUKVTier, TierSpec

    rank = dist.get_rank()
    tier = CPUKVTier(TierSpec(LAYERS, HEADS, HD, capacity_tokens=40), path)
    src = _cache(1, rank)
    for slot, rid in enumerate((7, 9)):
        kv = _global_kv(rid)
        for layer in range(LAYERS):
            src.k[layer][slot, :, :TOKENS] = kv[layer, 0, rank : rank + 1]
            src.v[layer][slot, :, :TOKENS] = kv[layer, 1, rank : rank + 1]
        tier.swap_out(src, slot, rid, TOKENS)
    dist.barrier()  # every head written before anyone reads
    dst = _cache(2, rank % 2)  # TP2 layout, replicated twice over the 4 ranks
    ok = []
    for slot, rid in enumerate((9, 7)):
        n = tier.swap_in(dst, slot, rid)
        h0 = dst.spec.head_start
        expect = _global_kv(rid)[:, :, h0 : h0 + 2]
        ok.append(
            n == TOKENS
            and all(
                torch.equal(dst.k[i][slot, :, :n], expect[i, 0]) and torch.equal(dst.v[i][slot, :, :n], expect[i, 1])
                for i in range(LAYERS)
            )
        )
    dist.barrier()
    tier.close(unlink=rank == 0)
    return ok


def test_kv_swapped_out_in_tp4_reads_back_in_tp2(tmp_path):
    results = dist_harness.run(4, _reshard_through_tier, str(tmp_path / "tier.bin"))
    assert all(all(r) for r in results), results  # (per rank: each request read back equal)


def test_mapping_a_short_file_keeps_its_bytes(tmp_path):
    """``map_file`` grows a short (or missing) file with zeros past its end and keeps every byte
    it held: ``torch.from_file`` alone zeroes the first byte when it grows a file, which once
    erased a head's first KV entry that another rank had written while mapping the same new tier
    file (this test's TP4 -> TP2 case, on a loaded machine)."""
    from reshard.shm import map_file

    path = tmp_path / "short.bin"
    path.write_bytes(bytes([7]) * 10)
    mapped = map_file(path, 100)
    assert mapped[:10].tolist() == [7] * 10 and mapped[10:].tolist() == [0] * 90
    assert path.stat().st_size == 100
    assert map_file(tmp_path / "new.bin", 16).tolist() == [0] * 16


def test_allocator_first_fit_and_limits(tmp_path):
    from reshard.kv import CPUKVTier, TierSpec

    tier = CPUKVTier(TierSpec(1, 2, 4, capacity_tokens=10), tmp_path / "t.bin")
    assert tier.allocate(1, 4) == (0, 4) and tier.allocate(2, 3) == (4, 7)
    tier.free(1)
    assert tier.allocate(3, 2) == (0, 2) and tier.free_tokens == 5
    with pytest.raises(MemoryError, match="5 free tokens, 6 needed"):
        tier.allocate(4, 6)
    with pytest.raises(ValueError, match=r"request 5 needs 11 KV tokens but the CPU tier holds 10"):
        tier.allocate(5, 11)
    tier.close(unlink=True)


def test_readers_with_another_layout_are_refused(tmp_path):
    """The layout descriptor is checked when a reader attaches: a layer or tier expecting other
    heads, layers, head dim or dtype gets a ValueError naming both layouts."""
    from reshard.kv import CPUKVTier, KVCache, KVLayout, KVSpec, TierSpec

    cache = KVCache(
        KVSpec(num_layers=2, num_slots=1, num_heads=2, max_seq_len=8, head_dim=HD, head_start=2, first_layer=4)
    )
    cache.attach(KVLayout(5, 1, 2, 2, HD, torch.float32), "layer 5")  # inside: accepted
    for reader in (
        KVLayout(6, 1, 2, 2, HD, torch.float32),  # a layer of another stage
        KVLayout(4, 1, 0, 2, HD, torch.float32),  # other KV heads
        KVLayout(4, 1, 2, 2, HD, torch.bfloat16),
    ):  # other dtype
        with pytest.raises(
            ValueError, match=r"expects KV layout KVLayout\(.*but the cache holds KVLayout\(first_layer=4"
        ):
            cache.attach(reader, "a reader")
    tier = CPUKVTier(TierSpec(num_layers=6, num_kv_heads=3, head_dim=HD, capacity_tokens=8), tmp_path / "t.bin")
    tier.allocate(1, 4)
    with pytest.raises(ValueError, match=r"cannot swap with a CPU tier of 6 layers x 3 KV heads"):
        tier.swap_out(cache, 0, 1, 4)  # heads 2..4 exceed the tier's 3
    tier.close(unlink=True)


def test_a_kv_cache_over_a_shared_memory_file_keeps_its_contents(tmp_path):
    """Built through the cache's constructor: K and V live in the mapped file, so a second
    mapping (a restarted process) reads what the first wrote; storage of the wrong size is refused."""
    from reshard.kv import KVCache, KVSpec
    from reshard.shm import map_file

    spec = KVSpec(num_layers=2, num_slots=2, num_heads=2, max_seq_len=6, head_dim=HD)
    path = tmp_path / "mirror"
    first = KVCache(spec, storage=map_file(path, spec.bytes))
    k, v = torch.randn(2, 5, HD), torch.randn(2, 5, HD)
    first.write_slot(1, 1, k, v)
    again = KVCache(spec, storage=map_file(path, spec.bytes))
    torch.testing.assert_close(again.read_slot(1, 1, 5), (k, v), rtol=0, atol=0)
    assert again.k[0].shape == spec.shape and path.stat().st_size == spec.bytes
    with pytest.raises(ValueError, match=rf"KV cache storage must be {spec.bytes} bytes \(flat uint8\) for KVSpec"):
        KVCache(spec, storage=map_file(path, spec.bytes - 1))


def test_a_published_file_appears_whole_and_is_never_overwritten(tmp_path):
    from reshard.shm import map_file, publish

    data = torch.arange(10, dtype=torch.uint8)
    publish(tmp_path / "region", data)
    assert torch.equal(map_file(tmp_path / "region", 10, shared=False), data)
    with pytest.raises(FileExistsError):
        publish(tmp_path / "region", data + 1)
    assert torch.equal(map_file(tmp_path / "region", 10, shared=False), data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["region"]  # no temporary file left
