"""The model computes, the losses score: Glm53ForCausalLM(labels=) is exactly the computing Glm53LMHeadModel's
LMOutput scored by glm53.losses.add_causal_lm_losses (same numbers, bit for bit), and the computing model returns
the statistics the losses read only when asked for them.

Legend: B batch, T time, vocab the vocabulary size.
"""

import torch

from glm53 import Glm53Config, Glm53ForCausalLM, Glm53LMHeadModel
from glm53.losses import CausalLMOutput, add_causal_lm_losses

CONFIG = dict(
    num_nextn_predict_layers=1, mtp_depth=2, indexer_loss_weight=1.0, router_aux_loss_coef=0.01, router_z_loss_coef=1e-3
)


def pair():
    torch.manual_seed(0)
    scored = Glm53ForCausalLM(Glm53Config.tiny(**CONFIG))
    computing = Glm53LMHeadModel(scored.config)
    computing.load_state_dict(scored.state_dict())
    return scored, computing


def test_the_computing_model_returns_statistics_only_when_asked():
    scored, computing = pair()
    ids = torch.randint(0, scored.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    computing.eval()
    plain = computing(ids)
    assert plain.stats == [] and plain.mtp == []
    torch.testing.assert_close(plain.logits, scored.eval()(ids).logits, rtol=0, atol=0)
    run = computing(ids, collect_stats=True, record_indexer=True, run_mtp=True, return_logits=False)
    assert run.logits is None and len(run.stats) == scored.config.num_hidden_layers
    moe = [s for s, layer in zip(run.stats, computing.model.layers) if layer.is_moe]
    assert moe and all(s.router_logits is not None and s.router_indices is not None for s in moe)
    # the recomputing indexer KL's record (the default): O(T) inputs, no [B, T, P] tensor
    assert any(s.indexer_inputs is not None and s.mass_inputs is not None for s in run.stats)
    assert all(s.index_scores is None and s.pool_mass is None and s.candidate is None for s in run.stats)
    assert len(run.mtp) == scored.config.mtp_depth and all(
        h.shape == (2, 19, scored.config.hidden_size) for h, _, _ in run.mtp
    )
    assert all(r.counted_load is None for r in computing.routers())  # eval mode counts nothing
    computing.train()
    computing(ids)
    main = [layer.mlp.gate for layer in computing.model.layers if layer.is_moe]
    assert main and all(r.counted_load is not None for r in main)  # a training forward counts the main routers


def test_labels_call_is_the_computing_output_scored():
    scored, computing = pair()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, scored.config.vocab_size, (2, 21), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    position_ids = torch.cat([torch.arange(9), torch.arange(12)])[None].expand(2, -1)
    want = scored(ids, labels=labels, position_ids=position_ids)
    run = computing(ids, position_ids=position_ids, collect_stats=True, record_indexer=True, run_mtp=True)
    got = CausalLMOutput(logits=run.logits, last_hidden_state=run.last_hidden_state)
    n_docs = run.ctx.cu_seqlens.shape[0] - 1
    add_causal_lm_losses(
        got, computing, labels, run.ctx.valid, run.stats, run.mtp, None, run.ctx.segment_ids, None, n_docs
    )
    for part in ("loss", "lm_loss", "mtp_loss", "aux_loss", "indexer_loss"):
        assert getattr(want, part) is not None and getattr(want, part) > 0, part
        torch.testing.assert_close(getattr(got, part), getattr(want, part), rtol=0, atol=0)
    (g_want,) = torch.autograd.grad(want.loss, scored.lm_head.weight)
    (g_got,) = torch.autograd.grad(got.loss, computing.lm_head.weight)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=0)
