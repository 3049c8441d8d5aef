"""The layout (`ParallelDims`): its checks, coordinates and key, and the mesh it builds, each
purpose's ranks checked on real processes."""

import pytest
import torch
import torch.distributed as dist

from optimus.runtime import ParallelDims, destroy_distributed, init_distributed, launch_env
from optimus.runtime.dims import MESH_DIMS, PURPOSES

# --- layout --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dims, message",
    [
        ({"dp": 4, "ep": 3}, "ep=3 does not divide dp=4: .* choose ep among \\[1, 2, 4\\]"),
        ({"dp": 0}, "dp must be a positive integer, got 0"),
        ({"dp": 2, "cp": 2, "ep": 3}, "ep=3 is not a multiple of cp=2: .* among \\[2, 4\\] or 1"),
        ({"dp": 3, "cp": 2, "ep": 4}, "ep=4 does not divide dp=3 \\(ep / cp = 2\\)"),
        ({"cp": 0}, "cp must be a positive integer, got 0"),
        ({"dp": 4, "replicas": 3}, "replicas=3 does not divide dp=4: .* among \\[1, 2, 4\\]"),
        ({"dp": 4, "replicas": 2, "ep": 4},
         "ep=4 does not divide a replica's dp \\(dp / replicas\\)=2: .* among \\[1, 2\\]"),
        ({"virtual_stages": 0}, "virtual_stages must be a positive integer, got 0"),
    ],
)
def test_parallel_dims_validation(dims, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**dims)


def test_coords_sizes_and_key():
    dims = ParallelDims(dp=4, tp=2, pp=2, ep=2, virtual_stages=3)
    assert (dims.edp, dims.world_size, dims.stages) == (2, 16, 6)
    # rank = ((((pp * rep + rep_i) * edp + edp_i) * epd + epd_i) * cp + cp_i) * tp + tp_i
    assert dims.coords(13) == {"pp": 1, "rep": 0, "edp": 1, "epd": 0, "cp": 0, "tp": 1,
                               "dp": 2, "ep": 0, "fsdp": 2, "eshard": 1}
    assert {purpose: dims.size(purpose) for purpose in PURPOSES} == {
        "batch": 4, "tokens": 4, "loss": 8, "world": 16, "pipeline": 2, "tensor": 2,
        "context": 1, "sequence": 2, "stage": 8, "shard": 4, "replicas": 1, "experts": 2,
        "expert_shard": 2}
    assert dims.key() == "dp4.tp2.pp2.ep2.vs3"  # checkpoints hold it: it stays as it was
    with pytest.raises(ValueError, match="'replica' is not a purpose"):
        dims.size("replica")


def test_context_parallel_coords_sizes_and_key():
    """cp ranks are neighbours inside tp; experts borrow them whole (ep = epd x cp)."""
    dims = ParallelDims(dp=2, cp=2, tp=2, ep=2)
    assert (dims.world_size, dims.epd, dims.edp) == (8, 1, 2)
    assert dims.coords(6) == {"pp": 0, "rep": 0, "edp": 1, "epd": 0, "cp": 1, "tp": 0,
                              "dp": 1, "ep": 1, "fsdp": 3, "eshard": 1}
    assert {purpose: dims.size(purpose) for purpose in PURPOSES} == {
        "batch": 2, "tokens": 2, "loss": 4, "world": 8, "pipeline": 1, "tensor": 2,
        "context": 2, "sequence": 4, "stage": 8, "shard": 4, "replicas": 1, "experts": 2,
        "expert_shard": 2}
    assert dims.key() == "dp2.tp2.pp1.ep2.vs1.cp2"
    # Without expert parallelism the experts shard as the dense weights, over dp x cp.
    assert ParallelDims(dp=2, cp=2).size("expert_shard") == 4
    assert ParallelDims(dp=4, cp=2, ep=4).coords(7)["ep"] == 3


def test_a_section_names_the_degrees():
    class Section:  # a job's `parallel` section: the degrees and more
        dp, tp, pp, ep, virtual_stages, schedule = -1, 2, 1, 1, 2, "1f1b"

    assert ParallelDims.of(Section(), dp=3) == ParallelDims(dp=3, tp=2, virtual_stages=2)


def test_single_process_mesh_without_env():
    """One process: a HashStore group, so collectives and the mesh need no variables."""
    env = launch_env({})
    init_distributed(env, "gloo", torch.device("cpu"))
    init_distributed(env, "gloo", torch.device("cpu"))  # idempotent
    try:
        with pytest.raises(ValueError, match="needs 2 ranks .* the process group has 1"):
            ParallelDims(dp=2).build_mesh("cpu")
        mesh = ParallelDims().build_mesh("cpu")
        # pp, edp and tp only: dimensions of one rank are no groups to make, but those three
        assert mesh.device_mesh.mesh_dim_names == ("pp", "edp", "tp")
        for purpose in PURPOSES:
            assert mesh.size(purpose) == 1 and mesh.rank(purpose) == 0
            assert mesh.own_group(purpose) is None
        assert mesh.mesh("batch").size() == 1 and mesh.mesh("shard").size() == 1
        with pytest.raises(ValueError, match="'cp' spans one rank here"):
            mesh.mesh("context")
        value = torch.tensor([3.0])
        dist.all_reduce(value, group=mesh.group("batch"))
        assert mesh.all_reduce("loss", value).item() == 3.0
        with pytest.raises(ValueError, match="'loss' spans"):
            mesh.group("loss")
    finally:
        destroy_distributed()
        destroy_distributed()
    assert not dist.is_initialized()


OWN = ("stage", "sequence", "experts", "loss")  # the purposes the plans take groups of their own of


def _gathered(group, rank: int) -> list[int]:
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.tensor([rank]), group=group)
    return [int(t) for t in gathered]


def _mesh_groups(rank, world_size, dims):
    """Each purpose's sum of ranks (`all_reduce`); a one-dimension purpose's group members,
    by all_gather, and this rank's place among them; an own group's members."""
    mesh = dims.build_mesh("cpu")
    out = {}
    for purpose, spanned in PURPOSES.items():
        total = int(mesh.all_reduce(purpose, torch.tensor([rank])))
        members = local = own = None
        if len(spanned) == 1:
            members, local = [rank], mesh.rank(purpose)
            if mesh.size(purpose) > 1:
                members = _gathered(mesh.group(purpose), rank)
        if purpose in OWN:
            group = mesh.own_group(purpose)
            own = [rank] if group is None else _gathered(group, rank)
        out[purpose] = (members, total, local, own)
    return out


def _check_mesh(dims, results):
    for rank, groups in enumerate(results):
        mine = dims.coords(rank)
        for purpose, (members, total, local, own) in groups.items():
            spanned = {d for dim in PURPOSES[purpose] for d in dims.inner(dim)}
            peers = [r for r in range(dims.world_size)
                     if all(dims.coords(r)[d] == mine[d] for d in MESH_DIMS if d not in spanned)]
            assert total == sum(peers), (rank, purpose)
            if members is not None:
                (dim,) = PURPOSES[purpose]
                assert members == sorted(peers, key=lambda r: dims.coords(r)[dim]), (rank, purpose)
                assert local == mine[dim], (rank, purpose)
            if own is not None:
                assert sorted(own) == peers, (rank, purpose)


def test_mesh_8_ranks_pp_dp_tp_ep(run_ranks):
    dims = ParallelDims(dp=2, tp=2, pp=2, ep=2)
    assert dims.edp == 1
    results = run_ranks(_mesh_groups, 8, dims)
    _check_mesh(dims, results)
    five = results[5]  # pp 1, ep 0, tp 1
    assert five["shard"][0] == [5, 7] and five["pipeline"][0] == [1, 5]
    assert five["loss"][1] == 1 + 3 + 5 + 7 and five["world"][1] == sum(range(8))
    assert sorted(five["stage"][3]) == [4, 5, 6, 7] and sorted(five["sequence"][3]) == [4, 5]


def test_mesh_4_ranks_dp_with_experts(run_ranks):
    dims = ParallelDims(dp=4, ep=2)
    results = run_ranks(_mesh_groups, 4, dims)
    _check_mesh(dims, results)
    assert results[1]["experts"][0] == [0, 1] and results[1]["expert_shard"][0] == [1, 3]




def test_mesh_8_ranks_dp_cp_tp_ep(run_ranks):
    dims = ParallelDims(dp=2, cp=2, tp=2, ep=2)
    results = run_ranks(_mesh_groups, 8, dims)
    _check_mesh(dims, results)
    six = results[6]  # edp 1, cp 1, tp 0
    assert six["context"][0] == [4, 6] and six["experts"][0] == [4, 6]
    assert six["shard"][0] == [0, 2, 4, 6] and six["expert_shard"][0] == [2, 6]
    assert sorted(six["sequence"][3]) == [4, 5, 6, 7]
    assert six["loss"][1] == 0 + 2 + 4 + 6 and six["batch"][0] == [2, 6]


def test_replicas_split_dp_outermost_and_shard_inside_each():
    """HSDP: dp = replicas x shard; a replica's ranks are contiguous, experts borrow from them."""
    dims = ParallelDims(dp=4, replicas=2, ep=2, tp=2)
    assert (dims.shard_dp, dims.edp, dims.key()) == (2, 1, "dp4.tp2.pp1.ep2.vs1.r2")
    assert dims.coords(6) == {"pp": 0, "rep": 1, "edp": 0, "epd": 1, "cp": 0, "tp": 0,
                              "dp": 3, "ep": 1, "fsdp": 1, "eshard": 0}
    assert {p: dims.size(p) for p in ("batch", "shard", "replicas", "experts", "expert_shard",
                                      "loss")} == {"batch": 4, "shard": 2, "replicas": 2,
                                                   "experts": 2, "expert_shard": 1, "loss": 4}


def _hsdp_mesh(rank, world_size, dims):
    mesh = dims.build_mesh("cpu")
    both = mesh.mesh_of("replicas", "shard")
    return both.mesh_dim_names, both.mesh.tolist(), _gathered(mesh.group("replicas"), rank)


def test_mesh_4_ranks_replicas_of_a_shard(run_ranks):
    dims = ParallelDims(dp=4, replicas=2)
    results = run_ranks(_mesh_groups, 4, dims)
    _check_mesh(dims, results)
    assert results[1]["shard"][0] == [0, 1] and results[1]["replicas"][0] == [1, 3]
    names, grid, replicas = run_ranks(_hsdp_mesh, 4, dims)[2]
    assert names == ("rep", "edp") and grid == [[0, 1], [2, 3]] and replicas == [0, 2]


def _placements(rank, world_size, raw):
    from optimus.config import resolve_layout, validate_job
    from optimus.parallel.plan import build_parallel_model

    job = validate_job(raw, world=world_size)
    mesh = resolve_layout(job, world_size).build_mesh("cpu")
    model = build_parallel_model(job, mesh, torch.device("cpu"))
    weight = model.state_view().layers["0"].attention.wq.weight
    return [str(p) for p in weight.placements], tuple(weight.to_local().shape)


def test_hsdp_replicates_across_replicas_and_shards_inside_each(run_ranks):
    from test_parallel_matrix import base_job

    raw = base_job(replicas=2)
    raw["data"]["batch_size"] = 16
    for placements, local in run_ranks(_placements, 4, raw):
        assert placements == ["R", "S(0)"] and local == (32, 64)
