"""Generation (reserved): caches for KDA state, the MLA latent and the indexer's pooled keys, and `generate`.

The cache will ride on `glm53.model.ForwardContext.cache`. No code yet.
"""
