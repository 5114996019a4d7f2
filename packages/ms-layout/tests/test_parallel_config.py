"""ParallelConfig against tables computed by hand in Megatron's order (tp fastest, pp slowest)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_layout import Layout, LayoutError, ParallelConfig, Role, optimizer_layout, param_placement, weight_layout
from ms_layout.weights import layer_stages

# 8 ranks, tp=2, pp=2, dp=2, order tp-cp-ep-dp-pp: rank = tp + 2*dp + 4*pp.
HAND_TP = [(0, 1), (2, 3), (4, 5), (6, 7)]
HAND_DP = [(0, 2), (1, 3), (4, 6), (5, 7)]
HAND_PP = [(0, 4), (1, 5), (2, 6), (3, 7)]
HAND_MP = [(0, 1, 4, 5), (2, 3, 6, 7)]  # tp-pp: Megatron's model-parallel group


def test_groups_match_hand_table_8_ranks():
    cfg = ParallelConfig(dp=2, tp=2, pp=2)
    assert cfg.world_size == 8
    assert cfg.groups("tp") == HAND_TP
    assert cfg.groups("dp") == HAND_DP
    assert cfg.groups("pp") == HAND_PP
    assert cfg.groups("tp-pp") == HAND_MP
    assert cfg.coords(6) == {"tp": 0, "cp": 0, "dp": 1, "pp": 1, "ep": 0, "edp": 1}
    assert cfg.group("dp", 5) == (5, 7)
    assert cfg.stage_ranks(1) == (4, 5, 6, 7)


def test_cp_and_ep_groups_by_hand():
    # 8 ranks: tp=2, cp=2, dp=2, ep=2. Dense: rank = tp + 2*cp + 4*dp.
    # Expert (tp-ep-edp-pp): rank = tp + 2*ep + 4*edp, so ep spans the cp ranks here.
    cfg = ParallelConfig(dp=2, tp=2, cp=2, ep=2)
    assert cfg.groups("cp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert cfg.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert cfg.groups("dp-cp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert cfg.groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert cfg.groups("edp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    with pytest.raises(LayoutError, match="mixes axes"):
        cfg.groups("ep-dp")


def test_other_order_puts_dp_fastest():
    cfg = ParallelConfig(dp=2, tp=2, order="dp-tp-cp-ep-pp")
    assert cfg.groups("dp") == [(0, 1), (2, 3)]
    assert cfg.groups("tp") == [(0, 2), (1, 3)]


def test_weight_layouts_of_standard_decoder():
    cfg = ParallelConfig(dp=2, tp=2, pp=2)
    col = weight_layout(cfg, Role.COLUMN, 2, stage=1)
    assert col.ranks == (4, 5, 6, 7)
    assert col.shard_shape((8, 6)) == (4, 6)
    assert col.global_slice((8, 6), 5) == (slice(4, 8), slice(0, 6))
    row = weight_layout(cfg, "row", 2, stage=0)
    assert row.global_slice((6, 8), 1) == (slice(0, 6), slice(4, 8))
    assert weight_layout(cfg, "row", 1).splits == (1,)  # row-parallel bias is replicated
    assert weight_layout(cfg, "vocab").splits == (2, 1)
    assert weight_layout(cfg, "replicated", 1).replica_count == 4
    experts = weight_layout(ParallelConfig(dp=2, ep=2, tp=2), Role.EXPERT_COLUMN, 3)
    assert experts.splits == (2, 2, 1)
    with pytest.raises(LayoutError, match="unknown role 'diagonal'"):
        weight_layout(cfg, "diagonal")
    with pytest.raises(LayoutError, match=r"ndim=3"):
        weight_layout(cfg, "column", 3)


def test_optimizer_shard_splits_dim0_over_replicas():
    cfg = ParallelConfig(dp=2, tp=2, optimizer_shard=True)
    opt = optimizer_layout(cfg, Role.COLUMN, 2)
    assert opt.dims[0] == ("tp", "dp")
    # tp chunk of rank 1 (tp=1) is rows 4:8; dp=0 takes its first half.
    assert opt.global_slice((8, 4), 1) == (slice(4, 6), slice(0, 4))
    assert opt.replica_count == 1
    plain = optimizer_layout(ParallelConfig(dp=2, tp=2), Role.COLUMN, 2)
    assert plain.dims[0] == ("tp",)


def test_param_placement_by_hf_name():
    cfg = ParallelConfig(dp=4, tp=2, pp=2, ep=2)
    place = param_placement(cfg, "model.layers.3.self_attn.q_proj.weight", 2, num_layers=4)
    assert (place.role, place.stage) == (Role.COLUMN, 1)
    assert param_placement(cfg, "model.embed_tokens.weight", 2, 4).stage == 0
    assert param_placement(cfg, "lm_head.weight", 2, 4).stage == 1
    assert param_placement(cfg, "model.norm.weight", 1, 4).role is Role.REPLICATED
    assert param_placement(cfg, "model.layers.0.mlp.gate.weight", 2, 4).role is Role.REPLICATED
    assert param_placement(cfg, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", 2, 4).role is Role.REPLICATED
    # Expert 5 of 8 with ep=2 belongs to ep rank 1; stage 1 ranks with ep=1 (rank = tp + 2ep + 4edp + 8pp).
    expert = param_placement(cfg, "model.layers.3.mlp.experts.5.down_proj.weight", 2, 4, num_experts=8)
    assert expert.layout.ranks == (10, 11, 14, 15)
    assert expert.layout.splits == (1, 2)
    with pytest.raises(LayoutError, match="no layout rule for parameter 'model.foo'"):
        param_placement(cfg, "model.foo", 2, 4)


def test_layer_stages_even_uneven_and_virtual():
    assert layer_stages(4, pp=2) == [0, 0, 1, 1]
    assert layer_stages(4, pp=2, vpp=2) == [0, 1, 0, 1]
    assert layer_stages(5, pp=2, layers_per_chunk=[2, 3]) == [0, 0, 1, 1, 1]
    with pytest.raises(LayoutError, match="do not split evenly"):
        layer_stages(5, pp=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 0}, "dp=0"),
        ({"tp": -2}, "tp=-2"),
        ({"pp": 1.5}, "pp=1.5"),
        ({"dp": 3, "ep": 2}, "ep=2 must divide dp\\*cp=3"),
        ({"order": "tp-dp-pp"}, "order 'tp-dp-pp'"),
        ({"dp": 2, "tp": 2, "ep": 2, "order": "ep-tp-cp-dp-pp"}, "keep ep between tp and pp"),
    ],
)
def test_bad_config_names_the_value(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelConfig(**kwargs)


def test_world_size_checks():
    cfg = ParallelConfig.for_world(8, tp=2, pp=2)
    assert cfg.dp == 2
    with pytest.raises(LayoutError, match="needs dp\\*tp\\*cp\\*pp=8 ranks, but the job has 6"):
        cfg.check_world_size(6)
    with pytest.raises(LayoutError, match="world size 6 is not a positive multiple of tp\\*cp\\*pp=4"):
        ParallelConfig.for_world(6, tp=2, pp=2)


# ---------------------------------------------------------------- closed-form rank arithmetic
# stage_ranks, the expert owner's ranks and the mesh agreement check slice the position grid with
# numpy; the reference here walks every rank through Layout.coords, as they did before.
_SIZES = st.sampled_from([1, 2, 3, 4])
_ORDERS = st.sampled_from(
    ["tp-cp-ep-dp-pp", "tp-ep-cp-dp-pp", "dp-tp-cp-ep-pp", "tp-cp-dp-ep-pp", "ep-tp-cp-dp-pp", "tp-cp-dp-pp-ep"]
)  # the last two interleave ep with tp or pp: refused


@st.composite
def _configs(draw):
    tp, cp, dp, pp = draw(_SIZES), draw(_SIZES), draw(_SIZES), draw(_SIZES)
    ep = draw(st.sampled_from([d for d in range(1, dp * cp + 1) if dp * cp % d == 0]))
    return dict(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, order=draw(_ORDERS))


def _enumerated_error(sizes: dict) -> str | None:
    """The first rank whose tp/pp coordinates differ between the meshes, by walking every rank."""
    fastest = sizes["order"].split("-")
    dense = Layout(*_mesh_of(fastest, "ep", sizes))
    expert = Layout(*_mesh_of([("edp" if t == "dp" else t) for t in fastest], "cp", sizes))
    for rank in range(dense.rank_count):
        a, b = dense.coords(rank), expert.coords(rank)
        for axis in ("tp", "pp"):
            if a[axis] != b[axis]:
                return f"rank {rank} {axis}={a[axis]} in the dense mesh but {axis}={b[axis]}"
    return None


def _mesh_of(fastest: list[str], drop: str, sizes: dict) -> tuple:
    full = dict(sizes, edp=sizes["dp"] * sizes["cp"] // sizes["ep"])
    names = tuple(reversed([t for t in fastest if t != drop]))
    return tuple(full[n] for n in names), names


@settings(max_examples=60, deadline=None)
@given(_configs())
def test_closed_form_ranks_equal_enumeration(sizes):
    expected = _enumerated_error(sizes)
    if expected is not None:
        with pytest.raises(LayoutError) as info:
            ParallelConfig(**sizes)
        assert expected in str(info.value)
        return
    cfg = ParallelConfig(**sizes)
    for stage in range(cfg.pp):
        walked = tuple(r for r in range(cfg.world_size) if cfg.mesh.coords(r)["pp"] == stage)
        assert cfg.stage_ranks(stage) == walked
        assert cfg.stage_mesh(stage).ranks == walked
        mesh = cfg.stage_mesh(stage, experts=True)
        assert mesh.ranks == tuple(sorted(walked, key=cfg.expert_mesh.position))
        layer = layer_stages(cfg.pp, cfg.pp).index(stage)
        for expert in range(cfg.ep):  # one expert per ep rank: expert e belongs to ep rank e
            got = param_placement(cfg, f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight", 2, cfg.pp, cfg.ep)
            assert got.layout.ranks == tuple(r for r in mesh.ranks if mesh.coords(r)["ep"] == expert)
