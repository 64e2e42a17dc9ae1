"""Drop-in layers against plain PyTorch / HF modules, and redistribute() round trips."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tests import dist_harness
from tests.tolerance import assert_close_reduced


def _mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def _hf_attention(family, **overrides):
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from reshard.parallel.model.tiny_models import tiny_config

    config = tiny_config(family, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    cls = Qwen3Attention if family == "qwen3" else LlamaAttention
    module = cls(config, 0)
    for p in module.parameters():
        nn.init.normal_(p, std=0.2)
    return config, module, LlamaRotaryEmbedding(config)


def _build(kind, mesh):
    """(our layer, reference module, input) for ``kind``; same weights on every rank."""
    from reshard.layers import ParallelAttention, ParallelLinear, SwiGLUMLP, VocabParallelEmbedding

    torch.manual_seed(0)
    if kind in ("colwise", "rowwise"):
        ref = nn.Linear(32, 24)
        pl = (Shard(0),) if kind == "colwise" else (Shard(1),)
        return ParallelLinear(32, 24, mesh=mesh, placements=pl, gather_output=True), ref, torch.randn(3, 5, 32)
    if kind == "embedding":
        ref = nn.Embedding(50, 16)  # 50 rows: uneven shards on 4 ranks
        return VocabParallelEmbedding(50, 16, mesh=mesh), ref, torch.randint(0, 50, (3, 7))
    if kind == "mlp":
        from transformers.models.llama.modeling_llama import LlamaMLP

        from reshard.parallel.model.tiny_models import tiny_config

        ref = LlamaMLP(tiny_config("llama"))
        return SwiGLUMLP(64, 128, mesh=mesh), ref, torch.randn(2, 6, 64)
    family, kv = {"attention": ("llama", 4), "attention-gqa": ("llama", 2), "attention-qk-norm": ("qwen3", 1)}[kind]
    config, ref, rope = _hf_attention(family, num_key_value_heads=kv)
    ours = ParallelAttention(
        64, 4, kv, ref.head_dim, mesh=mesh, qk_norm=family == "qwen3", rms_norm_eps=config.rms_norm_eps
    )
    return ours, (ref, rope), torch.randn(2, 9, 64)


def _run(layer, ref, x, kind):
    """(our output, reference output); attention gets HF's rotary embeddings."""
    if kind.startswith("attention"):
        hf, rope = ref
        emb = rope(x, torch.arange(x.shape[1])[None].expand(x.shape[0], -1))
        return layer(x, emb)[0], hf(x, emb, None)[0]
    return layer(x), ref(x)


def _float64(ref, x, kind):
    """The reference module and input in float64 (token ids stay integers): the exact result that
    sharded and unsharded fp32 runs both round away from."""
    if kind.startswith("attention"):
        hf, rope = ref
        x64 = x.double()
        emb = rope(x64, torch.arange(x.shape[1])[None].expand(x.shape[0], -1))
        return copy.deepcopy(hf).double()(x64, emb, None)[0]
    return copy.deepcopy(ref).double()(x.double() if x.is_floating_point() else x)


def _roundtrip(kind):
    from reshard.parallel.model.parallelize import copy_full_state

    mesh = _mesh()
    layer, ref, x = _build(kind, mesh)
    ref_module = ref[0] if isinstance(ref, tuple) else ref
    full = {k: v.detach().clone() for k, v in ref_module.state_dict().items()}
    copy_full_state(layer, full)
    if kind == "rowwise":  # rowwise input is this rank's Shard(-1) of x
        import torch.distributed as dist

        xs = x.chunk(dist.get_world_size(), -1)[dist.get_rank()]
    with torch.no_grad():
        if kind == "rowwise":
            sharded, expected = layer(xs), ref(x)
        else:
            sharded, expected = _run(layer, ref, x, kind)
        layer.redistribute(mesh, [Replicate()])
        replicated = _run(layer, ref, x, kind)[0]
        layer.redistribute(mesh, [Shard(0)] if kind != "rowwise" else [Shard(1)])
        back = layer(xs) if kind == "rowwise" else _run(layer, ref, x, kind)[0]
        expected64 = _float64(ref, x, kind)
    weights_back = {k: v.full_tensor() for k, v in layer.state_dict().items()}
    return sharded, replicated, back, (expected, expected64), weights_back, full


LAYERS = ["colwise", "rowwise", "embedding", "mlp", "attention", "attention-gqa", "attention-qk-norm"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", LAYERS)
def test_layer_matches_reference_and_round_trips(kind, world):
    for sharded, replicated, back, (expected, expected64), weights_back, full in dist_harness.run(
        world, _roundtrip, kind
    ):
        assert_close_reduced(sharded, expected, expected64, msg=f"{kind} sharded")
        assert_close_reduced(replicated, expected, expected64, msg=f"{kind} replicated")
        assert torch.equal(back, sharded)  # TP -> replicated -> TP: identical outputs
        assert weights_back.keys() == full.keys()  # same state-dict keys as the HF module
        for k in full:
            assert torch.equal(weights_back[k], full[k])


def _embedding_through_moves():
    """A vocab-parallel embedding moved twice between forwards, twenty times: Shard(0) on the mesh
    -> Replicate -> Shard(0) on the reversed mesh (every rank's vocab range changes) -> Replicate
    -> Shard(0) on the mesh. The rows each rank looks up must follow the weight now in place: its
    range was once cached under ``id(weight)``, which the weight two moves later took over in
    this very sequence (3 of 20 forwards wrong on each rank; in CI, wrong logits after a TP2 x DP2
    move)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from reshard import redistribute_module
    from reshard.layers import VocabParallelEmbedding
    from reshard.parallel.model.parallelize import copy_full_state

    world = dist.get_world_size()
    meshes = [DeviceMesh("cpu", torch.arange(world)), DeviceMesh("cpu", torch.arange(world).flip(0))]
    torch.manual_seed(0)
    ref, ids = nn.Embedding(50, 16), torch.randint(0, 50, (3, 7))
    layer = VocabParallelEmbedding(50, 16, mesh=meshes[0])
    copy_full_state(layer, {"weight": ref.weight.detach()})
    exact = []
    for step in range(20):
        with torch.no_grad():
            exact.append(torch.equal(layer(ids), ref(ids)))
        here, there = meshes[step % 2], meshes[(step + 1) % 2]
        redistribute_module(layer, {"weight": (here, (Replicate(),))})
        redistribute_module(layer, {"weight": (there, (Shard(0),))})
    return exact


def test_embedding_follows_its_weight_through_every_move():
    for exact in dist_harness.run(2, _embedding_through_moves):
        assert all(exact), exact


def _weight_selection():
    """A layer with an alternative source (its weight doubled): eager and compiled forwards follow
    the selection of the thread that runs them, and only for the enclosed forwards."""
    import threading

    from torch.distributed.tensor import DTensor

    from reshard.layers import ParallelLinear
    from reshard.layers.weights import LinearWeights, StaticWeights, active_source, use_weights

    torch.manual_seed(0)
    layer = ParallelLinear(16, 8, mesh=_mesh(), placements=(Replicate(),))  # no collective to trace
    for p in layer.parameters():
        nn.init.normal_(p.to_local())
    doubled = DTensor.from_local(2 * layer.weight.to_local().detach(), layer.mesh, (Replicate(),))
    layer.sources["alt"] = StaticWeights(LinearWeights(doubled, layer.bias, "sharded"))
    x = torch.randn(3, 16)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)  # Dynamo's guards, no codegen
    seen, out = [], []
    with torch.no_grad():
        full_w, full_b = layer.weight.full_tensor(), layer.bias.full_tensor()
        own, alt = x @ full_w.T + full_b, x @ (2 * full_w).T + full_b
        for source in (None, "alt", None, "alt"):
            with use_weights(source):
                out.append((layer(x), compiled(x)))
        with use_weights("alt"):
            thread = threading.Thread(target=lambda: seen.append((active_source(), layer(x).detach())))
            thread.start()
            thread.join()
            nested = [active_source()]
            with use_weights(None):
                nested.append(active_source())
            nested.append(active_source())
    return own, alt, out, seen, nested, active_source()


def test_weight_source_follows_the_forwards_thread_and_compiled_guards():
    for own, alt, out, seen, nested, after in dist_harness.run(2, _weight_selection):
        for (eager, compiled), want in zip(out, (own, alt, own, alt)):
            torch.testing.assert_close(eager, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(compiled, eager)
        [(thread_source, thread_out)] = seen
        assert thread_source is None  # another thread does not inherit the selection
        torch.testing.assert_close(thread_out, own, rtol=1e-5, atol=1e-5)
        assert nested == ["alt", None, "alt"] and after is None


def _collectives_by_mode():
    """The functional collectives a TP MLP's forward calls (row-parallel all-reduce) and its
    outputs, once without gradients (eager inference: c10d's own collective, none of these) and
    once with a gradient flowing (the functional, autograd-carrying one), beside the unsharded
    MLP's outputs and the weights' gradients."""
    from unittest import mock

    from reshard.layers import _comm
    from reshard.parallel.model.parallelize import copy_full_state

    mesh = _mesh()
    layer, ref, x = _build("mlp", mesh)
    copy_full_state(layer, {k: v.detach().clone() for k, v in ref.state_dict().items()})
    calls = []
    real = _comm.funcol.all_reduce

    def counted(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    with mock.patch.object(_comm.funcol, "all_reduce", counted):
        with torch.no_grad():
            x_before = x.clone()
            eager, eager_ref = layer(x), ref(x)
            untouched = torch.equal(x, x_before)
        eager_calls = len(calls)
        trained = layer(x)
        trained.sum().backward()
    ref(x).sum().backward()
    grads = (layer.down_proj.weight.grad.full_tensor(), ref.down_proj.weight.grad)
    outputs = (eager, eager_ref), (trained.detach(), ref(x).detach())
    return eager_calls, len(calls) - eager_calls, *outputs, grads, untouched


def test_an_eager_inference_forward_sums_with_c10d_and_a_trained_one_with_the_functional_collective():
    for eager_calls, trained_calls, eager, trained, grads, untouched in dist_harness.run(2, _collectives_by_mode):
        assert eager_calls == 0 and trained_calls == 1  # (the MLP's one row-parallel all-reduce)
        torch.testing.assert_close(*eager)
        torch.testing.assert_close(*trained)
        torch.testing.assert_close(*grads)
        assert untouched  # the in-place sum wrote the partial output, never the layer's input
