"""Helpers for the generation tests: tiny random glm53 models and the greedy decode by full forwards."""

from __future__ import annotations

import torch

from glm53 import Glm53Config, Glm53ForCausalLM
from glm53.generation import GenerationCache
from tests.helpers.oracle import randomize

# Enough indexer heads that no two pools score exactly 0 (a sum of ReLUs): ties would make the top-k depend on the
# number of pools scored (README "Indexer ties"), which differs between a full forward and a decode step.
UNTIED_INDEXER = dict(index_n_heads=16)


def tiny_model(seed: int = 1, random_weights: bool = True, **overrides) -> Glm53ForCausalLM:
    """A tiny glm53 model in eval mode: every weight randomised at unit gain (tests/helpers/oracle.randomize), or
    with `random_weights=False` the model's own initialisation (init_weights, seeded)."""
    config = Glm53Config.tiny(**{**UNTIED_INDEXER, **overrides})
    torch.manual_seed(seed)
    model = Glm53ForCausalLM(config).eval()
    if random_weights:
        randomize(model, seed)
    return model


def left_padded(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded with id 0 -> (ids [B, P], mask [B, P])."""
    gen = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), P), generator=gen)
    mask = torch.ones_like(ids)
    for row, n in enumerate(lengths):
        mask[row, : P - n] = 0
    return ids.masked_fill(mask == 0, 0), mask


@torch.no_grad()
def greedy_by_full_forward(model, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy continuation with one full forward per token (no cache): the oracle in the sparse regime."""
    for _ in range(steps):
        nxt = model(ids, attention_mask=mask).logits[:, -1].argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


def case_inputs(spec: dict, shorter_by: int):
    """A test_incremental CASES entry -> (model, ids, mask, P, N): a left-padded batch of two rows, P + N tokens and
    `shorter_by` fewer."""
    model = tiny_model(random_weights=spec.get("random", False), **spec["config"])
    if "absorb" in spec:
        model.set_numerics(mla_absorb=spec["absorb"])
    P, N = spec["P"], spec["N"]
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - shorter_by])
    return model, ids, mask, P, N


def assert_matches_full(got: torch.Tensor, full: torch.Tensor, mask: torch.Tensor, rel_tol: float) -> None:
    """Logits at the real tokens agree to `rel_tol` of the full forward's largest logit."""
    valid = mask.bool()
    err = (got - full)[valid].abs().max().item()
    assert err <= rel_tol * full[valid].abs().max().item(), f"max abs error {err:.3e}"


def verify_rewind_decode(model, verify, decode, plan: list[tuple[int, int]], P: int, N: int, after=None):
    """From a P-token prefill of a left-padded batch of two (P + N and P + N - 3 tokens), for each (keep, wrong) of
    `plan`: mark, `verify(cache, chunk)` the next `keep` true tokens then `wrong` wrong ones, rewind to the true ones,
    `after(cache, t)`; then `decode(cache, ids[:, t])` one token at a time to P + N.
    -> (cache, logits of every real position [B, P + N, V], the full forward's, mask)."""
    ids, mask = left_padded(model.config.vocab_size, [P + N, P + N - 3])
    wrong = torch.randint(1, model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        full = model(ids, attention_mask=mask).logits
        cache = GenerationCache(model)
        steps = [model.lm_head(model.model(ids[:, :P], mask[:, :P], cache=cache))]
        t = P
        for keep, n_wrong in plan:
            cache.mark()
            chunk = torch.cat([ids[:, t : t + keep], wrong[:, :n_wrong]], dim=1)
            steps.append(model.lm_head(verify(cache, chunk))[:, :keep])
            cache.rewind(keep)
            t += keep
            if after is not None:
                after(cache, t)
        assert t < P + N
        steps += [model.lm_head(decode(cache, ids[:, s]).reshape(2, 1, -1)) for s in range(t, P + N)]
    return cache, torch.cat(steps, dim=1), full, mask
