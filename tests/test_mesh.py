"""trainer/parallel/mesh.py: layout validation and group membership on a real 4-process gloo mesh."""
import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.launch import spawn
from trainer.parallel.mesh import ParallelDims, carved_groups, validate_layout


def test_validate_layout():
    assert validate_layout(8, tp=2, pp=2) == (2, None)
    assert validate_layout(4, dp=2, tp=2) == (2, None)
    dp, message = validate_layout(6, tp=4)
    assert dp is None and "not divisible by pp*cp*tp" in message and "\n" not in message
    dp, message = validate_layout(4, dp=4, tp=2)
    assert dp is None and "launch 8 processes" in message
    dp, message = validate_layout(4, cp=0)
    assert dp is None and "--cp must be an integer >= 1" in message
    assert validate_layout(8, tp=2, ep=2) == (4, None)  # ep is carved out of dp: not in the world-size product
    dp, message = validate_layout(6, ep=4)
    assert dp is None and "--ep 4 must divide the data-parallel size (6)" in message and "\n" not in message


def test_single_process_dims():
    dims = ParallelDims.build(1)
    assert (dims.size("dp"), dims.size("pp"), dims.size("cp"), dims.size("tp"), dims.size("dp_cp")) == (1, 1, 1, 1, 1)
    assert dims.group("dp") is None and dims.mesh("world") is None
    assert dims.summary() == "world 1 (single process)"
    with pytest.raises(ValueError, match="not divisible"):
        ParallelDims.build(3, tp=2)
    assert dims.group("dp_cp") is None and dims.mesh("tp") is None and dims.counts_loss and dims.counts_items


def test_unknown_dimension_name_raises():
    dims = ParallelDims.build(1)
    for lookup in (dims.group, dims.mesh):
        with pytest.raises(KeyError, match="tpp"):
            lookup("tpp")  # a typo fails loudly instead of answering "size 1"


def _rank(dp, pp, cp, tp, sizes):
    """Hand-computed global rank: tp fastest, then cp, then pp, then dp."""
    _, PP, CP, TP = sizes
    return ((dp * PP + pp) * CP + cp) * TP + tp


def _groups_worker(rank, world_size, out_dir):
    from trainer.parallel.mesh import _flatten_with_new_groups
    result = {}
    for name, layout in {"dp2_tp2": dict(tp=2), "pp2_cp2": dict(pp=2, cp=2)}.items():
        dims = ParallelDims.build(world_size, device_type="cpu", **layout)
        groups = {d: dist.get_process_group_ranks(dims.group(d))
                  for d in ("dp", "pp", "cp", "tp", "dp_cp")}
        fallback = _flatten_with_new_groups(dims.mesh("world"), ("dp", "cp"), "dp_cp")
        groups["dp_cp_fallback"] = dist.get_process_group_ranks(fallback.get_group())
        coords = [dims.rank("dp"), dims.rank("pp"), dims.rank("cp"), dims.rank("tp")]
        result[name] = {"groups": groups, "coords": coords, "sizes": [dims.size(d) for d in ("dp", "pp", "cp", "tp")],
                        "summary": dims.summary(), "counts": [dims.counts_loss, dims.counts_items],
                        "tp_mesh_ranks": dims.mesh("tp").mesh.tolist()}
    dims = ParallelDims.build(world_size, device_type="cpu", ep=2)  # dp 4, ep 2 carved out of it
    result["dp4_ep2"] = {"groups": {d: dist.get_process_group_ranks(dims.group(d)) for d in ("dp", "ep", "ep_replica")},
                         "sizes": [dims.size(d) for d in ("dp", "ep", "ep_replica")], "ep_rank": dims.rank("ep"),
                         "world": dims.world_size, "summary": dims.summary()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_mesh_groups(tmp_path):
    spawn(_groups_worker, 4, str(tmp_path), timeout=90, start_method="fork")
    for rank in range(4):
        result = json.load(open(tmp_path / f"rank{rank}.json"))
        for name, expected_sizes in {"dp2_tp2": (2, 1, 1, 2), "pp2_cp2": (1, 2, 2, 1)}.items():
            r = result[name]
            assert tuple(r["sizes"]) == expected_sizes
            dp, pp, cp, tp = r["coords"]
            assert _rank(dp, pp, cp, tp, expected_sizes) == rank
            D, P, C, T = expected_sizes
            expected = {
                "dp": [_rank(i, pp, cp, tp, expected_sizes) for i in range(D)],
                "pp": [_rank(dp, i, cp, tp, expected_sizes) for i in range(P)],
                "cp": [_rank(dp, pp, i, tp, expected_sizes) for i in range(C)],
                "tp": [_rank(dp, pp, cp, i, expected_sizes) for i in range(T)],
                "dp_cp": sorted(_rank(i, pp, j, tp, expected_sizes) for i in range(D) for j in range(C)),
            }
            expected["dp_cp_fallback"] = expected["dp_cp"]
            assert r["groups"] == expected, (name, rank)
            assert r["tp_mesh_ranks"] == expected["tp"]
            # the loss counts on the last pp stage's tp rank 0; token counts also on cp rank 0 only
            assert r["counts"] == [pp == P - 1 and tp == 0, pp == P - 1 and tp == 0 and cp == 0]
        # ep 2 within dp 4: slices [0, 1], [2, 3]; the same-position ranks [0, 2], [1, 3] hold the same experts
        ep = result["dp4_ep2"]
        assert ep["sizes"] == [4, 2, 2] and ep["world"] == 4 and ep["ep_rank"] == rank % 2
        assert ep["groups"] == {"dp": [0, 1, 2, 3], "ep": [rank - rank % 2, rank - rank % 2 + 1],
                                "ep_replica": [rank % 2, rank % 2 + 2]}
        assert ep["summary"].startswith("world 4 = dp 4 x pp 1 x cp 1 x tp 1, ep 2 within dp\n")
        assert ep["summary"].endswith(f"ep {ep['groups']['ep']}, ep_replica {ep['groups']['ep_replica']}")
    # Hand-computed lists for the record (rank 0's view).
    r0 = json.load(open(tmp_path / "rank0.json"))
    assert r0["dp2_tp2"]["groups"]["tp"] == [0, 1] and r0["dp2_tp2"]["groups"]["dp"] == [0, 2]
    assert r0["pp2_cp2"]["groups"]["cp"] == [0, 1] and r0["pp2_cp2"]["groups"]["pp"] == [0, 2]
    assert r0["pp2_cp2"]["groups"]["dp_cp"] == [0, 1]
    assert r0["dp2_tp2"]["summary"].startswith("world 4 = dp 2 x pp 1 x cp 1 x tp 2")
    assert "tp [0, 1]" in r0["dp2_tp2"]["summary"]


def test_carved_groups_with_context_parallel():
    """ep 2 carved out of dp with cp (and tp): the ep slices stay at one cp (and tp) coordinate, and each expert's
    replicas are every dp_cp rank at its slice position. Hand lists; rank = ((d*PP + p)*CP + c)*TP + t."""
    def world(dp, pp, cp, tp):
        return torch.arange(dp * pp * cp * tp).reshape(dp, pp, cp, tp)
    # dp2 x cp2, rank = 2d + c: ep joins the two dp ranks of one cp coordinate; the cp peers hold the same experts
    assert carved_groups(world(2, 1, 2, 1), "dp", 2) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    # dp4 x cp2: ep slices of dp groups [0, 2, 4, 6] and [1, 3, 5, 7]; experts of position 0 on d in {0, 2}, any c
    assert carved_groups(world(4, 1, 2, 1), "dp", 2) == ([[0, 2], [4, 6], [1, 3], [5, 7]],
                                                         [[0, 1, 4, 5], [2, 3, 6, 7]])
    # dp2 x cp2 x tp2, rank = 4d + 2c + t: every group at one tp coordinate
    assert carved_groups(world(2, 1, 2, 2), "dp", 2) == ([[0, 4], [1, 5], [2, 6], [3, 7]],
                                                         [[0, 2], [4, 6], [1, 3], [5, 7]])
    assert carved_groups(world(4, 1, 1, 1), "dp", 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])  # no cp: as before
