"""The parts of the trainer's XLA path that need no torch-xla (they run in the main suite): the
pipeline timetable by neighbour exchanges, the replica-group lists, the static-shape MoE
dispatch against the all-to-all one, and the in-process rendezvous of threaded jobs."""

from __future__ import annotations

import threading

import pytest
import torch

from trainer.exchange import Action, pair_order, rank_orders, sends, timetable

SCHEDULES = [  # (schedule, pp, vpp, micro-batches)
    ("1f1b", 2, 1, 4),
    ("1f1b", 3, 1, 5),
    ("1f1b", 4, 1, 4),
    ("gpipe", 2, 1, 1),
    ("gpipe", 3, 1, 2),
    ("interleaved", 2, 2, 4),
    ("interleaved", 2, 3, 2),
    ("interleaved", 4, 2, 8),
]


@pytest.mark.parametrize("schedule,pp,vpp,n", SCHEDULES)
def test_timetable_runs_every_action_after_its_inputs(schedule, pp, vpp, n):
    """Every forward and backward of every chunk and micro-batch runs once, on its chunk's rank,
    a forward only after the previous chunk's forward, a backward only after its forward and the
    next chunk's backward; 1F1B keeps at most pp micro-batches in flight on a rank."""
    chunks = pp * vpp
    for training in (True, False):
        table = timetable(rank_orders(schedule, pp, vpp, n, training), chunks)
        when: dict[Action, int] = {}
        for tick, row in enumerate(table):
            for rank, a in enumerate(row):
                if a is not None:
                    assert a.chunk % pp == rank and a not in when
                    when[a] = tick
        kinds = (True, False) if training else (True,)
        assert set(when) == {Action(f, c, m) for f in kinds for c in range(chunks) for m in range(n)}
        for a, tick in when.items():
            if a.forward and a.chunk > 0:
                assert when[Action(True, a.chunk - 1, a.micro)] < tick
            if not a.forward:
                assert when[Action(True, a.chunk, a.micro)] < tick
                if a.chunk < chunks - 1:
                    assert when[Action(False, a.chunk + 1, a.micro)] < tick
        if training and schedule == "1f1b":
            for rank in range(pp):
                live = peak = 0
                for row in table:
                    a = row[rank]
                    if a is not None:
                        live += 1 if a.forward else -1
                        peak = max(peak, live)
                assert peak <= pp


def test_exchanges_pair_up_in_one_global_order():
    """A forward's output goes to the next chunk's rank, a backward's gradient to the previous
    one's; every rank meets its neighbours in the one global order of pairs (so no two ranks wait
    for each other in opposite orders)."""
    assert sends(Action(True, 0, 0), 4, 2) == 1 and sends(Action(True, 3, 0), 4, 2) is None
    assert sends(Action(False, 2, 0), 4, 2) == 1 and sends(Action(False, 0, 0), 4, 2) is None
    assert sends(Action(True, 3, 1), 8, 4) == 0  # interleaved: the last rank's chunk feeds rank 0
    assert pair_order(2) == [(0, 1)]
    assert pair_order(4) == [(0, 1), (0, 3), (2, 3), (1, 2)]
    for pp in (3, 4, 5):
        order = pair_order(pp)
        assert sorted(order) == sorted({tuple(sorted((r, (r + 1) % pp))) for r in range(pp)})


def test_replica_group_lists():
    """Sets of one size sharing no rank form one list, completed with the ranks they leave out (XLA's
    CPU runtime wants every device named); a list that cannot be completed is refused."""
    from trainer.comm.xla import meshes
    from trainer.errors import TrainerError

    where, families = meshes([[0, 1], [2, 3], [0, 2], [1, 3]], 4, complete=True)
    assert where == [0, 0, 1, 1] and families == [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]
    where, families = meshes([[0, 3]], 4, complete=True)
    assert families == [[[0, 3], [1, 2]]]
    assert meshes([[0, 3]], 4, complete=False)[1] == [[[0, 3]]]
    with pytest.raises(TrainerError, match="cannot name all 3 devices"):
        meshes([[0, 2]], 3, complete=True)


@pytest.mark.parametrize("capacity", [0.0, 0.5])
def test_static_shape_dispatch_equals_all_to_all_dispatch(capacity):
    """The MoE layer's dense path (every expert on every token, weighted by the routing, zero where
    a token is not routed or its assignment dropped) gives the sparse path's output, gradients and
    statistics (one rank: no exchange)."""
    from shardkit.layout import make_layout
    from shardkit.testing import fixture_config
    from trainer.comm.base import Group
    from trainer.layers import TPContext
    from trainer.model import ModelSpec
    from trainer.moe import MoEBlock, MoEStats

    spec = ModelSpec.from_config(fixture_config("mixtral-tiny"), make_layout())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, 2, spec.dims.hidden_size, generator=gen)
    results = []
    for dense in (False, True):
        stats = MoEStats()
        block = MoEBlock(spec, TPContext(Group([0], 0)), Group([0], 0), capacity, stats, torch.float32, dense=dense)
        block.to_empty(device="cpu")
        for p in block.parameters():
            p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
        xi = x.clone().requires_grad_(True)
        out = block(xi)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        ((s, dropped, routed),) = stats.layers
        results.append((out.detach(), xi.grad, [p.grad for p in block.parameters()], s, int(dropped), routed))
    (o1, g1, p1, s1, d1, r1), (o2, g2, p2, s2, d2, r2) = results
    assert torch.allclose(o1, o2, atol=1e-6) and torch.allclose(g1, g2, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(p1, p2))
    assert torch.equal(s1, s2) and (d1, r1) == (d2, r2)
    assert (d1 > 0) == (capacity > 0)


def test_rendezvous_of_threads():
    """The host side of a threaded job: every rank gets everyone's value in rank order; a rank that
    fails aborts every meeting, so nobody waits for it."""
    from trainer.comm.threads import JobAborted, Rendezvous, ThreadJob

    meeting = Rendezvous(3, timeout=30)
    jobs = [ThreadJob(r, 3, None, meeting) for r in range(3)]
    got: dict[int, list] = {}

    def member(r: int) -> None:
        got[r] = jobs[r].gather(r * 10)
        assert jobs[r].broadcast(f"from {r}") == "from 0"

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {r: [0, 10, 20] for r in range(3)}

    stuck = Rendezvous(2, timeout=30)
    failed: list[BaseException] = []

    def waiter() -> None:
        try:
            stuck.exchange(0, None)
        except JobAborted as e:
            failed.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    stuck.abort(RuntimeError("rank 1 died"))
    t.join(30)
    assert failed and "rank 1 died" in str(failed[0])
    with pytest.raises(JobAborted):
        stuck.exchange(1, None)


# ---- the optimizer's lazy path, on CPU tensors --------------------------------------------------------------


def _trained_weights(lazy: bool, steps: int = 3, algorithm: str = "adamw") -> tuple[dict[str, torch.Tensor], object]:
    """The tiny Llama (one rank, fp32) after `steps` AdamW steps on random tokens with clipping
    engaged, through the optimizer's eager path or its lazy (XLA) one: per-parameter gradients,
    the clipping, the skip of a non-finite step and AdamW as device tensors. Returns the weights
    and the optimizer."""
    import torch.nn.functional as F

    from shardkit.layout import make_layout
    from shardkit.testing import fixture_config
    from trainer.comm.base import Comm
    from trainer.layers import TPContext
    from trainer.model import ModelSpec, StageModel
    from trainer.optim import Optimizer
    from trainer.parallel import init_parallel
    from trainer.weights import init_rank_pieces

    class OneRank(Comm):
        name = "test"

        def _make_groups(self, sets):
            return {}

    cpu = torch.device("cpu")
    comm = OneRank(0, 1, cpu)
    comm.lazy = lazy
    par = init_parallel(1, 1, 1, cpu, 30.0, comm=comm)
    spec = ModelSpec.from_config(fixture_config("llama-trainer-tiny"), make_layout())
    model = StageModel(spec, TPContext(par.tp_group, False), 0, torch.float32, cpu)
    model.load_pieces(init_rank_pieces(spec, 5, 0, 0))
    opt = Optimizer(model, spec, par, lr=1e-2, clip_grad=0.5, weight_decay=0.1, algorithm=algorithm)
    opt.zero_grad()
    ids = torch.randint(0, spec.dims.vocab_size, (steps, 2, 2, 17), generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        for micro in ids[step]:  # two micro-batches accumulate into the gradients
            logits = model(micro[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), micro[:, 1:].t().reshape(-1)).backward()
        opt.step(1e-2 * (step + 1))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


@pytest.mark.parametrize("algorithm", ["adamw", "lamb"])
def test_lazy_optimizer_path_equals_the_eager_one(algorithm):
    """The XLA path's optimizer arithmetic (run here on CPU tensors) gives the eager path's
    weights, and keeps each gradient in a tensor of its own: XLA writes into a view of a buffer
    by a select over the whole buffer, so gradients as views of one flat buffer made a rank's
    graphs, memory and step time grow with parameters x buffer size. LAMB (trainer/lamb.py) too:
    its step count, bias corrections and skip as device tensors."""
    eager, eager_opt = _trained_weights(lazy=False, algorithm=algorithm)
    lazy, lazy_opt = _trained_weights(lazy=True, algorithm=algorithm)
    assert eager.keys() == lazy.keys()
    for name in eager:
        torch.testing.assert_close(lazy[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(eager[name], _trained_weights(lazy=False, steps=0)[0][name]) for name in eager)
    storages = [s.grad.untyped_storage().data_ptr() for s in lazy_opt.slots]
    assert len(set(storages)) == len(storages), "lazy gradients share a buffer"
    assert lazy_opt.flat is None and eager_opt.flat is not None


# ---- where the threaded mode runs ---------------------------------------------------------------------------


def _xla_host(monkeypatch, runtime: str, devices: int) -> None:
    """Pretend torch-xla is installed with `devices` devices of `runtime` visible to this one process."""
    import trainer.comm.xla as xla

    monkeypatch.setattr(xla, "xla_available", lambda: True)
    monkeypatch.setattr(xla, "runtime_type", lambda: runtime)
    monkeypatch.setattr(xla, "local_devices", lambda: devices)
    monkeypatch.setattr(xla, "thread_devices", lambda: [f"xla:{i}" for i in range(devices)])
    monkeypatch.setattr(xla, "runtime_for_threads", lambda devices: None)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_neuron_host_without_torchrun_is_told_to_use_it(monkeypatch, capsys):
    """Several devices in one process are torch-xla's CPU runtime's: a Neuron host running
    `python -m trainer` (no torchrun) with 32 visible NeuronCores gets one line naming torchrun and
    exit code 2, before anything else is read."""
    from trainer.__main__ import main

    _xla_host(monkeypatch, "NEURON", 32)
    code = main(["--model", "/nonexistent", "--data", "/nonexistent", "--device", "xla", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and "torchrun --nproc-per-node 32 -m trainer" in err[0], err


def test_threads_only_on_the_cpu_runtime(monkeypatch):
    """The CPU runtime with 4 devices runs 4 ranks as threads; one Neuron device per process (under
    torchrun, or a single core) runs as a plain rank."""
    from trainer.config import parse_args
    from trainer.loop import _threaded_devices

    cfg = parse_args(["--model", "m", "--data", "d", "--device", "xla"])
    _xla_host(monkeypatch, "CPU", 4)
    assert _threaded_devices(cfg) == ["xla:0", "xla:1", "xla:2", "xla:3"]
    _xla_host(monkeypatch, "NEURON", 1)
    assert _threaded_devices(cfg) == []
