"""The trainer's groups on XLA against the ones NxD's own `parallel_state` builds.

fixtures/nxd-replica-groups/groups.json holds, per layout, the group lists NxD's
`initialize_model_parallel` (and `initialize_kv_group`) made and every rank's coordinates as NxD's
getters give them, recorded by running NxD's code (tests/support/nxd_groups_ref.py; the folder's README
says from which commit). For every rank of every layout the trainer is started as on that
platform (the same environment NxD reads) and must create the same lists, in the same order,
and stand at the place NxD's lists give it: its generic layout, Trn1's strided tp 4 groups and
Trn2's LOGIC2 ones; where NxD builds nothing (or groups that do not fit together), the trainer
refuses the layout."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from shardkit.testing import FIXTURES
from trainer.comm.base import Comm, Group
from trainer.errors import TrainerError
from trainer.exchange import ExchangePipeline
from trainer.parallel import PLATFORM_ENV, init_parallel, nxd_lnc, nxd_platform

NXD = json.loads((FIXTURES / "nxd-replica-groups" / "groups.json").read_text())
CASES = NXD["cases"]
BUILT = sorted(name for name, case in CASES.items() if "error" not in case)
REFUSED = sorted(name for name, case in CASES.items() if "error" in case)
ENV = ("LOCAL_WORLD_SIZE", "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_VIRTUAL_CORE_SIZE", "NEURON_PLATFORM_TARGET_OVERRIDE")


class Recorder(Comm):
    """One rank of an XLA job that records every list of groups it is asked for, as given."""

    name = "xla"
    keeps_order = True

    def __init__(self, rank: int, world: int):
        super().__init__(rank, world, torch.device("cpu"))
        self.lists: list[list[list[int]]] = []

    def new_groups(self, rank_sets):
        sets = [list(s) for s in rank_sets]
        self.lists.append(sets)
        return super().new_groups(sets)

    def _make_groups(self, sets):
        return {frozenset(s): Group(list(s), list(s).index(self.rank)) for s in sets if self.rank in s}


def as_platform(monkeypatch: pytest.MonkeyPatch, case: dict) -> None:
    """The environment NxD's choice reads on `case`'s machine (and nothing else that could)."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(PLATFORM_ENV, case["platform"])
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(case["lnc"]))
    if case["local_world_size"] is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(case["local_world_size"]))


def start(case: dict, rank: int):
    comm = Recorder(rank, case["world"])
    par = init_parallel(case["tp"], case["pp"], case["dp"], comm.device, 1.0, case["ep"], comm=comm)
    return par, comm


def where(rank: int, groups: list[list[int]]) -> tuple[list[int], int]:
    group = next(g for g in groups if rank in g)
    return group, group.index(rank)


def several(groups: list[list[int]]) -> list[list[int]]:
    return [g for g in groups if len(g) > 1]


@pytest.mark.parametrize("name", BUILT)
def test_groups_and_places_are_nxds(name, monkeypatch):
    """The same tp, dp, pp, ep and expert-dp lists as NxD (each list in NxD's order, each group's
    ranks in NxD's order), every rank's group objects ranked as in those lists, and every rank's
    coordinates NxD's."""
    case = CASES[name]
    nxd = case["groups"]
    as_platform(monkeypatch, case)
    expert = case["ep"] > 1
    # NxD's expert-dp lists without experts: its generic reshape of the ranks, which under LOGIC2
    # are not its dp groups (NxD's grads.py reduces over them); the trainer's are its dp groups
    edp = nxd["edp"] if expert or case["logic"] == "LOGIC1" else nxd["dp"]
    if case["logic"] == "LOGIC2" and case["dp"] > 1:
        assert several(nxd["edp"]) != several(nxd["dp"])
    kinds = [("tp", nxd["tp"]), ("pp", nxd["pp"]), ("dp", nxd["dp"])]
    for rank in range(case["world"]):
        par, comm = start(case, rank)
        tp, pp, dp = comm.lists[0], comm.lists[1], comm.lists[2]
        if rank == 0:
            assert tp == nxd["tp"]
            assert several(pp) == several(nxd["pp"]) and several(dp) == several(nxd["dp"])
            if expert:
                assert comm.lists[-2:] == [nxd["ep"], nxd["edp"]]
        mine = {"tp": par.tp_group, "pp": par.pp_group, "dp": par.dp_group, "edp": par.edp_group}
        for kind, groups in [*kinds, ("edp", edp)]:
            group, index = where(rank, groups)
            if len(group) > 1:
                assert (mine[kind].ranks, mine[kind].rank) == (group, index), (kind, rank)
        if expert:
            assert (par.ep_group.ranks, par.ep_group.rank) == where(rank, nxd["ep"])
        # NxD's coordinates (its tp getter is torch's rank in the sorted group, which is the place in
        # its list wherever the list is ascending: every case but Trn2's one tp group per node)
        got = {"dp": par.dp_rank, "pp": par.pp_rank, "tp": par.tp_rank, "ep": par.ep_rank, "edp": par.edp_rank}
        expected = dict(case["coords"][rank])
        expected["tp"] = where(rank, nxd["tp"])[1]
        if not expert:
            expected["ep"], expected["edp"] = 0, expected["dp"]
        assert got == expected, rank
        assert par.global_rank(par.dp_rank, par.pp_rank, par.tp_rank) == rank


def test_nxd_tp_getter_disagrees_with_its_list_only_where_the_list_is_not_ascending():
    """The one place the trainer's tp rank is not NxD's getter's: Trn2 LOGIC2 with a whole node
    per tp group (rows 0, 3, 1, 2), where NxD's tp rank (torch's, in sorted order) is not the
    rank's place in the replica group NxD's collectives use; the trainer follows the list."""
    differ = {
        name
        for name in BUILT
        for rank, coords in enumerate(CASES[name]["coords"])
        if coords["tp"] != where(rank, CASES[name]["groups"]["tp"])[1]
    }
    assert differ == {"trn2-lnc2-tp32-dp2-lws32"}


@pytest.mark.parametrize("name", [n for n in BUILT if CASES[n]["pp"] > 1])
def test_pipeline_neighbours_are_nxds(name, monkeypatch):
    """The pipeline's two-rank exchange groups pair the ranks NxD's next / previous groups pair."""
    case = CASES[name]
    as_platform(monkeypatch, case)
    par, comm = start(case, 0)
    ExchangePipeline._pair_groups(SimpleNamespace(par=par))
    nxd = {frozenset(p) for p in case["groups"]["pp_next"] + case["groups"]["pp_prev"]}
    assert {frozenset(p) for p in comm.lists[-1]} == nxd


@pytest.mark.parametrize("name", REFUSED)
def test_layouts_nxd_cannot_build_are_refused(name, monkeypatch):
    case = CASES[name]
    as_platform(monkeypatch, case)
    with pytest.raises(TrainerError, match=PLATFORM_ENV):
        start(case, 0)
    monkeypatch.setenv(PLATFORM_ENV, "generic")  # the way out the message names
    par, comm = start(case, 0)
    assert comm.lists[0][1] == list(range(case["tp"], 2 * case["tp"]))


def test_how_the_platform_and_lnc_are_chosen(monkeypatch):
    """TRAINER_NXD_PLATFORM, else NEURON_PLATFORM_TARGET_OVERRIDE (NxD's names: trn1n and inf2 are
    Trn1), else torch-neuronx's answer; without any (torch-xla's CPU runtime) NxD's generic layout.
    LNC: NEURON_LOGICAL_NC_CONFIG, else NEURON_RT_VIRTUAL_CORE_SIZE, else 2 on Trn2/Trn3."""
    for name in (*ENV, PLATFORM_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "torch_neuronx", None)  # not installed
    assert nxd_platform() is None
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1n")
    assert nxd_platform() == "trn1"
    monkeypatch.setenv(PLATFORM_ENV, "generic")
    assert nxd_platform() is None
    monkeypatch.setenv(PLATFORM_ENV, "trn2")
    assert nxd_platform() == "trn2" and nxd_lnc("trn2") == 2 and nxd_lnc("trn1") == 1
    monkeypatch.setenv("NEURON_RT_VIRTUAL_CORE_SIZE", "1")
    assert nxd_lnc("trn2") == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert nxd_lnc("trn2") == 2
    # a 32-rank tp 4 job: Trn1's strided groups only when the platform says Trn1
    monkeypatch.setenv(PLATFORM_ENV, "generic")
    assert start({"world": 32, "tp": 4, "pp": 1, "dp": 8, "ep": 1}, 0)[1].lists[0][0] == [0, 1, 2, 3]
    monkeypatch.setenv(PLATFORM_ENV, "trn1")
    assert start({"world": 32, "tp": 4, "pp": 1, "dp": 8, "ep": 1}, 0)[1].lists[0][0] == [0, 8, 16, 24]


def test_gloo_keeps_its_own_order(monkeypatch):
    """Off XLA: tp fastest, then pp, then dp, whatever the platform says."""
    monkeypatch.setenv(PLATFORM_ENV, "trn1")

    class Gloo(Recorder):
        name = "gloo"
        keeps_order = False

    comm = Gloo(5, 16)
    par = init_parallel(4, 2, 2, comm.device, 1.0, comm=comm)
    assert (par.dp_rank, par.pp_rank, par.tp_rank) == (0, 1, 1) and par.tp_group.ranks == [4, 5, 6, 7]
    assert par.global_rank(1, 0, 3) == 11


def test_xla_groups_keep_nxds_order():
    """XLA's groups are made as given (a LOGIC2 dp group [48, 32] has 48 as its rank 0)."""
    from trainer.comm.xla import XlaComm

    assert XlaComm.keeps_order and not Comm.keeps_order
    made = Recorder(32, 64).new_groups([[48, 32], [32, 48], [0, 16]])
    assert (made[frozenset((32, 48))].ranks, made[frozenset((32, 48))].rank) == ([48, 32], 1)
