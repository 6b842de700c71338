"""Context parallelism on gloo: each rank runs one contiguous slice of every sequence and the result equals one
process on the whole sequences.

- `kda_sharded` (the KDA state-passing op) on cp 2 and 4 real ranks equals the chunk kernel on the whole
  sequence: output and every gradient, the initial state's included (its share summed over the ranks), and with
  packed documents starting before, at and after rank boundaries.
- The whole model (`parallelize(model, mesh)` on a ("cp",) or ("dp", "cp") mesh, `context_parallel_inputs`):
  loss and every loss part on every rank, every parameter gradient, the router biases after
  `update_router_bias` and each rank's logits equal one process, with activation checkpointing.
  T = 4 x the fast KDA chunk (32) + 5: cp does not divide it (right padding), and the cp slices (67 or 34 tokens)
  are no multiple of the k-pool (4), so pools straddle every rank boundary. Configs: KDA-only (+ MoE), and the
  hybrid KDA / MLA full / KDA / MLA shared with MTP, indexer KL, balance and z-loss, dense (index_topk >= T)
  and sparse regimes, padding, packed documents crossing rank boundaries.

Context-parallel helpers (glm53/model/cp.py) written out on one rank (a SequenceShards of size 1): document
fields of packed rows numbered as one process numbers them, halo starts, boundaries, and `ahead` at the depth edge;
on gloo, `context_parallel_inputs` of a packed row that 2 ranks do not divide, written out.

Legend: B batch, T time (the rank's slice, here the whole sequence), W the causal-conv halo width.
"""

from __future__ import annotations

import pytest
import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.kernels.kda import kda_chunk, l2norm
from glm53.model.cp import ahead, halo_starts, sharded_packing_fields
from glm53.model.packing import document_boundaries, starts_to_cu_seqlens
from tests.helpers.cp_inputs_edges_jobs import cp_inputs_job
from tests.helpers.cp_jobs import OneRank, cp_errors_job, cp_reference, cp_step, kda_sharded_job

REL_TOL = 1e-4  # fp32, relative to the largest magnitude of each reference tensor
BF16_REL = 5e-2  # bf16 parameters in compute: relative L2 error over all gradients / loss
T = 4 * 32 + 5
B = 2

KDA_ONLY = dict(
    layer_types=["linear_attention"] * 3,
    mlp_layer_types=["dense", "sparse", "sparse"],
    num_hidden_layers=3,
    num_nextn_predict_layers=0,
)
HYBRID = dict(
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    indexer_types=["full", "full", "full", "shared"],
    num_nextn_predict_layers=1,
    indexer_loss_weight=1.0,
)
LOSSES = dict(router_aux_loss_coef=0.01, router_z_loss_coef=1e-3)
TOPK = {"dense": 160, "sparse": 8}


# ------------------------------------------------------------------------------------------ the KDA op alone
def _kda_leaves(seed: int, T: int = 136):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    q, k = l2norm(torch.randn(B, T, 2, 8, **f64)), l2norm(torch.randn(B, T, 2, 8, **f64))
    v, gate = torch.randn(B, T, 2, 6, **f64), -torch.rand(B, T, 2, 8, **f64) * 2
    beta, S0 = torch.rand(B, T, 2, **f64), torch.randn(B, 2, 8, 6, **f64)
    return [x.requires_grad_() for x in (q, k, v, gate, beta, S0)]


def _doc_starts(T: int) -> torch.Tensor:
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [33, 34, 68, 70]] = True  # just before, at and just after rank boundaries (34, 68 at cp 4)
    starts[1, [10, 67]] = True  # row 1: rank 1 of cp 4 holds no start, its state passes through
    return starts


@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed"])
@pytest.mark.parametrize("cp", [2, 4], ids=lambda n: f"cp{n}")
def test_kda_sharded_equals_whole_sequence(pool2, pool4, cp, packed):
    leaves = _kda_leaves(cp)
    cot = torch.randn(B, 136, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    starts = _doc_starts(136) if packed else None
    if packed:
        flat = torch.nonzero(starts.flatten()).flatten()
        o = kda_chunk(*leaves[:5], cu_seqlens=torch.cat([flat, torch.tensor([B * 136])]))[0]
    else:
        o = kda_chunk(*leaves[:5], initial_state=leaves[5])[0]
    wrt = leaves[:5] if packed else leaves
    expected = torch.autograd.grad((o * cot).sum(), wrt)
    results = (pool2 if cp == 2 else pool4).run(
        kda_sharded_job, leaves=[x.detach() for x in leaves], cot=cot, doc_starts=starts
    )
    torch.testing.assert_close(torch.cat([r["o"] for r in results], 1), o.detach(), rtol=1e-10, atol=1e-12)
    for i, name in enumerate(["dq", "dk", "dv", "dg", "dbeta"]):
        got = torch.cat([r["grads"][i] for r in results], 1)
        torch.testing.assert_close(got, expected[i], rtol=1e-10, atol=1e-12, msg=name)
    if not packed:
        torch.testing.assert_close(sum(r["grads"][5] for r in results), expected[5], rtol=1e-10, atol=1e-12)


# -------------------------------------------------------------------------------------------- the whole model
def make_case(layers: dict, regime: str = "sparse", seed: int = 0, packed: bool = False, rows: int = B) -> dict:
    config = Glm53Config.tiny(**layers, **LOSSES, index_topk=TOPK[regime]).to_dict()
    config = {k: v for k, v in config.items() if k in Glm53Config.__dataclass_fields__ and k != "extra"}
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(Glm53Config(**config))
    with torch.no_grad():
        for router in model.routers():
            router.e_score_correction_bias.normal_(std=0.01, generator=torch.Generator().manual_seed(seed + 5))
        for name, p in model.named_parameters():  # an indexer KL well away from 0
            if ".indexer." in name and p.dim() == 2:
                p.normal_(std=0.3, generator=torch.Generator().manual_seed(seed + 7))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, config["vocab_size"], (rows, T), generator=torch.Generator().manual_seed(seed + 1))
    mask = torch.ones(rows, T, dtype=torch.long)
    mask[1, -6:] = 0  # right padding inside the last rank's slice
    mask[0, :3] = 0  # left padding: k-pools start at the first valid token
    position_ids = None
    if packed:  # documents start just before, at and after rank boundaries (67 at cp 2; 34, 68, 102 at cp 4)
        lengths = [[33, 1, 32, 2, 31, 34], [67, 40, 26]] * (rows // 2)
        position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    kwargs = dict(config=config, state=state, ids=ids, mask=mask, position_ids=position_ids)
    return dict(kwargs, reference=cp_reference(**kwargs))


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-12) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(floor)).item()


def check_parity(results: list[dict], reference: dict, cp: int) -> None:
    for rank, res in enumerate(results):
        assert rel_err(res["loss"], reference["loss"]) <= REL_TOL, (rank, res["loss"], reference["loss"])
        assert set(res["parts"]) == set(reference["parts"])
        for name, value in res["parts"].items():
            assert rel_err(value, reference["parts"][name]) <= REL_TOL, (rank, name, value, reference["parts"][name])
        assert set(res["grads"]) == set(reference["grads"])
        bad = {n: rel_err(g, reference["grads"][n]) for n, g in res["grads"].items()}
        worst = sorted(bad.items(), key=lambda item: item[1])[-3:]
        assert max(bad.values()) <= REL_TOL, f"rank {rank}: gradients differ from one process: {worst}"
        for name, bias in res["biases"].items():  # the expert loads of every rank's tokens
            assert torch.equal(bias, reference["biases"][name]), f"rank {rank}: {name}"
    per_dp = len(results) // cp
    logits = [torch.cat([results[d * cp + r]["logits"] for r in range(cp)], 1)[:, :T] for d in range(per_dp)]
    assert rel_err(torch.cat(logits), reference["logits"]) <= REL_TOL


CASES = {  # name: (case kwargs, dp, cp)
    "kda-cp2": (dict(layers=KDA_ONLY), 1, 2),
    "kda-packed-cp4": (dict(layers=KDA_ONLY, packed=True, seed=1), 1, 4),
    "hybrid-sparse-packed-cp2": (dict(layers=HYBRID, packed=True, seed=2), 1, 2),
    "hybrid-dense-cp4": (dict(layers=HYBRID, regime="dense", seed=3), 1, 4),
    "hybrid-sparse-packed-cp4": (dict(layers=HYBRID, packed=True, seed=4), 1, 4),
    "hybrid-sparse-dp2xcp2": (dict(layers=HYBRID, packed=True, seed=5, rows=4), 2, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_model_matches_one_process(pool2, pool4, name):
    case_kwargs, dp, cp = CASES[name]
    case = make_case(**case_kwargs)
    pool = pool2 if dp * cp == 2 else pool4
    inputs = {k: v for k, v in case.items() if k != "reference"}
    if name == "kda-packed-cp4":  # the same documents given as cu_seqlens over the flattened batch
        inputs["cu_seqlens"] = document_boundaries(B, T, torch.device("cpu"), position_ids=inputs.pop("position_ids"))
    results = pool.run(cp_step, dp=dp, cp=cp, checkpointing=True, **inputs)
    check_parity(results, case["reference"], cp)


def test_bf16_mixed_precision_cp2_is_finite_and_close(pool2):
    """FSDP's bf16 policy over the cp ranks (fp32 keep-list units): the loss and gradients stay near one fp32
    process (relative L2 over all gradients)."""
    case = make_case(HYBRID, packed=True, seed=6)
    reference = case.pop("reference")
    for res in pool2.run(cp_step, dp=1, cp=2, bf16=True, **case):
        assert torch.isfinite(res["loss"]) and all(torch.isfinite(g).all() for g in res["grads"].values())
        assert abs(res["loss"] - reference["loss"]) / reference["loss"] <= BF16_REL
        diff = torch.cat([(res["grads"][n] - g).flatten() for n, g in reference["grads"].items()])
        norm = torch.cat([g.flatten() for g in reference["grads"].values()])
        assert (diff.norm() / norm.norm()).item() <= BF16_REL


# ------------------------------------------------------------------------------------------ one process, cp 1
def test_one_rank_equals_the_plain_model():
    """The cp code path with a single rank (a SequenceShards of size 1) gives the plain model's numbers."""
    case_config = make_case(HYBRID, packed=True)
    model = Glm53ForCausalLM(Glm53Config(**case_config["config"]))
    model.load_state_dict(case_config["state"])
    ids, mask, pos = case_config["ids"], case_config["mask"], case_config["position_ids"]
    labels = ids.masked_fill(mask == 0, -100)
    plain = model(ids, attention_mask=mask, labels=labels, position_ids=pos)
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    counts = model.loss_counts(labels, mask, pos)
    sharded = model(ids, attention_mask=mask, labels=targets, position_ids=pos, cp=OneRank(T), loss_denominators=counts)
    for name in ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss"):
        torch.testing.assert_close(getattr(sharded, name), getattr(plain, name), msg=name)
    torch.testing.assert_close(sharded.logits, plain.logits)


def test_errors_name_the_problem():
    config = Glm53Config.tiny(**KDA_ONLY)
    model = Glm53ForCausalLM(config)
    ids = torch.randint(1, 300, (1, 12))
    with pytest.raises(ValueError, match="loss_denominators"):
        model(ids, labels=ids, cp=OneRank(12))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, cu_seqlens=torch.tensor([0, 5, 12]), cp=OneRank(12))


def test_setup_errors_name_the_problem(pool2):
    messages = pool2.run(cp_errors_job, config=Glm53Config.tiny(**KDA_ONLY).to_dict())[0]
    expected = [
        "parallelized with a cp dimension",
        "input_ids must be [batch, seq]",
        "labels must have the shape",
        "too short for 2 context-parallel ranks",
        "= 4 ranks, but the world has 2",
        "mesh dimensions ['dq'] are neither",
    ]
    for message, part in zip(messages, expected, strict=True):
        assert part in message, (part, message)


# ------------------------------------------------------------------------------------- context parallelism at its edges
def test_packed_rows_get_local_boundaries_and_one_process_document_numbers():
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    fields = sharded_packing_fields(position_ids, OneRank(5))
    assert fields["cu_seqlens"].tolist() == [0, 3, 5, 7, 10]
    assert fields["segment_ids"].tolist() == [[0, 0, 0, 1, 1], [2, 2, 3, 3, 3]]  # row 1 continues row 0's count


def test_a_row_whose_positions_do_not_start_at_zero_still_starts_a_document():
    fields = sharded_packing_fields(torch.tensor([[1, 2, 0, 1]]), OneRank(4))  # starts at 1, nothing before it
    assert fields["cu_seqlens"].tolist() == [0, 2, 4]
    assert fields["segment_ids"].tolist() == [[0, 0, 1, 1]]


def test_boundaries_add_row_starts_and_the_end():
    starts = torch.tensor([[False, False, True, False], [False, True, False, False]])
    assert starts_to_cu_seqlens(starts).tolist() == [0, 2, 4, 5, 8]


@pytest.mark.parametrize("width", [0, 1, 3])
def test_halo_starts_on_the_first_rank_start_at_its_first_position(width):
    segments = torch.tensor([[0, 0, 1, 1]])
    starts = halo_starts(segments, OneRank(4), width)
    assert starts.shape == (1, width + 4)
    # No tokens before the sequence: the halo is its own document, the slice's first token starts a new one.
    expected = [True] + [False] * (width - 1) + [True, False, True, False] if width else [True, False, True, False]
    assert starts[0].tolist() == expected


def test_ahead_reaches_the_depth_edge_and_refuses_past_it():
    x = torch.arange(1.0, 7.0).view(1, 6, 1)
    torch.testing.assert_close(ahead(x, 2, -1.0, OneRank(6)), torch.tensor([3.0, 4, 5, 6, -1, -1]).view(1, 6, 1))
    torch.testing.assert_close(ahead(x, 6, -1.0, OneRank(6)), torch.full((1, 6, 1), -1.0))  # d = T: all past the end
    mask = torch.tensor([[True, False, True]])
    assert ahead(mask, 1, False, OneRank(3)).tolist() == [[False, True, False]]
    with pytest.raises(ValueError, match="MTP depth 7 exceeds this rank's 6 positions"):
        ahead(x, 7, -1.0, OneRank(6))


def test_context_parallel_inputs_written_out(pool2):
    """T = 5 over 2 ranks (3 positions each, one padding token): the last rank gets the padding masked, its
    position continuing the last document and its target ignored; targets cross the rank edge; the loss
    denominators are the whole batch's."""
    ids = torch.tensor([[11, 12, 13, 14, 15]])
    config = Glm53Config.tiny(pad_token_id=0).to_dict()
    first, last = pool2.run(cp_inputs_job, config=config, ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
    assert first["cp"] == (0, 2, 0, 6) and last["cp"] == (1, 2, 3, 6)
    assert first["input_ids"].tolist() == [[11, 12, 13]] and last["input_ids"].tolist() == [[14, 15, 0]]
    assert first["attention_mask"].tolist() == [[1, 1, 1]] and last["attention_mask"].tolist() == [[1, 1, 0]]
    assert first["position_ids"].tolist() == [[0, 1, 2]] and last["position_ids"].tolist() == [[0, 1, 2]]
    assert first["labels"].tolist() == [[12, 13, 14]] and last["labels"].tolist() == [[15, -100, -100]]
    assert first["counts_match"] and last["counts_match"]
