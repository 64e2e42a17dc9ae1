"""The CUDA path cannot drift unseen: a static scan of the library for tensors placed without a device.

No test here can run NCCL, and on gloo every tensor lives on the CPU, so a tensor created without a
device (or moved to a hard-coded one) passes every test here and lands on the wrong device under
NCCL. The scan walks the library's source (``ast``) and names every such call as ``file:line: call``.

What needs a device (an offender unless it says where the tensor goes):
- a tensor factory (``torch.empty``, ``zeros``, ``ones``, ``full``, ``arange``, ``tensor``, ``rand*``,
  ``eye``, ``linspace``, ``empty_strided``, ...) without a ``device=`` keyword. A factory is fine
  when its device comes from somewhere: ``device=`` (from a mesh, a tensor or a config), the
  ``*_like``/``new_*`` forms (they inherit their argument's device), ``pin_memory=True`` (pinned host
  staging is the CPU by definition), a chained ``.to(<device>)``, or a result read straight back on
  the host (``.tolist()``, ``.item()``, ``.element_size()``, ``.numpy()``, through view-only steps);
- ``.cuda()`` and ``.cpu()``: a move to a device named by the code, not by the mesh;
- a literal device anywhere: ``device="cpu"`` (a keyword, or a parameter's default),
  ``.to("cuda")``, ``torch.device("cpu")``.
``torch.from_numpy``/``frombuffer`` wrap host memory and take no device: the caller moves the result.

What may stay on the CPU is listed in ``ALLOWED`` by function (``module:function``) with the reason.
The test also fails on an entry that matches nothing, so the list cannot outlive the code it excuses.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("reshard", "layers", "parallel", "recipes")

# Factories that place a new tensor: without ``device=`` they land on the default device (the CPU).
FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "arange",
        "range",
        "tensor",
        "as_tensor",
        "scalar_tensor",
        "rand",
        "randn",
        "randint",
        "randperm",
        "normal",
        "eye",
        "linspace",
        "logspace",
        "empty_strided",
        "tril_indices",
        "triu_indices",
    }
)
# Read back on the host: the tensor is host metadata by construction (an element size, a rank list).
HOST_READS = frozenset({"tolist", "item", "element_size", "numpy", "tobytes"})
# Steps that keep a tensor where it is, looked through on the way to a host read or a ``.to()``.
VIEWS = frozenset({"view", "reshape", "flatten", "contiguous", "long", "int", "float", "t", "unsqueeze", "squeeze"})
DEVICE_NAMES = frozenset({"cpu", "cuda", "mps", "xpu"})  # not "meta": a meta tensor holds no data

# module:function -> why the CPU is right there. Keep it short: fix a device bug rather than list it.
_CALIBRATION = "calibration times this host's CPU threads and its gloo link (the cost model's CPU inputs)"
ALLOWED: dict[str, str] = {
    "reshard.parallel.fault.host:MirrorHost.__init__": (
        "a supervisor's mirror of its engine child's KV lives in host memory: it outlives the child and its device"
    ),
    "reshard.parallel.model.offload:HostWeights.__init__": (
        "LLM.release(weights=True) moves the weights to host memory: the point of it (pinned on CUDA)"
    ),
    "reshard.mesh:rank_tensor": "rank grids are host metadata: DeviceMesh keeps its ranks on the CPU",
    "reshard.layout:Layout._strided_range": "a layout is a pure description: its index math runs on the host",
    "reshard.parallel.cost.transitions:_layout": (
        "the cost model plans transitions between layouts of GPUs it does not have: their rank grids are host metadata"
    ),
    "reshard.kv.context:AttentionContext._build": (
        "a prefill's index math runs on the host from Python lists (no device sync for its sizes); "
        "every tensor it returns is moved to the cache's device"
    ),
    "reshard.kv.disk:DiskKVTier.swap_out": "the disk tier writes safetensors, which reads host memory",
    "reshard.kv.transport:FileTransport._write": "the file transport writes safetensors, which reads host memory",
    "reshard.parallel.cost.calibrate:measure_flops": _CALIBRATION,
    "reshard.parallel.cost.calibrate:measure_mem_bw": _CALIBRATION,
    "reshard.parallel.cost.calibrate:_time_collective": _CALIBRATION,
    "reshard.parallel.engine.sampling:sample_tokens": (
        "a step's tokens go to the host, where the engine agrees on them and appends them to its sequences"
    ),
    "reshard.parallel.engine.penalties:Growing.__init__": (
        "a sequence's penalty tokens are host bookkeeping kept a token at a time; a step moves them once for its rows"
    ),
    "reshard.parallel.engine.sampling:token_logprobs": (
        "log-probabilities are agreed with the tokens, which are assembled on the host beside the sampler"
    ),
    "reshard.parallel.engine.agree:sample_step": (
        "a step's tokens are assembled on the host beside the sampler; agree_tokens moves them for the all-reduce"
    ),
    "reshard.parallel.engine.runner:ModelRunner._micro_batch_swap": (
        "micro-batch swapping keeps every slot's KV in host memory"
    ),
    "reshard.shm:map_file": "a mapped shared-memory file is host memory (CPU KV tier, KV mirrors, weight store)",
    "reshard.parallel.fault.link:Link.send": "a mirror link is a gloo group of its own: it carries host tensors",
    "reshard.parallel.fault.link:Link.recv": (
        "a mirror link is a gloo group of its own: what lands is moved to the mirror cache's device"
    ),
}


@dataclass(frozen=True)
class Offender:
    path: str
    line: int
    function: str
    call: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.call} (in {self.function})"


def _is_torch(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "torch"


def _literal_device(node: ast.expr) -> bool:
    """``"cpu"``, ``"cuda:0"``: a device the code names itself (``torch.device("cpu")`` is a call of its own)."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] in DEVICE_NAMES


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


class _Scan(ast.NodeVisitor):
    """Collects offenders of one module, each with the qualified name of its enclosing function."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.found: list[Offender] = []
        self.parents: dict[ast.AST, ast.AST] = {}

    def scan(self, tree: ast.Module) -> list[Offender]:
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.visit(tree)
        return self.found

    def _enter(self, node) -> None:
        self.scope.append(node.name)
        if not isinstance(node, ast.ClassDef):
            self._defaults(node.args)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def _defaults(self, args: ast.arguments) -> None:
        """A ``device="cpu"`` default: every caller that leaves it out lands on that device."""
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        for arg, default in pairs:
            if arg.arg == "device" and _literal_device(default):
                call = f"default device={ast.unparse(default)}"
                self.found.append(Offender(self.path, default.lineno, ".".join(self.scope), call))

    def visit_Call(self, node: ast.Call) -> None:
        why = self._offence(node)
        if why:
            fn = ".".join(self.scope) or "<module>"
            self.found.append(Offender(self.path, node.lineno, fn, why))
        self.generic_visit(node)

    def _offence(self, node: ast.Call) -> str | None:
        f = node.func
        device = _keyword(node, "device")
        if device is not None and _literal_device(device):
            return f"device={ast.unparse(device)}"
        if not isinstance(f, ast.Attribute):
            return None
        if _is_torch(f.value) and f.attr == "device" and node.args and _literal_device(node.args[0]):
            return ast.unparse(node)
        if _is_torch(f.value) and f.attr in FACTORIES:
            return None if self._placed(node) else f"torch.{f.attr}(...) without device="
        if f.attr == "cuda" or (f.attr == "cpu" and not self._read_on_host(node)):
            return f".{f.attr}()"
        if f.attr == "to" and node.args and _literal_device(node.args[0]):
            return f".to({ast.unparse(node.args[0])})"
        return None

    def _placed(self, node: ast.Call) -> bool:
        """A factory with a device: ``device=``, pinned, moved by a chained ``.to()``, or read on the host."""
        if _keyword(node, "device") is not None:
            return True
        pin = _keyword(node, "pin_memory")
        if isinstance(pin, ast.Constant) and pin.value is True:
            return True
        return self._read_on_host(node, moved_ok=True)

    def _read_on_host(self, node: ast.Call, *, moved_ok: bool = False) -> bool:
        """The result goes straight to a host read (or, ``moved_ok``, a ``.to(<device>)``), through views."""
        here: ast.AST = node
        while True:
            attr = self.parents.get(here)
            if isinstance(attr, ast.Subscript) and attr.value is here:
                here = attr
                continue
            call = self.parents.get(attr)
            if not (isinstance(attr, ast.Attribute) and isinstance(call, ast.Call) and call.func is attr):
                return False
            if attr.attr in HOST_READS:
                return True
            if attr.attr == "to" and moved_ok and (call.args or _keyword(call, "device")):
                return not all(_is_dtype(a) for a in call.args)
            if attr.attr not in VIEWS:
                return False
            here = call


def _is_dtype(node: ast.expr) -> bool:
    """``torch.long`` and the like: a ``.to()`` that changes the dtype only."""
    return isinstance(node, ast.Attribute) and _is_torch(node.value)


def scan_library(root: Path = ROOT) -> list[Offender]:
    found: list[Offender] = []
    for top in LIBRARY:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            found += _Scan(rel).scan(ast.parse(path.read_text(), filename=rel))
    return found


def _key(o: Offender) -> str:
    """``module:function`` by import name: ``layers/x.py`` is ``reshard.layers.x``."""
    module = o.path.removesuffix(".py").replace("/", ".")
    return f"{module if module.startswith('reshard.') else 'reshard.' + module}:{o.function}"


def test_scanner_finds_what_it_should():
    """The rules on a sample: each offender kind is caught, each placed form is let through."""
    src = """
import torch
def bad(x, n):
    a = torch.zeros(n)
    b = torch.tensor([1, 2])
    c = x.cpu()
    d = x.cuda()
    e = x.to("cuda")
    f = torch.empty(n, device="cpu")
    g = x.to(torch.device("cpu"))
    h = torch.arange(n).to(torch.long)
    i = x.to(device="cpu")
    j = torch.device("cuda")
def bad_default(x, device="cpu", *, other=None):
    pass
def good(x, n, device=None, *, dtype="cpu"):
    a = torch.zeros(n, device=device)
    b = torch.empty_like(x)
    c = x.new_zeros(n)
    d = torch.tensor([1, 2]).to(device)
    e = torch.empty((), dtype=x.dtype).element_size()
    f = torch.arange(n).view(2, -1).tolist()
    g = torch.empty(n, pin_memory=True)
    h = x.to(torch.float32)
    i = x.to(device, non_blocking=True)
    j = torch.zeros(n, device=x.device)
    k = x.cpu().contiguous().numpy()
    m = torch.from_numpy(x.numpy())
    with torch.device("meta"):
        pass
"""
    found = _Scan("sample.py").scan(ast.parse(src))
    expected = [("bad", i) for i in range(4, 14)] + [("bad_default", 14)]
    assert [(o.function, o.line) for o in found] == expected, [str(o) for o in found]


def test_library_places_every_tensor():
    found = scan_library()
    offenders = [str(o) for o in found if _key(o) not in ALLOWED]
    assert not offenders, "tensors placed without a device (pass device= from a mesh, a tensor or a config):\n" + (
        "\n".join(offenders)
    )


def test_allow_list_is_not_stale():
    used = {_key(o) for o in scan_library()}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that match no call any more (delete them): {stale}"
    assert all(reason.strip() for reason in ALLOWED.values()), "every ALLOWED entry states its reason"
