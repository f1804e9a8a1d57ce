"""The planner on paper: groups, boxes and bytes against hand-computed values and the paper's table.

Layouts are written p-t-d (training) and p_g-t_g (generation). The table's formulas hold for the
synthetic set (column/row matrices only, equal layers per stage), so there bytes must match them
for every rank, also at 70B size on 128 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import build_parser
from reshard.layout import (
    GenLayout,
    LayoutError,
    Param,
    contains,
    gen_box,
    gen_groups,
    train_box,
)
from reshard.plan import SCHEMES, make_plan, table_bytes
from reshard.shapes import (
    PRESETS,
    LlamaDims,
    check_heads,
    from_hf_config,
    llama_params,
    synthetic,
)
from transport.protocol import Layout

GB = 10**9
#: a small Llama whose every split divides at tp up to 4
SMALL = LlamaDims(hidden=256, intermediate=512, layers=4, heads=8, kv_heads=4, vocab=1024)


def layout(p: int, t: int, d: int) -> Layout:
    return Layout(dp=d, tp=t, pp=p)


def model_bytes(params: list[Param]) -> int:
    return sum(p.nbytes for p in params)


# --- the paper's 8-rank example -------------------------------------------------------------


def test_paper_example_groups() -> None:
    """1-4-2 → 1-2-2-2: generation TP at stride t/t_g = 2, micro-DP on consecutive ranks."""
    train, gen = layout(1, 4, 2), GenLayout(tp=2)
    groups = gen_groups(train, gen, "hybridflow")
    assert groups["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["micro_dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen_groups(train, gen, "standard")["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    params = llama_params(SMALL)
    members = {s: [g.members for g in make_plan(params, train, gen, s).groups] for s in SCHEMES}
    assert members["hybridflow"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert members["hybridflow-v"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert members["naive"] == members["verl"] == [list(range(8))]


def test_paper_example_boxes() -> None:
    """Rank 1 trains rows 16:32 of a 64-row column matrix (t=4) and generates rows 0:32 (t_g=2)
    with rank 0 of its micro-DP group, which trains rows 0:16."""
    w = Param("w", (64, 8), "column")
    train, gen = layout(1, 4, 2), GenLayout(tp=2)
    assert train_box(w, train, 1) == ((16, 32), (0, 8))
    assert gen_box(w, train, gen, 1, "hybridflow") == ((0, 32), (0, 8))
    assert gen_box(w, train, gen, 2, "hybridflow") == ((32, 64), (0, 8))
    plan = make_plan([w], train, gen, "hybridflow")
    assert plan.recv_bytes(1) == 16 * 8 * 4  # rank 0's rows, fp32


# --- HybridFlow grouping: training shard inside the generation shard --------------------------

LAYOUTS = [
    ((1, 4, 2), (1, 2)),
    ((1, 4, 1), (1, 1)),
    ((1, 2, 2), (1, 2)),
    ((2, 2, 2), (1, 2)),
    ((2, 4, 1), (2, 2)),
    ((4, 2, 1), (2, 1)),
    ((2, 4, 2), (1, 1)),
    ((4, 4, 1), (2, 2)),
]


@pytest.mark.parametrize(("ptd", "gen_pt"), LAYOUTS)
def test_training_box_inside_generation_box(
    ptd: tuple[int, int, int], gen_pt: tuple[int, int]
) -> None:
    train, gen = layout(*ptd), GenLayout(pp=gen_pt[0], tp=gen_pt[1])
    for param in llama_params(SMALL, train.pp):
        for rank in range(train.world_size):
            have = train_box(param, train, rank)
            if have is None:
                continue
            need = gen_box(param, train, gen, rank, "hybridflow")
            assert need is not None and contains(need, have), (param.name, rank)


def test_standard_grouping_breaks_containment() -> None:
    """The check above has teeth: with standard grouping rank 1 (rows 16:32 at t=4) generates
    rows 32:64 at t_g=2."""
    w = Param("w", (64, 8), "column")
    train, gen = layout(1, 4, 2), GenLayout(tp=2)
    need = gen_box(w, train, gen, 1, "standard")
    assert need == ((32, 64), (0, 8))
    have = train_box(w, train, 1)
    assert have is not None and not contains(need, have)


# --- bytes per rank against the paper's table ------------------------------------------------

SMALL_PAIRS = [
    ((1, 4, 2), (1, 2)),
    ((1, 4, 1), (1, 2)),
    ((1, 4, 1), (1, 1)),
    ((1, 2, 2), (1, 1)),
    ((2, 2, 2), (1, 2)),
    ((2, 4, 1), (2, 2)),
    ((4, 2, 2), (2, 1)),
]
#: 70B-sized (140 GB in 16-bit) on 128 ranks
BIG_PAIRS = [
    ((1, 8, 16), (1, 4)),
    ((1, 8, 16), (1, 2)),
    ((1, 8, 16), (1, 1)),
    ((2, 8, 8), (1, 4)),
    ((4, 8, 4), (2, 4)),
    ((8, 4, 4), (1, 2)),
]


def assert_table_holds(params: list[Param], train: Layout, gen: GenLayout) -> None:
    model = model_bytes(params)
    for scheme in SCHEMES:
        plan = make_plan(params, train, gen, scheme)
        expected = table_bytes(scheme, train, gen, model)
        got = [plan.recv_bytes(r) for r in range(train.world_size)]
        assert got == [pytest.approx(expected, rel=1e-12)] * len(got), scheme


@pytest.mark.parametrize(("ptd", "gen_pt"), SMALL_PAIRS)
def test_recv_bytes_equal_table_small(ptd: tuple[int, int, int], gen_pt: tuple[int, int]) -> None:
    params = synthetic(64 << 20, layers=8, stages=ptd[0], hidden=256)
    assert_table_holds(params, layout(*ptd), GenLayout(pp=gen_pt[0], tp=gen_pt[1]))


@pytest.mark.parametrize(("ptd", "gen_pt"), BIG_PAIRS)
def test_recv_bytes_equal_table_70b_on_128_ranks(
    ptd: tuple[int, int, int], gen_pt: tuple[int, int]
) -> None:
    params = synthetic(140 * GB, layers=80, stages=ptd[0], hidden=8192)
    assert model_bytes(params) == pytest.approx(140 * GB, rel=0.01)
    assert_table_holds(params, layout(*ptd), GenLayout(pp=gen_pt[0], tp=gen_pt[1]))


def test_hybridflow_volume_70b_by_hand() -> None:
    """1-8-16 → 1-4: each rank holds M/8, generates with M/4, so receives M/8."""
    params = synthetic(140 * GB, layers=80, hidden=8192)
    plan = make_plan(params, layout(1, 8, 16), GenLayout(tp=4), "hybridflow")
    assert plan.summary()["recv_bytes_max"] == model_bytes(params) // 8
    assert plan.summary()["gen_bytes_max"] == model_bytes(params) // 4


def test_same_tp_moves_nothing() -> None:
    """tp 2 → 2: every rank already holds its generation shard."""
    params = llama_params(SMALL)
    plan = make_plan(params, layout(1, 2, 2), GenLayout(tp=2), "hybridflow")
    for rank in range(4):
        assert plan.recv_bytes(rank) == plan.send_bytes(rank) == plan.peak_bytes(rank) == 0
    assert plan.gen_bytes(0) == plan.reused_bytes(0)
    assert all(g.buckets == [] for g in plan.groups)


# --- FSDP-sharded training weights ----------------------------------------------------------


@pytest.mark.parametrize(
    ("ptd", "gen_pt"), [((1, 4, 2), (1, 2)), ((2, 2, 2), (1, 2)), ((1, 8, 16), (1, 4))]
)
def test_fsdp_volume(ptd: tuple[int, int, int], gen_pt: tuple[int, int]) -> None:
    """Each rank holds M/(t·p·d): HybridFlow receives M/(t_g·p_g) - M/(t·p·d); the others
    gather over every rank."""
    train, gen = layout(*ptd), GenLayout(pp=gen_pt[0], tp=gen_pt[1])
    params = synthetic(2 * GB, layers=8, stages=train.pp, hidden=1024)
    model, n = model_bytes(params), train.world_size
    hybrid = make_plan(params, train, gen, "hybridflow", fsdp=True)
    want = model / (gen.tp * gen.pp) - model / n
    assert [hybrid.recv_bytes(r) for r in range(n)] == [pytest.approx(want, rel=1e-12)] * n
    assert len(hybrid.groups[0].members) == train.dp * gen.micro_dp(train)
    naive = make_plan(params, train, gen, "naive", fsdp=True)
    assert naive.summary()["recv_bytes_max"] == pytest.approx((n - 1) / n * model, rel=1e-12)


# --- buckets -------------------------------------------------------------------------------


def test_buckets_by_hand() -> None:
    """8 matrices of 128x128 fp16 (32 KiB each), 64 KiB buckets: 2 matrices a bucket; verl
    takes one parameter at a time."""
    params = synthetic(4 * 2 * 128 * 128 * 2, layers=4, hidden=128)
    assert [p.shape for p in params[:2]] == [(128, 128), (128, 128)]
    train, gen = layout(1, 2, 1), GenLayout(tp=1)
    assert len(make_plan(params, train, gen, "naive", bucket_bytes=64 << 10).groups[0].buckets) == 4
    assert len(make_plan(params, train, gen, "verl", bucket_bytes=64 << 10).groups[0].buckets) == 8


# --- errors --------------------------------------------------------------------------------


def test_gen_tp_must_divide_training_tp() -> None:
    with pytest.raises(LayoutError, match="t_g=3, p_g=1 must divide training t=4"):
        make_plan(llama_params(SMALL), layout(1, 4, 1), GenLayout(tp=3))


def test_split_must_divide() -> None:
    w = Param("w", (6, 4), "column")
    with pytest.raises(LayoutError, match=r"w: column-split of shape \[6, 4\] over 4 ranks"):
        make_plan([w], layout(1, 4, 1), GenLayout(tp=2))


def test_unknown_scheme() -> None:
    with pytest.raises(LayoutError, match="scheme 'megatron': pick one of hybridflow"):
        make_plan(llama_params(SMALL), layout(1, 2, 1), GenLayout(), "megatron")  # type: ignore[arg-type]


def test_heads_must_split_whole() -> None:
    check_heads(PRESETS["llama2-70b"], 8)
    with pytest.raises(LayoutError, match="tp=16 must divide heads=64 and kv_heads=8"):
        check_heads(PRESETS["llama2-70b"], 16)


# --- the parameter sets --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("llama2-7b", 6_738_415_616),
        ("llama2-13b", 13_015_864_320),
        ("llama3-8b", 8_030_261_248),
        ("llama2-70b", 68_976_648_192),
    ],
)
def test_presets_match_published_sizes(name: str, count: int) -> None:
    assert sum(p.numel for p in llama_params(PRESETS[name])) == count


def test_stages_spread_layers_evenly() -> None:
    params = {p.name: p for p in llama_params(PRESETS["llama2-7b"], stages=4)}
    assert params["model.embed_tokens.weight"].stage == 0
    assert params["model.layers.7.mlp.down_proj.weight"].stage == 0
    assert params["model.layers.8.self_attn.q_proj.weight"].stage == 1
    assert params["model.layers.31.input_layernorm.weight"].stage == 3
    assert params["model.norm.weight"].stage == params["lm_head.weight"].stage == 3
    kinds = {n.rsplit(".", 2)[-2]: p.split for n, p in params.items() if ".layers.0." in n}
    assert kinds == {
        **dict.fromkeys(["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], "column"),
        **dict.fromkeys(["o_proj", "down_proj"], "row"),
        **dict.fromkeys(["input_layernorm", "post_attention_layernorm"], "replicated"),
    }


def test_tied_embeddings_list_one_matrix() -> None:
    tied = LlamaDims(**{**SMALL.__dict__, "tied": True})
    names = [p.name for p in llama_params(tied)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_from_hf_config_matches_the_tiny_model(tmp_path: Path) -> None:
    """The tiny Llama the roles build: every parameter's name and shape, fp32."""
    from roles.modeling.models import init_model, load_causal_lm, load_config

    folder = init_model(tmp_path / "tiny", "tiny", seed=0)
    dims = from_hf_config(folder)
    assert dims == from_hf_config(load_config(folder))
    assert dims.itemsize == 4
    model = load_causal_lm(folder)
    want = {name: tuple(t.shape) for name, t in model.named_parameters()}
    assert {p.name: p.shape for p in llama_params(dims)} == want


def test_from_hf_config_names_the_missing_field() -> None:
    with pytest.raises(LayoutError, match="no 'hidden_size'"):
        from_hf_config({"num_attention_heads": 4})


# --- the command line, in-process ----------------------------------------------------------


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    args = build_parser().parse_args(["reshard-plan", *argv])
    code = args.fn(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plans_70b_on_128_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama2-70b", "--train", "1-8-16", "--gen", "1-4", "--json"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    result = json.loads(out)
    assert (result["world"], result["gen"]) == (128, "1-4-2")
    rows = {row["scheme"]: row for row in result["plans"]}
    assert list(rows) == list(SCHEMES)
    for row in rows.values():  # norms stay replicated: within 0.01% of the formula
        assert row["recv_bytes_max"] == pytest.approx(row["formula_bytes"], rel=1e-4)
        assert row["plan_s"] < 60  # seconds on an idle core; this only catches blow-ups
    assert (rows["hybridflow"]["group_count"], rows["hybridflow"]["group_size"]) == (64, 2)


def test_cli_paper_example_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama2-7b", "--train", "1-4-2", "--gen", "1-2", "--json"]
    code, out, _ = run_cli(argv, capsys)
    result = json.loads(out)
    assert code == 0 and result["gen_tp_groups"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert result["plans"][0]["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    code, out, _ = run_cli(["--train", "1-4-2", "--gen", "1-2", "--scheme", "naive"], capsys)
    assert code == 0 and "naive" in out and "hybridflow-v" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--train", "1-4-2", "--gen", "1-3"], "must divide training t=4"),
        (["--train", "1-4", "--gen", "1-2"], "expected P-T-D"),
        (["--train", "1-4-2", "--gen", "1-2-3"], "d_g must be P·T/(PG·TG) = 2"),
        (["--model", "no-such-model"], "neither a preset"),
        (["--model", "llama2-70b", "--train", "1-16-1", "--gen", "1-2"], "tp=16 must divide"),
    ],
)
def test_cli_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and message in err


def test_cli_fsdp_formula(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--train", "1-4-2", "--gen", "1-2", "--fsdp", "--scheme", "hybridflow", "--json"]
    code, out, _ = run_cli(argv, capsys)
    row = json.loads(out)["plans"][0]
    model = sum(p.nbytes for p in llama_params(PRESETS["llama2-7b"]))
    assert code == 0 and row["formula_bytes"] == pytest.approx(model / 2 - model / 8)
    assert row["recv_bytes_max"] == pytest.approx(row["formula_bytes"], rel=1e-4)
