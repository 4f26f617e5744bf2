"""Wrappers around a CausalLM (each a `models.base.Delegating`): logprobs recorded, `logit_bias` added, logits
masked to a grammar, forwards metered."""
