"""Mixture-of-experts plumbing below the model: the token dispatcher (which token goes to
which expert, and back) and the grouped expert GEMMs (docs/design.md "Mixture of experts")."""
