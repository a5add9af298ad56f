"""ParallelDims: factor validation and coordinates (pure), and the named mesh on 4 gloo ranks."""

import pytest
import torch.distributed as dist

from dist_utils import run_distributed
from hf_dist import ParallelDims


def test_left_over_factor_takes_the_remaining_ranks():
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 1, 2, 2)
    assert dims.dp == 2 and dims.tp_enabled and dims.pp_enabled and dims.fsdp_enabled


def test_from_sizes_and_ddp_layout():
    assert ParallelDims.from_sizes(8, tp=4).dp_shard == 2
    ddp = ParallelDims(world_size=4, dp_replicate=-1, dp_shard=1)
    assert ddp.dp == 4 and not ddp.fsdp_enabled


def test_product_mismatch_names_every_factor_and_the_world():
    with pytest.raises(ValueError) as err:
        ParallelDims(world_size=8, dp_replicate=1, dp_shard=3, tp=2, pp=1)
    message = str(err.value)
    for part in ("pp=1", "dp_replicate=1", "dp_shard=3", "tp=2", "world_size=8"):
        assert part in message


def test_left_over_that_does_not_divide():
    with pytest.raises(ValueError, match="does not divide 8"):
        ParallelDims(world_size=8, tp=3)


@pytest.mark.parametrize("bad", [dict(tp=0), dict(pp=-2), dict(dp_shard=-1, tp=-1)])
def test_bad_factors(bad):
    with pytest.raises(ValueError):
        ParallelDims(world_size=4, **bad)


def test_coordinates_put_tp_innermost():
    dims = ParallelDims(world_size=8, pp=2, dp_shard=2, tp=2)
    assert dims.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0, "dp": 0}
    assert dims.coordinates(1)["tp"] == 1 and dims.coordinates(1)["dp"] == 0
    assert dims.coordinates(2)["dp"] == 1
    assert dims.coordinates(4)["pp"] == 1
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError):
        dims.coordinates(8)


def test_cp_sits_between_dp_shard_and_tp():
    """CP ranks of one dp rank read the same batch: ``dp`` excludes cp; ``dp_cp`` counts both."""
    dims = ParallelDims(world_size=8, dp_shard=-1, cp=2, tp=2)
    assert (dims.dp_shard, dims.dp, dims.dp_cp) == (2, 2, 4)
    assert [dims.coordinates(r)["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="cp=3"):
        ParallelDims(world_size=8, dp_shard=1, cp=3)


def test_get_mesh_before_build():
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(world_size=1).get_mesh("tp")


def _mesh_groups(rank, world_size):
    dims = ParallelDims(world_size=world_size, dp_shard=2, tp=2)
    dims.build_mesh("cpu")
    out = {}
    for axis in ("tp", "dp", "dp_shard", "pp"):
        group = dims.get_mesh(axis).get_group()
        out[axis] = sorted(dist.get_process_group_ranks(group))
    out["coords"] = dims.coordinates(rank)
    return out


def test_mesh_groups_match_coordinates():
    results = run_distributed(_mesh_groups, 4)
    assert results[0]["tp"] == [0, 1] and results[2]["tp"] == [2, 3]
    assert results[0]["dp"] == [0, 2] and results[1]["dp"] == [1, 3]
    assert results[3]["pp"] == [3]
    for rank, result in enumerate(results):
        assert result["coords"]["tp"] == result["tp"].index(rank)
        assert result["coords"]["dp"] == result["dp"].index(rank)
