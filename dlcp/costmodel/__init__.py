"""Cost model: when does a codec pay? (Agarwal et al., MLSys 2022)."""
